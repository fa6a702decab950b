"""Named architectures. Real models carry the values of their published config.json; every
count (parameters, FLOPs, KV bytes) is computed from these values by `ModelSpec`.

`tiny`, `tiny-moe` and `small` are for tests and demos; `gpucloud model init` writes random
weights for them (`gpucloud train` initializes any preset itself). `small` has the
shape of the peers benchmark model (44M parameters at vocab 32000).
"""

from __future__ import annotations

from pathlib import Path

from gpucloud.errors import unknown_name
from gpucloud.models.spec import ModelSpec

_LLAMA3_ROPE_405B = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}

PRESETS: dict[str, ModelSpec] = {
    s.name: s
    for s in [
        ModelSpec("tiny", "llama", vocab_size=2048, hidden_size=64, intermediate_size=176,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=2048, tie_word_embeddings=True),
        # tiny with a mixture of 4 experts, 2 per token: MoE training in tests and demos
        ModelSpec("tiny-moe", "mixtral", vocab_size=2048, hidden_size=64, intermediate_size=176,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=2048, tie_word_embeddings=True, num_local_experts=4,
                  num_experts_per_tok=2),
        ModelSpec("small", "llama", vocab_size=32000, hidden_size=512, intermediate_size=1408,
                  num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                  max_position_embeddings=4096),
        # meta-llama/Llama-2-{7,13,70}b-hf config.json
        ModelSpec("llama-2-7b", "llama", vocab_size=32000, hidden_size=4096,
                  intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                  num_key_value_heads=32, max_position_embeddings=4096),
        ModelSpec("llama-2-13b", "llama", vocab_size=32000, hidden_size=5120,
                  intermediate_size=13824, num_hidden_layers=40, num_attention_heads=40,
                  num_key_value_heads=40, max_position_embeddings=4096),
        ModelSpec("llama-2-70b", "llama", vocab_size=32000, hidden_size=8192,
                  intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                  num_key_value_heads=8, max_position_embeddings=4096),
        # meta-llama/Meta-Llama-3-{8,70}B config.json
        ModelSpec("llama-3-8b", "llama", vocab_size=128256, hidden_size=4096,
                  intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                  num_key_value_heads=8, max_position_embeddings=8192, rope_theta=500000.0,
                  bos_token_id=128000, eos_token_id=128001),
        ModelSpec("llama-3-70b", "llama", vocab_size=128256, hidden_size=8192,
                  intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                  num_key_value_heads=8, max_position_embeddings=8192, rope_theta=500000.0,
                  bos_token_id=128000, eos_token_id=128001),
        # meta-llama/Llama-3.1-405B config.json
        ModelSpec("llama-3.1-405b", "llama", vocab_size=128256, hidden_size=16384,
                  intermediate_size=53248, num_hidden_layers=126, num_attention_heads=128,
                  num_key_value_heads=8, max_position_embeddings=131072, rope_theta=500000.0,
                  rope_scaling=_LLAMA3_ROPE_405B, bos_token_id=128000, eos_token_id=128001),
        # Qwen/Qwen2.5-{7,72}B config.json
        ModelSpec("qwen2.5-7b", "qwen2", vocab_size=152064, hidden_size=3584,
                  intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                  num_key_value_heads=4, max_position_embeddings=131072, rope_theta=1000000.0,
                  rms_norm_eps=1e-6, attention_bias=True, bos_token_id=151643,
                  eos_token_id=151643),
        ModelSpec("qwen2.5-72b", "qwen2", vocab_size=152064, hidden_size=8192,
                  intermediate_size=29568, num_hidden_layers=80, num_attention_heads=64,
                  num_key_value_heads=8, max_position_embeddings=131072, rope_theta=1000000.0,
                  rms_norm_eps=1e-6, attention_bias=True, bos_token_id=151643,
                  eos_token_id=151643),
        # mistralai/Mistral-7B-v0.1 config.json
        ModelSpec("mistral-7b", "mistral", vocab_size=32000, hidden_size=4096,
                  intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                  num_key_value_heads=8, max_position_embeddings=32768, sliding_window=4096),
        # mistralai/Mixtral-8x7B-v0.1 config.json
        ModelSpec("mixtral-8x7b", "mixtral", vocab_size=32000, hidden_size=4096,
                  intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                  num_key_value_heads=8, max_position_embeddings=32768, rope_theta=1000000.0,
                  num_local_experts=8, num_experts_per_tok=2),
    ]
}  # fmt: skip


def resolve_spec(model: str | Path) -> ModelSpec:
    """A preset name, or a directory (or file) holding an HF config.json.

    Raises NotFoundError naming the closest presets when `model` is neither.
    """
    key = str(model).lower()
    if key in PRESETS:
        return PRESETS[key]
    path = Path(model)
    if path.is_dir() or path.name == "config.json":
        return ModelSpec.from_dir(path)
    raise unknown_name("model", str(model), PRESETS)
