"""Fine-tuning recipes in process (one gloo rank): chat data masked to the assistant's
tokens, packed rows whose conversations do not see each other, LoRA adapters on a frozen
(and a quantized) base that PEFT and our engine load and that answer what they learnt, and
DPO whose chosen-vs-rejected margin grows."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from train_helpers import losses, run_in_process

from gpucloud.errors import ConfigError
from gpucloud.models.loader import init_model_dir, load_model
from gpucloud.models.tokenizer import load_tokenizer
from gpucloud.train import config
from gpucloud.train.chat_data import IGNORE, chat_tokenizer, encode_chat, pack_rows, piece
from gpucloud.train.export import export
from gpucloud.train.recipes import Sft

ROOT = Path(__file__).resolve().parents[2]
ANSWERS = ROOT / "examples/finetune/answers.jsonl"
PAIRS = ROOT / "examples/finetune/preferences.jsonl"
EVAL_LINES = (ROOT / "examples/finetune/answers_eval.jsonl").read_text().splitlines()
EVAL_PROMPTS = [json.loads(line)["prompt"] for line in EVAL_LINES[:4]]
ANSWER = "The answer is 42."
ALL_PROJECTIONS = "['q_proj','k_proj','v_proj','o_proj','gate_proj','up_proj','down_proj']"


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return init_model_dir("tiny", tmp_path_factory.mktemp("finetune") / "tiny", seed=0)


def recipe(base: Path, kind: str, *overrides: str) -> dict:
    data = {
        "model": {"path": str(base)},
        "data": {"path": str(ANSWERS if kind == "sft" else PAIRS), "seq_len": 64},
        "optim": {"global_batch": 4, "micro_batch": 2, "lr": 1e-2, "min_lr": 1e-2,
                  "max_steps": 40},
        "checkpoint": {"every": 100},
        "recipe": {"kind": kind},
    }  # fmt: skip
    for item in overrides:
        config.apply_override(data, item)
    return data


def greedy(model, tok, prompt: str, steps: int = 12) -> str:
    ids = tok.encode(prompt)
    start = len(ids)
    with torch.no_grad():
        for _ in range(steps):
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
            if ids[-1] == tok.eos_id:
                break
    return tok.decode(ids[start:])


# ---- chat data -----------------------------------------------------------------------------
def test_only_assistant_turns_and_their_end_of_turn_are_trained(base):
    tok = chat_tokenizer(base)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi?"},
                {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "And?"},
                {"role": "assistant", "content": "Bye."}]  # fmt: skip
    enc = encode_chat(tok, messages)
    trained = [i for i, t in zip(enc.ids, enc.trained, strict=True) if t]
    assert tok.decode(trained, skip_special_tokens=False) == "Hello.<|eos|>Bye.<|eos|>"
    # The whole conversation is the template's rendering, prompt tokens as at inference.
    assert tok.decode(enc.ids, skip_special_tokens=False) == tok.apply_chat_template(
        messages, add_generation_prompt=False)  # fmt: skip
    prompt = tok.apply_chat_template(messages[:2])
    assert enc.ids[: len(tok.encode(prompt))] == tok.encode(prompt)


def test_packed_conversations_do_not_attend_to_each_other(base, process_group):
    """A packed row's logits are those of each conversation run alone; padding is ignored."""
    cfg = config.parse(recipe(base, "sft", "data.seq_len=96"))
    sft = Sft(cfg)
    batch = sft.batch(0, 2)
    docs = batch["documents"][0]
    assert docs.max() >= 1, "several conversations in the row"
    model = load_model(base)
    packed = []
    sft.loss(lambda ids, pos, att: packed.append(model(ids, pos, att)) or packed[0], batch)
    for d in range(int(docs.max()) + 1):
        where = (docs == d).nonzero().squeeze(1)
        alone = model(batch["inputs"][0, where][None])[0]
        torch.testing.assert_close(packed[0][0, where], alone, rtol=1e-4, atol=1e-5)
    assert (batch["targets"][0][docs == -1] == IGNORE).all()


def test_unpacked_rows_hold_one_conversation_each(base):
    tok = chat_tokenizer(base)
    chat = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]
    enc = encode_chat(tok, chat)
    rows = pack_rows([piece(enc, 32, "t")] * 3, 32, tok.pad_id, packing=False, seed=0)
    assert rows["inputs"].shape == (3, 32) and rows["documents"].max() == 0


def test_bad_lines_and_configs_are_one_line_errors(base, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": [{"role": "user", "content": "only a question"}]}\n')
    tok = chat_tokenizer(base)
    from gpucloud.train.chat_data import read_conversations

    with pytest.raises(ConfigError, match=r"bad.jsonl:1: no assistant message"):
        read_conversations(bad, tok)
    bad.write_text('{"messages": [{"role": "robot", "content": "beep"}]}\n')
    with pytest.raises(ConfigError, match=r"bad.jsonl:1: each of 'messages' is .*system, user"):
        read_conversations(bad, tok)
    with pytest.raises(ConfigError, match="lora.*parallel.strategy = 'ddp'"):
        config.parse(recipe(base, "sft", "lora.rank=4", "parallel.strategy='fsdp'"))
    data = recipe(base, "sft")
    data["model"] = {"preset": "tiny"}
    with pytest.raises(ConfigError, match="fine-tunes a model: set model.path"):
        config.parse(data)


# ---- LoRA ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def lora_run(base, tmp_path_factory, process_group):
    """A LoRA run on all projections that learns to answer every question the same way,
    exported to a PEFT directory: (trainer, records, adapter dir)."""
    run_dir = tmp_path_factory.mktemp("lora") / "run"
    cfg = recipe(base, "sft", "lora.rank=8", f"lora.target_modules={ALL_PROJECTIONS}")
    outcome, records, trainer = run_in_process(cfg, run_dir)
    assert outcome.value == "completed"
    adapter = export(run_dir, run_dir.parent / "adapter")
    return trainer, records, Path(adapter["out"])


def test_lora_trains_adapters_only_on_a_frozen_base(lora_run, base):
    trainer, records, _ = lora_run
    model = trainer.par.model
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trained and all(".lora_A." in n or ".lora_B." in n for n in trained)
    start = load_model(base).state_dict()
    now = {n.replace(".base.", "."): t for n, t in model.state_dict().items() if "lora_" not in n}
    assert all(torch.equal(now[n], t) for n, t in start.items() if n in now)
    curve = losses(records)
    assert curve[40] < curve[1] - 1.0
    assert all(greedy(model, load_tokenizer(base), p) == ANSWER for p in EVAL_PROMPTS)


def test_the_exported_adapter_loads_in_peft_with_the_same_logits(lora_run, base):
    import peft
    import transformers

    trainer, _, adapter = lora_run
    config_json = json.loads((adapter / "adapter_config.json").read_text())
    assert config_json["r"] == 8 and config_json["peft_type"] == "LORA"
    hf = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    tuned = peft.PeftModel.from_pretrained(hf, adapter).eval()
    ids = torch.tensor([load_tokenizer(base).encode(EVAL_PROMPTS[0])])
    with torch.no_grad():
        ours, theirs = trainer.par.model(ids), tuned(ids).logits
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)


def test_our_engine_serves_the_adapter_and_it_answers_what_it_learnt(lora_run, base):
    from gpucloud.serve import LLM, LoRARequest, SamplingParams

    _, _, adapter = lora_run
    llm = LLM(str(base), kv_cache_bytes=4 << 20, enable_lora=True, max_loras=1, max_lora_rank=8)
    params = SamplingParams(max_tokens=12, temperature=0)
    tuned = llm.generate(EVAL_PROMPTS, params, lora_request=LoRARequest("answers", 1, str(adapter)))
    plain = llm.generate(EVAL_PROMPTS, params)
    assert [o.outputs[0].text for o in tuned] == [ANSWER] * len(EVAL_PROMPTS)
    assert all(o.outputs[0].text != ANSWER for o in plain)


def test_qlora_trains_fp32_adapters_over_a_quantized_frozen_base(base, tmp_path, process_group):
    from gpucloud.models.lora import load_adapter
    from gpucloud.models.quant import Int8Linear
    from gpucloud.train.lora_train import TrainableLora

    cfg = recipe(base, "sft", "lora.rank=8", "lora.base_quantization='int8'", "optim.max_steps=12")
    outcome, records, trainer = run_in_process(cfg, tmp_path / "run")
    wrapped = [m for m in trainer.par.model.modules() if isinstance(m, TrainableLora)]
    assert wrapped and all(isinstance(m.base, Int8Linear) for m in wrapped)
    assert all(m.lora_A.weight.dtype == torch.float32 for m in wrapped)
    quantized = load_model(base, quantization="int8").state_dict()
    now = {n.replace(".base.", "."): t for n, t in trainer.par.model.state_dict().items()}
    assert all(torch.equal(now[n], quantized[n]) for n in quantized if "qweight" in n)
    curve = losses(records)
    assert curve[12] < curve[1] - 0.3
    out = export(tmp_path / "run", tmp_path / "adapter")
    assert out["adapter"]["target_modules"] == ["q_proj", "k_proj", "v_proj", "o_proj"]
    assert load_adapter(tmp_path / "adapter", trainer.spec, 8, "q").rank == 8


# ---- DPO -----------------------------------------------------------------------------------
@pytest.mark.parametrize("adapters", [False, True], ids=["full", "lora"])
def test_dpo_grows_the_chosen_vs_rejected_margin(base, tmp_path, process_group, adapters):
    from gpucloud.train.recipes import Dpo

    extra = ("lora.rank=8",) if adapters else ("optim.lr=1e-3", "optim.min_lr=1e-3")
    cfg = recipe(base, "dpo", "optim.max_steps=10", *extra)
    parsed = config.parse(cfg)
    model = load_model(base)
    start = Dpo(parsed, model)
    batch = start.batch(0, 8)
    with torch.no_grad():
        assert torch.equal(start.dpo.margins(model, batch), torch.zeros(8))  # policy = reference
    outcome, records, trainer = run_in_process(cfg, tmp_path / "run")
    with torch.no_grad():
        after = trainer.recipe.dpo.margins(trainer.par.model, batch)
    assert (after > 0).all() and after.mean() > 1.0
    curve = losses(records)
    assert curve[1] == pytest.approx(0.6931, abs=1e-4) and curve[10] < 0.6


def test_preflight_refuses_a_missing_chat_file(base, tmp_path):
    from gpucloud.train.launcher import preflight

    cfg = config.parse(recipe(base, "sft", f"data.path='{tmp_path / 'none.jsonl'}'"))
    with pytest.raises(ConfigError, match=r"none.jsonl: no such file \(recipe.kind = 'sft' reads"):
        preflight(cfg, 1)
