"""The two plans a user asks for: training (memory, speed, cost) and serving.

Both return plain dataclasses with `to_dict()` in bytes, seconds and dollars; the CLI and the
control plane render those.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from gpucloud.errors import UserError
from gpucloud.models.spec import ModelSpec
from gpucloud.planner import cost, speed
from gpucloud.planner.inference import InferenceMemory, estimate_inference_memory
from gpucloud.planner.memory import TrainingMemory, estimate_training_memory
from gpucloud.planner.setup import PRECISIONS, RECOMPUTE, ServeSetup, TrainSetup

CONVENTIONS = {
    "model_states": "ZeRO paper (Rajbhandari et al. 2020): {formula} per GPU, "
    "Φ = parameters per model-parallel rank, N = data-parallel GPUs",
    "deepspeed_estimator": "DeepSpeed's estimate_zero2/zero3_model_states_mem_needs: "
    "18 B/param over all GPUs + 4× the largest layer for ZeRO-3, 4Φ + 16Φ/N for ZeRO-1/2",
    "korthikanti": "Korthikanti et al. 2022, s·b·h·(34 + 5·a·s/h) per layer adapted to "
    "GQA/SwiGLU/no dropout: s·b·(4h + 2q + 2kv + 4i + a·s)·bytes",
    "activations": "component-wise count of what our decoder saves for backward "
    "(checked against the torch profiler)",
}


@dataclass(frozen=True)
class TrainingPlan:
    spec: ModelSpec
    setup: TrainSetup
    memory: TrainingMemory
    speed: speed.TrainSpeed
    cost: cost.TrainCost | None
    notes: list[str]

    @property
    def fits(self) -> bool:
        return self.memory.fits

    def to_dict(self) -> dict:
        m, s, st = self.memory, self.setup, self.speed
        return {
            "model": self.spec.name,
            "params": self.spec.num_params,
            "active_params": self.spec.num_active_params,
            "setup": {
                "gpu": s.gpu.name,
                "gpus_per_node": s.gpus_per_node,
                "nodes": s.nodes,
                "world": s.world,
                "dp": s.dp,
                "tp": s.tp,
                "pp": s.pp,
                "ep": s.ep,
                "sequence_parallel": s.sequence_parallel,
                "zero": s.zero,
                "precision": s.precision,
                "optimizer": s.optimizer,
                "micro_batch": s.micro_batch,
                "seq_len": s.seq_len,
                "recompute": s.recompute,
                "offload_optimizer": s.offload_optimizer,
                "grad_accum": s.grad_accum,
                "pipeline_schedule": s.pipeline_schedule,
                "mfu": s.mfu,
            },  # fmt: skip
            "per_gpu": m.per_gpu(),
            "fits": m.fits,
            "shortfall_bytes": round(m.shortfall_bytes),
            "free_bytes": round(max(0.0, m.gpu_memory_bytes - m.total_bytes)),
            "host_offload_bytes_per_node": round(m.host_offload_bytes_per_node),
            "conventions": {
                "model_states": {
                    "bytes": round(m.zero_paper_bytes),
                    "formula": m.zero_paper_formula,
                    "about": CONVENTIONS["model_states"].format(formula=m.zero_paper_formula),
                },
                "deepspeed_estimator": {
                    "bytes": None
                    if m.deepspeed_estimator_bytes is None
                    else round(m.deepspeed_estimator_bytes),
                    "about": CONVENTIONS["deepspeed_estimator"],
                },
                "korthikanti_activations": {
                    "bytes": round(m.korthikanti_activations_bytes),
                    "about": CONVENTIONS["korthikanti"],
                },
                "activations": CONVENTIONS["activations"],
                "precision": PRECISIONS[s.precision].about,
                "recompute": RECOMPUTE[s.recompute],
            },
            "flops_per_token": st.flops_per_token,
            "step_time_s": st.step_time_s,
            "tokens_per_step": st.tokens_per_step,
            "tokens_per_s": st.tokens_per_s,
            "mfu": st.mfu,
            "compute_s": st.compute_s,
            "bubble_fraction": st.bubble_fraction,
            "comm_s": st.comm_s,
            "exposed_comm_s": st.exposed_comm_s,
            "comm_bytes_per_gpu": st.comm_bytes_per_gpu,
            "all_to_all_s": st.all_to_all_s,
            "all_to_all_bytes_per_gpu": st.all_to_all_bytes_per_gpu,
            "train": None if self.cost is None else asdict(self.cost),
            "notes": self.notes,
        }


def estimate_training(
    spec: ModelSpec, setup: TrainSetup, tokens: float | None = None
) -> TrainingPlan:
    """Memory per GPU, step time and (with a token budget) time and cost to train.

    Raises UserError when the setup cannot split this model (heads vs --tp, layers vs --pp)
    or the token budget is not positive.
    A model that does not fit is not an error: the plan says `fits: false` and the shortfall.
    """
    setup.check(spec)
    if tokens is not None and tokens <= 0:
        raise UserError(f"--tokens must be a positive token budget (got {tokens:g})")
    sp = speed.train_speed(spec, setup)
    budget = None if tokens is None else cost.train_cost(tokens, sp.tokens_per_s, setup.world,
                                                          setup.gpu)  # fmt: skip
    return TrainingPlan(
        spec, setup, estimate_training_memory(spec, setup), sp, budget, _train_notes(spec, setup)
    )


def _train_notes(spec: ModelSpec, setup: TrainSetup) -> list[str]:
    notes = []
    if setup.seq_len > spec.max_position_embeddings:
        notes.append(
            f"--seq-len {setup.seq_len} exceeds the {spec.max_position_embeddings} positions "
            f"{spec.name} was trained on"
        )
    if spec.is_moe:
        notes.append("MoE: every expert counts for memory, only the active ones for FLOPs")
    if setup.pp > 1:
        notes.append(f"pipeline: {setup.pipeline_schedule} over {setup.grad_accum} "
                     f"micro-batches, a bubble of {setup.bubble:.0%} of the step")  # fmt: skip
    return notes


@dataclass(frozen=True)
class ServePlan:
    spec: ModelSpec
    setup: ServeSetup
    memory: InferenceMemory
    speed: speed.ServeSpeed
    cost: cost.ServeCost

    @property
    def fits(self) -> bool:
        return self.memory.fits

    def to_dict(self) -> dict:
        m, s = self.memory, self.setup
        mem = {k: v if isinstance(v, int) else round(v) for k, v in asdict(m).items()}
        return {
            "model": self.spec.name,
            "params": self.spec.num_params,
            "setup": {
                "gpu": s.gpu.name,
                "quant": s.quant,
                "kv_bytes_per_element": s.kv_bytes,
                "max_seq_len": s.max_seq_len,
                "tp": s.tp,
                "memory_fraction": s.memory_fraction,
                "concurrency": s.concurrency,
                "block_size": s.block_size,
                "mfu": s.mfu,
            },  # fmt: skip
            **mem,
            "fits": m.fits,
            "shortfall_bytes": round(m.shortfall_bytes),
            **asdict(self.speed),
            **asdict(self.cost),
        }


def estimate_inference(spec: ModelSpec, setup: ServeSetup) -> ServePlan:
    """Weights, KV cache capacity, speed and cost of serving `spec` on `setup`.

    Raises UserError when --tp cannot split the model's heads. Not fitting is `fits: false`.
    """
    setup.check(spec)
    mem = estimate_inference_memory(spec, setup)
    # Decode speed at the asked concurrency, or with the cache full when none was asked.
    batch = max(1, min(setup.concurrency or mem.max_concurrent_seqs, mem.max_concurrent_seqs))
    sp = speed.serve_speed(spec, setup, mem.weights_bytes, mem.kv_bytes_per_token, batch)
    return ServePlan(spec, setup, mem, sp, cost.serve_cost(sp.decode_tokens_per_s, setup.tp,
                                                           setup.gpu))  # fmt: skip
