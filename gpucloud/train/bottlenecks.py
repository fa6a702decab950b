"""`gpucloud doctor --job ID`: what a training run's metrics.jsonl and log say slows it down
or hurts it, each finding with its evidence.

The records are the trainer's (gpucloud.train.metrics): per logged step `step_time_s`,
`data_time_s` (reading batches), `sync_time_s` (collectives after backward), `tokens_per_s`,
`mfu`, `memory_bytes`, and events (`skip`/`rollback`/`stop` with a reason: nan, spike,
overflow; `straggler` and `hang` naming ranks and hosts, from gpucloud.train.stragglers).
Pure functions over plain dicts: no torch, so the CLI runs them anywhere.
"""

from __future__ import annotations

import re
from statistics import mean

from gpucloud.hal.check import FAIL, OK, WARN, Check

INPUT_STALL_SHARE = 0.20  # of the step spent waiting for batches
SYNC_SHARE = 0.25  # of the step spent in collectives after backward
SMALL_BATCH_TOKENS = 16_384  # tokens per optimizer step
SMALL_BATCH_MFU = 0.30
MEMORY_GROWTH = 0.10  # growth past warm-up, of the memory in use after warm-up
_OOM = re.compile(r"out of memory|OutOfMemoryError", re.IGNORECASE)


def diagnose(records: list[dict], log: str = "") -> list[Check]:
    """One Check per finding (WARN, with evidence and what to do); a single OK line with
    the run's figures when nothing stands out. Raises ValueError without logged steps."""
    steps = [r for r in records if r.get("step_time_s")]
    if not steps:
        raise ValueError("no logged training step in its metrics yet")
    findings = [
        f
        for f in (
            _input_stall(steps),
            _communication(steps),
            _small_batches(steps),
            _memory_growth(steps),
            _instability(records),
            _stragglers(records),
            _hang(records),
            _out_of_memory(log),
        )
        if f is not None
    ]
    return findings or [Check("bottleneck", OK, "nothing stands out: " + _summary(steps))]


def _summary(steps: list[dict]) -> str:
    tps = mean(r["tokens_per_s"] for r in steps if r.get("tokens_per_s"))
    return (
        f"{len(steps)} logged steps up to step {steps[-1]['step']}, "
        f"{mean(r['step_time_s'] for r in steps):.3f} s per step, {tps:,.0f} tokens/s"
    )


def _share(steps: list[dict], key: str) -> tuple[float, float, float] | None:
    timed = [r for r in steps if r.get(key) is not None]
    if not timed:
        return None
    part, whole = mean(r[key] for r in timed), mean(r["step_time_s"] for r in timed)
    return part / whole, part, whole


def _input_stall(steps: list[dict]) -> Check | None:
    share = _share(steps, "data_time_s")
    if share is None or share[0] < INPUT_STALL_SHARE:
        return None
    return Check(
        "input pipeline stall",
        WARN,
        f"reading batches took {share[0]:.0%} of each step ({share[1]:.3f} s of {share[2]:.3f} s "
        f"on average over {len(steps)} steps)",
        "pre-tokenize the data (gpucloud data prepare), keep it on local disk, or load the "
        "next batch while the step runs",
        {"share": share[0], "data_time_s": share[1], "step_time_s": share[2]},
    )


def _communication(steps: list[dict]) -> Check | None:
    share = _share(steps, "sync_time_s")
    if share is None or share[0] < SYNC_SHARE:
        return None
    return Check(
        "communication",
        WARN,
        f"collectives after backward took {share[0]:.0%} of each step ({share[1]:.3f} s of "
        f"{share[2]:.3f} s on average)",
        "raise the batch per device or gradient accumulation; keep the job's GPUs within "
        "one link domain (NVLink), check `gpucloud doctor` all-reduce bandwidth",
        {"share": share[0], "sync_time_s": share[1], "step_time_s": share[2]},
    )


def _small_batches(steps: list[dict]) -> Check | None:
    per_step = [r["tokens_per_s"] * r["step_time_s"] for r in steps if r.get("tokens_per_s")]
    if not per_step:
        return None
    tokens = mean(per_step)
    mfus = [r["mfu"] for r in steps if r.get("mfu") is not None]
    if tokens >= SMALL_BATCH_TOKENS or (mfus and mean(mfus) >= SMALL_BATCH_MFU):
        return None
    mfu_text = f", MFU {mean(mfus):.1%}" if mfus else ""
    return Check(
        "small batches",
        WARN,
        f"{tokens:,.0f} tokens per step{mfu_text}: fixed per-step costs dominate",
        "raise optim.global_batch (with gradient accumulation if memory is short); "
        "`gpucloud plan train` shows what fits",
        {"tokens_per_step": tokens},
    )


def _memory_growth(steps: list[dict]) -> Check | None:
    mem = [(r["step"], r["memory_bytes"]) for r in steps if r.get("memory_bytes")]
    if len(mem) < 4:
        return None
    warm = mem[len(mem) // 4 :]  # the first quarter: allocator and optimizer state warm-up
    (first_step, first), (last_step, last) = warm[0], warm[-1]
    rising = all(b >= a for (_, a), (_, b) in zip(warm, warm[1:], strict=False))
    if not rising or last - first <= MEMORY_GROWTH * first:
        return None
    per_step = (last - first) / max(last_step - first_step, 1)
    return Check(
        "memory growth",
        WARN,
        f"memory in use grew step over step from {first / 2**30:.2f} GiB (step {first_step}) "
        f"to {last / 2**30:.2f} GiB (step {last_step}), {per_step / 2**20:.1f} MiB per step",
        "look for tensors kept across steps (a loss appended without .item(), graphs kept "
        "alive); it ends in out-of-memory",
        {"first_bytes": first, "last_bytes": last, "bytes_per_step": per_step},
    )


def _instability(records: list[dict]) -> Check | None:
    events: dict[str, list[int]] = {}
    for r in records:
        if r.get("event") in ("skip", "rollback", "stop") and r.get("reason"):
            events.setdefault(r["reason"], []).append(r["step"])
        elif r.get("event") in ("rollback", "rollback_failed"):
            events.setdefault(r["event"], []).append(r["step"])
    if not events:
        return None
    parts = [f"{reason} at step(s) {_steps(at)}" for reason, at in events.items()]
    fix = (
        "lower optim.lr or raise warm-up, clip gradients (optim.grad_clip), prefer bf16 "
        "over fp16; check the data around those steps"
    )
    measured = {reason: float(len(at)) for reason, at in events.items()}
    return Check("NaN/overflow history", WARN, "; ".join(parts), fix, measured)


def _stragglers(records: list[dict]) -> Check | None:
    found = [r for r in records if r.get("event") == "straggler"]
    if not found:
        return None
    parts = [
        f"rank {r['rank']} on host {r['host']} from step {r['step']}: {r['own_time_s']:.3f} s "
        f"of own work per step against a median of {r['peer_median_s']:.3f} s among its peers"
        for r in found
    ]
    return Check(
        "stragglers",
        WARN,
        "; ".join(parts),
        "every rank waits for the slowest at each step: check that host (thermal throttling, "
        "a shared GPU, a slow disk for its data) or resubmit the job on other nodes",
        {"stragglers": float(len({r["rank"] for r in found}))},
    )


def _hang(records: list[dict]) -> Check | None:
    hangs = [r for r in records if r.get("event") == "hang"]
    if not hangs:
        return None
    last = hangs[-1]
    behind = ", ".join(
        f"rank {rank} on host {host}"
        for rank, host in zip(last["behind_ranks"], last["behind_hosts"], strict=True)
    )
    who = f"fell behind: {behind}" if behind else "no rank fell behind: a collective hung"
    return Check(
        "hang",
        FAIL,
        f"step {last['step']} did not finish within {last['timeout_s']:g} s ({len(hangs)} "
        f"hang(s)); {who}",
        "check that host and its network links (`gpucloud doctor` on it); a retry resumes "
        "from the last checkpoint",
        {"hangs": float(len(hangs))},
    )


def _steps(at: list[int]) -> str:
    shown = ", ".join(map(str, at[:8]))
    return shown + (f" and {len(at) - 8} more" if len(at) > 8 else "")


def _out_of_memory(log: str) -> Check | None:
    lines = [line.strip() for line in log.splitlines() if _OOM.search(line)]
    if not lines:
        return None
    return Check(
        "out of memory",
        WARN,
        f"the log reports out-of-memory {len(lines)} time(s), last: {lines[-1][:200]}",
        "lower optim.micro_batch, shard with FSDP, or checkpoint activations; "
        "`gpucloud plan train` estimates what fits",
        {"count": float(len(lines))},
    )
