"""Executors start, watch and stop workload processes for the reconciler."""
