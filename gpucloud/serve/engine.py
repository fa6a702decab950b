"""`LLMEngine`: requests in, tokens out, one step at a time.

`step` = schedule → run → postprocess. `add_request` and `abort_request` may be called from
another thread (the HTTP server's event loop) while a background thread calls `step`: they
only validate and queue; the queue is applied at the start of the next step.

With speculative decoding on, a step first proposes draft tokens for greedy decoding
sequences (`speculative.py`); the run verifies them, and postprocessing appends every
confirmed token as if each had been decoded by a step of its own.

A structured-output request (`SamplingParams.structured_outputs`) gets a grammar matcher
per sequence; the sampler masks its rows and `_append` advances it (`structured.py`).

With `enable_lora`, a request may name a LoRA adapter (`lora_request`); requests of
different adapters and of the base model run in the same steps (`lora.py`).

With `tensor_parallel_size` N > 1 the model is split across this process and N - 1 worker
processes (`tp.py`); the engine itself does not change: its runner tells the workers.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from gpucloud.errors import CapacityError, ConfigError, UserError
from gpucloud.models.draft import check_draft
from gpucloud.models.llama import LlamaForCausalLM
from gpucloud.serve.config import EngineConfig
from gpucloud.serve.detokenizer import IncrementalDetokenizer
from gpucloud.serve.draft import PLACEHOLDER, DraftModelProposer
from gpucloud.serve.kv_cache import BlockManager
from gpucloud.serve.lora import LoraManager, LoRARequest
from gpucloud.serve.outputs import RequestOutput, request_output
from gpucloud.serve.params import SamplingParams
from gpucloud.serve.runner import (
    ModelRunner,
    Verification,
    kv_bytes_per_token,
    profile_kv_cache_bytes,
)
from gpucloud.serve.sampler import Sampler
from gpucloud.serve.scheduler import Scheduler, SchedulerOutput
from gpucloud.serve.sequence import FinishReason, Request, Sequence, make_request
from gpucloud.serve.spec_policy import GuessPolicy
from gpucloud.serve.speculative import accept, can_speculate, ngram_proposal
from gpucloud.serve.structured import GrammarCompiler, advance, mask_guessed_rows
from gpucloud.serve.tp_layers import parameter_bytes

if TYPE_CHECKING:
    from gpucloud.serve.tp import TensorParallelWorkers


@dataclass(slots=True)
class EngineStats:
    """Counters for metrics endpoints and benchmarks."""

    num_running: int
    num_waiting: int
    kv_usage: float  # fraction of KV blocks held by running sequences
    num_blocks: int
    block_size: int
    kv_bytes_per_token: int
    prefix_cache_hit_rate: float  # prompt tokens found in the cache / prompt tokens admitted
    num_preemptions: int
    num_steps: int
    prompt_tokens: int  # prompt tokens computed (recomputation included)
    generation_tokens: int
    draft_tokens: int  # speculative tokens proposed and verified
    accepted_tokens: int  # of those, the ones greedy decoding confirmed

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0


class LLMEngine:
    def __init__(
        self,
        model: LlamaForCausalLM,
        tokenizer=None,
        config: EngineConfig | None = None,
        draft: LlamaForCausalLM | None = None,
        workers: TensorParallelWorkers | None = None,
    ):
        """Serve `model` (already loaded, in eval mode). `tokenizer` (gpucloud.models.tokenizer
        .Tokenizer) is optional: without it prompts must be token ids and outputs carry no text.
        `draft` is the draft model of speculative="draft"; `workers`, the other ranks when
        `model` is rank 0 of a tensor-parallel split (`from_model_dir` makes both). Raises
        ConfigError (a draft missing, or of another vocabulary) or CapacityError (no KV block
        fits).
        """
        self.config = config = config or EngineConfig()
        self.model, self.tokenizer = model, tokenizer
        spec = model.spec
        self.max_model_len = min(config.max_model_len or spec.max_position_embeddings,
                                 spec.max_position_embeddings)  # fmt: skip
        dtype = next(model.parameters()).dtype
        self.lora = None
        if config.enable_lora:  # before profiling: the adapter slots are weights too
            self.lora = (LoraManager(model, config.max_loras, config.max_lora_rank)
                         if workers is None else workers.lora(model, config))  # fmt: skip
        self.kv_bytes_per_token = kv_bytes_per_token(spec, dtype)
        draft_cost = 0.0  # of a guess, in decode steps (spec_policy)
        if config.speculative == "draft":  # its K/V shares the pool's budget, block for block
            self._check_draft(draft)
            self.kv_bytes_per_token += kv_bytes_per_token(draft.spec, dtype)
            draft_cost = parameter_bytes(draft) / parameter_bytes(model)
        kv_bytes = config.kv_cache_bytes or profile_kv_cache_bytes(
            model, config, self.max_model_len
        )
        num_blocks = kv_bytes // (self.kv_bytes_per_token * config.block_size)
        if num_blocks < 1:
            raise CapacityError(
                f"KV cache of {kv_bytes} bytes holds no block of {config.block_size} tokens "
                f"({self.kv_bytes_per_token} bytes per token): give more kv_cache_bytes"
            )
        self.blocks = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(config, self.blocks)
        self.workers = workers
        if workers is None:
            self.runner = ModelRunner(model, config, num_blocks, self.lora)
        else:
            self.runner = workers.runner(model, config, num_blocks, self.lora)
        self.drafter = None
        if config.speculative == "draft":
            self.drafter = DraftModelProposer(draft, config, num_blocks)
        self.guess_policy = GuessPolicy(config.num_speculative_tokens, draft_cost)
        eos = set(tokenizer.stop_ids) if tokenizer is not None else set()
        if spec.eos_token_id is not None:
            eos.add(spec.eos_token_id)
        self.eos_token_ids = eos
        self.sampler = Sampler(eos)
        self._grammars: GrammarCompiler | None = None  # made on the first structured request
        self.requests: dict[str, Request] = {}
        self._inbox: deque[Request] = deque()
        self._aborts: deque[str] = deque()
        self._lock = threading.Lock()  # guards request ids between add_request and step
        self._counter = 0
        self.num_steps = self.prompt_tokens = self.generation_tokens = 0
        self.draft_tokens = self.accepted_tokens = 0

    @classmethod
    def from_model_dir(cls, model_dir: str | Path, config: EngineConfig | None = None):
        """Load an HF-format directory (config.json, safetensors, tokenizer.json)."""
        from gpucloud.hal import device
        from gpucloud.models.loader import load_model
        from gpucloud.models.tokenizer import load_tokenizer

        config = config or EngineConfig()
        workers = None
        if config.tensor_parallel_size > 1:
            from gpucloud.serve import tp

            model, workers = tp.start(model_dir, config)
            config, dev = tp.rank_config(config), next(model.parameters()).device
        else:
            dev = config.device or device.device()
            model = load_model(model_dir, config.dtype, dev, config.quantization)
        try:
            tokenizer, draft = load_tokenizer(model_dir), None  # a draft: whole, beside rank 0
            if config.draft_model is not None:
                draft = load_model(config.draft_model, config.dtype, dev, config.quantization)
                vocab = load_tokenizer(config.draft_model).backend.get_vocab()
                check_draft(model, draft, tokenizer.backend.get_vocab(), vocab)
            return cls(model, tokenizer, config, draft, workers)
        except BaseException:
            if workers is not None:
                workers.stop()
            raise

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers, if any (they also end with this process)."""
        if self.workers is not None:
            self.workers.stop()

    # ---- requests ------------------------------------------------------------------
    @property
    def capacity_tokens(self) -> int:
        return self.blocks.num_blocks * self.blocks.block_size

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        arrival_time: float | None = None,
        lora_request: LoRARequest | str | None = None,
        priority: int = 0,
    ) -> str:
        """Queue a request, on the base model or the LoRA adapter `lora_request` names (a
        registered name, or a LoRARequest whose path is loaded on first use), before those
        of a greater `priority` (scheduler.py); returns its id.
        Raises UserError for a bad prompt, a duplicate id, an unknown or unloadable adapter
        or an unsupported JSON schema, CapacityError when it could never fit in the KV pool."""
        adapter = self._adapter(lora_request)
        text, ids = self._tokenize(prompt)
        params = replace(params or SamplingParams())  # ours to complete; the caller's stays
        if params.max_tokens is None:
            params.max_tokens = max(self.max_model_len - len(ids), 1)
        self._check_fits(len(ids), params)
        grammar = self._grammar(params)
        with self._lock:
            if request_id is None:
                request_id = f"req-{self._counter}"
                self._counter += 1
            if request_id in self.requests:
                raise UserError(f"request id {request_id!r} is already in use")
            req = make_request(request_id, text, ids, params, arrival_time or time.time(),
                               adapter, priority)  # fmt: skip
            for seq in req.seqs if grammar is not None else ():
                seq.grammar = grammar.deep_copy()
            self.requests[request_id] = req
            self._inbox.append(req)
        return request_id

    def add_lora(self, name: str, path: str | Path):
        """Load the PEFT adapter at `path` for requests that name `name`; returns it. Raises
        ConfigError (bad adapter, or LoRA not enabled) or UserError (name taken)."""
        return self._lora_manager().add(name, path)

    def remove_lora(self, name: str) -> None:
        """Forget adapter `name`; its requests in flight finish with it. NotFoundError."""
        self._lora_manager().remove(name)

    def list_loras(self) -> list:
        """The registered adapters (gpucloud.models.lora.LoraAdapter), in load order."""
        return [] if self.lora is None else list(self.lora.adapters.values())

    def abort_request(self, request_id: str) -> None:
        """Stop a request (unknown or finished ids are ignored)."""
        self._aborts.append(request_id)

    def has_unfinished(self) -> bool:
        return bool(self._inbox) or self.scheduler.has_unfinished()

    # ---- the loop ------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one iteration. Returns an output for every request that changed."""
        changed = self._apply_queues()
        if self.config.speculative:
            self._propose()
        out = self.scheduler.schedule()
        if self.drafter is not None:
            self.drafter.propose([c for c in out.chunks if c.draft])
        if out.chunks:
            result = self.runner.run(out.chunks)
            tokens = self.sampler(result.logits, result.sample_seqs)
            self.scheduler.update(out)
            self._count(out)
            self.guess_policy.earn(sum(c.num_tokens for c in out.chunks))
            for seq, entries in result.prompt_logprobs:
                seq.prompt_logprobs.extend(entries)
            for seq, token in zip(result.sample_seqs, tokens, strict=True):
                self._append(seq, token)
                changed.setdefault(seq.request_id, {})[seq.index] = 1
            for v in result.verifications:
                changed.setdefault(v.seq.request_id, {})[v.seq.index] = self._verify(v)
            self._finish_scored_prompts(out, changed)
        self.num_steps += 1
        return self._outputs(changed)

    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting) + len(self._inbox),
            kv_usage=self.blocks.usage,
            num_blocks=self.blocks.num_blocks,
            block_size=self.blocks.block_size,
            kv_bytes_per_token=self.kv_bytes_per_token,
            prefix_cache_hit_rate=self.blocks.hit_rate,
            num_preemptions=self.scheduler.num_preemptions,
            num_steps=self.num_steps,
            prompt_tokens=self.prompt_tokens,
            generation_tokens=self.generation_tokens,
            draft_tokens=self.draft_tokens,
            accepted_tokens=self.accepted_tokens,
        )

    # ---- internals -----------------------------------------------------------------
    def _lora_manager(self) -> LoraManager:
        if self.lora is None:
            raise ConfigError("LoRA adapters need an engine built with enable_lora=True "
                              "(gpucloud serve --enable-lora or --lora-modules)")  # fmt: skip
        return self.lora

    def _adapter(self, lora_request: LoRARequest | str | None):
        if lora_request is None:
            return None
        return self._lora_manager().resolve(lora_request)

    def _check_draft(self, draft: LlamaForCausalLM | None) -> None:
        if draft is None:
            raise ConfigError("speculative 'draft' needs a draft model (--draft-model DIR)")
        check_draft(self.model, draft)

    def _grammar(self, params: SamplingParams):
        """The matcher a structured-output request starts from, or None."""
        if params.structured_outputs is None:
            return None
        if self.tokenizer is None:
            raise UserError("structured output needs an engine with a tokenizer")
        if self._grammars is None:
            self._grammars = GrammarCompiler(self.tokenizer, self.model.spec.vocab_size,
                                             self.eos_token_ids)  # fmt: skip
        return self._grammars.matcher(params.structured_outputs)

    def _tokenize(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise UserError("this engine has no tokenizer: give the prompt as token ids")
            ids = self.tokenizer.encode(prompt)
            text = prompt
        else:
            ids, text = list(prompt), None
            vocab = self.model.spec.vocab_size
            if not all(isinstance(t, int) and 0 <= t < vocab for t in ids):
                raise UserError(f"prompt token ids must be integers in [0, {vocab})")
        if not ids:
            raise UserError("the prompt is empty")
        return text, ids

    def _check_fits(self, prompt_len: int, params: SamplingParams) -> None:
        total = prompt_len + params.max_tokens
        if total > self.max_model_len:
            raise UserError(
                f"prompt ({prompt_len} tokens) + max_tokens ({params.max_tokens}) = {total} "
                f"exceeds the model's context length of {self.max_model_len} tokens"
            )
        if total > self.capacity_tokens:
            raise CapacityError(
                f"prompt ({prompt_len} tokens) + max_tokens ({params.max_tokens}) = {total} "
                f"tokens can never fit the KV cache of {self.capacity_tokens} tokens; "
                "lower max_tokens or give the engine more kv_cache_bytes"
            )

    def _apply_queues(self) -> dict[str, dict[int, int]]:
        changed: dict[str, dict[int, int]] = {}
        while self._inbox:
            req = self._inbox.popleft()
            for seq in req.seqs:
                if self.tokenizer is not None:
                    seq.detokenizer = IncrementalDetokenizer(
                        self._decoder(seq.params), req.prompt_token_ids, seq.params.stop,
                        seq.params.include_stop_str_in_output,
                    )  # fmt: skip
                self.scheduler.add(seq)
        while self._aborts:
            req = self.requests.get(self._aborts.popleft())
            if req is None or req.finished:
                continue
            for seq in req.seqs:
                self.scheduler.finish(seq, FinishReason.ABORT)
            changed[req.request_id] = {}
        return changed

    def _decoder(self, params: SamplingParams):
        tok, skip = self.tokenizer, params.skip_special_tokens
        return lambda ids: tok.decode(ids, skip_special_tokens=skip)

    def _count(self, out: SchedulerOutput) -> None:
        for chunk in out.chunks:
            if chunk.seq.num_output_tokens == 0 or chunk.num_tokens > 1:
                self.prompt_tokens += chunk.num_tokens

    def _propose(self) -> None:
        c = self.config
        for seq in self.scheduler.running:
            seq.draft_token_ids = []
            if not can_speculate(seq):
                continue
            # No guess past max_tokens or the context: the step's last token is the target's.
            room = min(seq.params.max_tokens - seq.num_output_tokens - 1,
                       self.max_model_len - seq.num_tokens)  # fmt: skip
            if seq.guess_state is None:
                seq.guess_state = self.guess_policy.start()
            unseen = seq.num_tokens - seq.draft_computed_tokens if self.drafter else 0
            k = min(self.guess_policy.guesses(seq.guess_state, unseen), room)
            if k <= 0:
                continue
            if self.drafter is not None:  # rows reserved now, filled once scheduled
                seq.draft_token_ids = [PLACEHOLDER] * k
            else:
                seq.draft_token_ids = ngram_proposal(
                    seq.token_ids, k, c.prompt_lookup_max, c.prompt_lookup_min
                )

    def _verify(self, v: Verification) -> int:
        """Append the tokens greedy decoding confirms, one at a time as a decode would (a stop
        or max_tokens may end the sequence mid-way); returns how many were appended."""
        seq = v.seq
        if seq.grammar is None:
            tokens = accept(v.logits, v.draft)
        else:
            tokens = accept(mask_guessed_rows(v.logits, seq.grammar, v.draft), v.draft)
        # The draft model's K/V holds for the guesses confirmed, not past them.
        seq.draft_computed_tokens = min(seq.draft_computed_tokens,
                                        seq.num_tokens + len(tokens) - 1)  # fmt: skip
        self.draft_tokens += len(v.draft)
        self.accepted_tokens += len(tokens) - 1
        self.guess_policy.observe(seq.guess_state, len(v.draft), len(tokens) - 1)
        entries = self.sampler.logprobs_of(v.logits, tokens, seq)
        appended = 0
        for token in tokens:
            if appended:
                self.scheduler.accept_draft_token(seq)
            if entries:
                seq.logprobs.append(entries[appended])
            self._append(seq, token)
            appended += 1
            if seq.finished:
                break
        self.scheduler.drop_rejected(seq)
        return appended

    def _append(self, seq: Sequence, token: int) -> None:
        seq.append(token)
        self.generation_tokens += 1
        req = self.requests[seq.request_id]
        if req.first_token_time is None:
            req.first_token_time = time.time()
        p = seq.params
        stop_string = seq.detokenizer.add(token) if seq.detokenizer is not None else None
        complete = seq.grammar is not None and advance(seq.grammar, token)
        can_stop = seq.num_output_tokens >= p.min_tokens
        if can_stop and token in p.stop_token_ids:
            self._finish(seq, FinishReason.STOP, token)
        elif can_stop and not p.ignore_eos and token in self.eos_token_ids:
            self._finish(seq, FinishReason.STOP, None)
        elif stop_string is not None:
            self._finish(seq, FinishReason.STOP, stop_string)
        elif complete:
            self._finish(seq, FinishReason.STOP, None)
        elif seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            self._finish(seq, FinishReason.LENGTH, None)

    def _finish_scored_prompts(self, out: SchedulerOutput, changed) -> None:
        """End the `max_tokens=0` sequences whose prompt this step completed: they were
        there to score it, and sample nothing."""
        for chunk in out.chunks:
            if chunk.completes and not chunk.samples:
                self._finish(chunk.seq, FinishReason.LENGTH, None)
                changed.setdefault(chunk.seq.request_id, {})[chunk.seq.index] = 0

    def _finish(self, seq: Sequence, reason: FinishReason, stop_reason) -> None:
        if seq.detokenizer is not None and not isinstance(stop_reason, str):
            seq.detokenizer.flush()
        self.scheduler.finish(seq, reason, stop_reason)

    def _outputs(self, changed: dict[str, dict[int, int]]) -> list[RequestOutput]:
        outputs = []
        for request_id, new_tokens in changed.items():
            req = self.requests[request_id]
            cached = req.seqs[0].num_reused_tokens
            outputs.append(request_output(req, new_tokens, cached))
            if req.finished:
                with self._lock:
                    del self.requests[request_id]
        return outputs
