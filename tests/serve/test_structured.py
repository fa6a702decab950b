"""Structured output in the engine: every finished answer parses and validates against its
schema, free requests in the same batch are untouched, and the grammar's state survives
preemption, speculation and max_tokens cuts."""

from __future__ import annotations

import json

import jsonschema
import pytest

from gpucloud.errors import UserError
from gpucloud.models.draft import make_draft_dir
from gpucloud.serve import LLM, SamplingParams
from gpucloud.serve.params import StructuredOutputsParams

SCHEMA = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 999},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
        "name": {"type": "string", "maxLength": 12},
        "ok": {"type": "boolean"},
    },
    "required": ["color", "count", "tags", "name", "ok"],
    "additionalProperties": False,
}
PROMPTS = ["Hello", "The quick brown fox", "def main():\n    return", "JSON:"]
JSON_SCHEMA = StructuredOutputsParams(json=SCHEMA)


def constrained(**kw) -> SamplingParams:
    return SamplingParams(**{"max_tokens": 120, "temperature": 0, "structured_outputs":
                             JSON_SCHEMA, **kw})  # fmt: skip


@pytest.fixture(scope="module")
def llm(tiny_model_dir) -> LLM:
    return LLM(tiny_model_dir, kv_cache_bytes=1 << 22)


def answers(outs) -> list[tuple[str, str]]:
    return [(c.text, c.finish_reason) for o in outs for c in o.outputs]


def assert_valid(outs, schema=SCHEMA) -> None:
    for text, reason in answers(outs):
        assert reason == "stop", text
        jsonschema.validate(json.loads(text), schema)


@pytest.fixture(scope="module")
def greedy_answers(llm):
    outs = llm.generate(PROMPTS, constrained())
    assert_valid(outs)
    return answers(outs)


def test_a_mixed_batch_constrains_only_its_structured_rows(llm, greedy_answers):
    free = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    alone = answers(llm.generate(PROMPTS, free))
    mixed = llm.generate(PROMPTS * 2, [constrained()] * len(PROMPTS) + [free] * len(PROMPTS))
    assert answers(mixed) == greedy_answers + alone
    assert not any(text.startswith("{") for text, _ in alone)  # the mask made the difference


def test_sampled_answers_validate_whatever_the_seed(llm):
    params = [constrained(temperature=1.0, top_p=0.95, seed=s, n=2) for s in range(2)]
    assert_valid(llm.generate(PROMPTS[:2], params))


def test_json_object_gives_a_json_object(llm):
    # A random model names keys without end when greedy; this seed closes every object.
    json_object = StructuredOutputsParams(json_object=True)
    params = SamplingParams(max_tokens=120, temperature=0.8, seed=1, structured_outputs=json_object)
    for text, reason in answers(llm.generate(PROMPTS, params)):
        assert reason == "stop"
        assert isinstance(json.loads(text), dict)


def test_max_tokens_cut_mid_json_reports_length(llm, greedy_answers):
    outs = llm.generate(PROMPTS, constrained(max_tokens=5))
    for (text, reason), (whole, _) in zip(answers(outs), greedy_answers, strict=True):
        assert reason == "length"
        assert whole.startswith(text) and text != whole


def test_preemption_and_speculation_keep_the_grammar_state(llm, tiny_model_dir, greedy_answers,
                                                           tmp_path):  # fmt: skip
    # A pool of 96 tokens holds one answer at a time: sequences are preempted and recomputed.
    tiny = LLM(tiny_model_dir, kv_cache_bytes=96 * 1024, block_size=4)
    outs = tiny.generate(PROMPTS, constrained())
    assert tiny.engine.stats().num_preemptions > 0
    assert answers(outs) == greedy_answers
    # Guesses are verified against the grammar's masks: some hold, some are refused. A
    # prompt quoting the schema's keys gives prompt lookup guesses the grammar forces.
    prompts = [*PROMPTS, '{"color": "red", "count": 1, "tags": [], "name": "a", "ok": true}']
    want = greedy_answers + answers(llm.generate(prompts[-1:], constrained()))
    draft = make_draft_dir(tiny_model_dir, tmp_path / "draft", num_layers=1)
    accepted = {}
    for config in ({"speculative": "ngram"}, {"speculative": "draft", "draft_model": draft}):
        spec = LLM(tiny_model_dir, kv_cache_bytes=1 << 22, **config)
        assert answers(spec.generate(prompts, constrained())) == want
        stats = spec.engine.stats()
        assert stats.accepted_tokens < stats.draft_tokens, config  # guesses were refused
        accepted[config["speculative"]] = stats.accepted_tokens
    assert accepted["ngram"] > 0  # and guesses held


@pytest.mark.parametrize(
    "spec, problem",
    [
        (StructuredOutputsParams(json={"type": "string", "not": {"const": "a"}}), "not"),
        (StructuredOutputsParams(json={"type": "sandwich"}), "sandwich"),
        (StructuredOutputsParams(json="{not json"), "not valid JSON"),
    ],
)
def test_an_unsupported_schema_is_refused_when_added(llm, spec, problem):
    with pytest.raises(UserError, match=problem):
        llm.engine.add_request("Hi", SamplingParams(structured_outputs=spec))
    assert not llm.engine.has_unfinished()


def test_structured_outputs_needs_exactly_one_kind():
    with pytest.raises(UserError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(UserError, match="exactly one"):
        StructuredOutputsParams(json={"type": "object"}, json_object=True)
