"""Training runtime: config → launcher (torchrun) → trainer → checkpoints, metrics."""
