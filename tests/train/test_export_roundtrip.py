"""transformers → our loader → training → `gpucloud train export` → transformers: a model of
each family keeps its architecture (RoPE, windows, qk-norm, experts) through the round
trip, and transformers computes the same logits from the export as our loader does."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from hf_families import ROWS, build
from train_helpers import run_config

from gpucloud.models.loader import load_model
from gpucloud.models.spec import ModelSpec
from gpucloud.train.export import export

# Sliding window (16 < the 32-token training sequences) + RoPE theta; qk-norm + explicit
# head_dim + tied embeddings; mixture of experts; YaRN (cos/sin scaled).
ROUND_TRIP = ["mistral-sliding", "qwen3-head_dim-tied", "mixtral-moe", "qwen2.5-yarn"]


@pytest.mark.parametrize("row", [r for r in ROWS if r.name in ROUND_TRIP], ids=lambda r: r.name)
def test_train_export_keeps_the_architecture_and_the_logits(row, dataset, train_here, tmp_path):
    import transformers

    start = tmp_path / "hf"
    build(row, start, vocab=2048)  # the dataset's tokenizer has 2048 tokens
    data = run_config(dataset, "optim.max_steps=2", "optim.warmup_steps=0", "checkpoint.every=2")
    data["model"] = {"path": str(start)}
    _, _, trainer = train_here(data)

    out = tmp_path / "exported"
    assert export(tmp_path / "run", out)["step"] == 2
    before, after = ModelSpec.from_dir(start), ModelSpec.from_dir(out)
    same = dict(name="m", bos_token_id=None, eos_token_id=None)  # ids come from the tokenizer
    assert replace(after, **same) == replace(before, **same)

    ours = load_model(out)
    trained = trainer.par.model.state_dict()
    for key, tensor in ours.state_dict().items():
        assert torch.equal(tensor, trained[key]), key
    assert not torch.equal(ours.model.norm.weight, load_model(start).model.norm.weight)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    ids = torch.randint(3, 2048, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), theirs(ids).logits, rtol=0, atol=2e-5)
