"""Models for the serve tests: random weights built here (nothing is downloaded), their
transformers twins, and an engine driver."""

from __future__ import annotations

import torch

from gpucloud.models.llama import LlamaForCausalLM
from gpucloud.models.presets import PRESETS
from gpucloud.serve import EngineConfig, LLMEngine, SamplingParams


def random_model(preset: str, dtype: torch.dtype, seed: int = 0) -> LlamaForCausalLM:
    model = LlamaForCausalLM(PRESETS[preset])
    model.init_weights(seed)
    return model.to(dtype).eval()


def hf_twin(model: LlamaForCausalLM):
    """transformers' LlamaForCausalLM holding the same weights."""
    import transformers

    config = transformers.LlamaConfig(**model.spec.to_hf_config())
    hf = transformers.LlamaForCausalLM(config)
    hf.load_state_dict(model.state_dict(), strict=False)
    return hf.to(next(model.parameters()).dtype).eval()


@torch.inference_mode()
def hf_greedy(hf, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    outs = []
    for p in prompts:
        ids = hf.generate(torch.tensor([p]), max_new_tokens=max_new_tokens, do_sample=False,
                          eos_token_id=None, pad_token_id=0)  # fmt: skip
        outs.append(ids[0, len(p) :].tolist())
    return outs


def run_engine(engine: LLMEngine, prompts, params: SamplingParams | list[SamplingParams]):
    """Add every prompt, step until done; the final outputs in prompt order."""
    params = params if isinstance(params, list) else [params] * len(prompts)
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return [done[i] for i in ids]


def engine_for(model: LlamaForCausalLM, tokenizer=None, **config) -> LLMEngine:
    config.setdefault("kv_cache_bytes", 1 << 22)
    return LLMEngine(model, tokenizer, EngineConfig(**config))
