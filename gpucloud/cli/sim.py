"""`gpucloud sim`: replay a GPU-cluster trace under scheduling policies and compare them."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from gpucloud.cli.output import JsonFlag, console, emit, human_seconds, table

app = typer.Typer(
    help="Replay cluster traces and compare scheduling policies.", no_args_is_help=True
)

TraceOpt = Annotated[
    Path, typer.Option("--trace", help="Trace CSV (ITP, Philly, Tiresias, Alibaba or gpucloud).")
]
VcOpt = Annotated[str | None, typer.Option("--vc", help="Keep one Philly virtual cluster.")]
ClusterOpt = Annotated[
    str,
    typer.Option(
        "--cluster",
        help="NODESxGPUS with optional /DOMAIN and :TYPE, comma-separated (16x8, "
        "4x8/4:H100-SXM,2x8:910B), or a node CSV with a gpu column.",
    ),
]
GpuOpt = Annotated[str, typer.Option("--gpu", help="GPU type for parts that name none.")]
ErrorOpt = Annotated[
    float, typer.Option("--estimate-error", help="Sigma of the log-normal estimate error.")
]
MissingOpt = Annotated[
    float, typer.Option("--estimate-missing", help="Share of jobs with no estimate.")
]
CkptOpt = Annotated[
    float, typer.Option("--checkpoint-interval", help="Seconds between checkpoints (0 = none).")
]
SeedOpt = Annotated[int, typer.Option("--seed", help="Seed of the estimate errors.")]
LimitOpt = Annotated[int | None, typer.Option("--limit", help="Keep the first N jobs.")]


def _replay(
    trace: Path,
    vc: str | None,
    cluster: str,
    gpu: str,
    policies: list[str],
    error: float,
    missing: float,
    ckpt: float,
    seed: int,
    limit: int | None,
):
    from gpucloud.errors import UserError
    from gpucloud.scheduler import EstimateModel, get_policy, load_trace, parse_cluster, simulate

    if error < 0 or not 0 <= missing <= 1 or ckpt < 0:
        raise UserError(
            "--estimate-error must be >= 0, --estimate-missing in 0..1, --checkpoint-interval >= 0"
        )
    pols = [get_policy(p.strip()) for p in policies]
    tr = load_trace(trace, vc=vc, limit=limit)
    if not tr.jobs:
        raise UserError(f"{trace} has no jobs to replay")
    nodes = parse_cluster(cluster, gpu)
    model = EstimateModel(error, missing)
    return [
        simulate(tr, nodes, p, estimates=model, checkpoint_interval=ckpt or None, seed=seed)
        for p in pols
    ]


def _summary_table(results) -> None:
    from gpucloud.scheduler.sim.report import headers, rows

    first = results[0]
    title = (
        f"{first.trace} on {first.cluster}: {first.summary['jobs']} jobs, "
        f"{first.summary['skipped']} skipped"
    )
    console.print(table(title, headers(results), rows(results)))


@app.command()
def run(
    trace: TraceOpt,
    cluster: ClusterOpt,
    policy: Annotated[str, typer.Option("--policy", help="A preset: see `gpucloud sim policies`.")],
    vc: VcOpt = None,
    gpu: GpuOpt = "A100-80GB",
    estimate_error: ErrorOpt = 1.0,
    estimate_missing: MissingOpt = 0.1,
    checkpoint_interval: CkptOpt = 1800.0,
    seed: SeedOpt = 0,
    limit: LimitOpt = None,
    as_json: JsonFlag = False,
) -> None:
    """Replay a trace under one policy: JCT, waits, utilization, preemptions, fairness."""
    (result,) = _replay(
        trace, vc, cluster, gpu, [policy], estimate_error, estimate_missing,
        checkpoint_interval, seed, limit,
    )  # fmt: skip

    def render(s: dict) -> None:
        _summary_table([result])
        console.print(
            table(
                "by job size (GPUs)",
                ["size", "jobs", "avg JCT", "p95 JCT", "avg wait", "max wait"],
                [
                    (
                        k,
                        g["jobs"],
                        human_seconds(g["avg_jct_s"]),
                        human_seconds(g["p95_jct_s"]),
                        human_seconds(g["avg_queue_s"]),
                        human_seconds(g["max_wait_s"]),
                    )
                    for k, g in s["per_size"].items()
                ],  # fmt: skip
            )
        )
        for reason, n in s["skipped_reasons"].items():
            console.print(f"skipped {n} jobs: {reason}")

    emit(result.summary, as_json, render)


@app.command()
def compare(
    trace: TraceOpt,
    cluster: ClusterOpt,
    policies: Annotated[
        str, typer.Option("--policies", help="Comma-separated presets; the first is the baseline.")
    ] = "fifo,sjf,tiresias,kueue,gpucloud",
    out: Annotated[
        Path | None, typer.Option("--out", help="Directory for report.md and PNG plots.")
    ] = None,
    vc: VcOpt = None,
    gpu: GpuOpt = "A100-80GB",
    estimate_error: ErrorOpt = 1.0,
    estimate_missing: MissingOpt = 0.1,
    checkpoint_interval: CkptOpt = 1800.0,
    seed: SeedOpt = 0,
    limit: LimitOpt = None,
    as_json: JsonFlag = False,
) -> None:
    """Replay a trace under several policies side by side; optionally write a report."""
    results = _replay(
        trace, vc, cluster, gpu, policies.split(","), estimate_error, estimate_missing,
        checkpoint_interval, seed, limit,
    )  # fmt: skip
    written = []
    if out is not None:
        from gpucloud.scheduler.sim.report import write_report

        written = [str(p) for p in write_report(results, out)]

    def render(_: object) -> None:
        _summary_table(results)
        for p in written:
            console.print(f"wrote {p}")

    emit([r.summary for r in results], as_json, render)


@app.command()
def sweep(
    trace: Annotated[
        list[str],
        typer.Option(
            "--trace",
            help="PATH[@VC][=CLUSTER], repeatable; a directory means every CSV in it. "
            "Without =CLUSTER: nodes of 8 GPUs sized by --load.",
        ),
    ] = [],  # noqa: B006 (typer reads the default; it is never mutated)
    policy: Annotated[
        str, typer.Option("--policy", help="A preset: see `gpucloud sim policies`.")
    ] = "gpucloud",
    synthetic: Annotated[
        str,
        typer.Option(
            "--synthetic",
            help="Comma-separated seeds of synthetic traces (diurnal, Pareto, gangs up to "
            "32 nodes, on 64x8); empty for none.",
        ),
    ] = "0,1,2",
    synthetic_jobs: Annotated[
        int, typer.Option("--synthetic-jobs", help="Jobs per synthetic trace.")
    ] = 3000,
    load: Annotated[
        float, typer.Option("--load", help="Mean offered load that sizes clusters not given.")
    ] = 0.875,
    bound: Annotated[
        bool, typer.Option("--bound/--no-bound", help="Solve the LP lower bound (slow).")
    ] = True,
    estimate_error: ErrorOpt = 1.0,
    estimate_missing: MissingOpt = 0.1,
    seed: SeedOpt = 0,
    as_json: JsonFlag = False,
) -> None:
    """One policy over many traces: avg JCT, p99 and max wait as ratios to strict FIFO,
    next to oracle SJF, the LP lower bound on avg JCT, and the target per trace (avg JCT
    <= max(0.5, 1.1 x LP bound), p99 wait <= 1.00 x, max wait <= 1.05 x FIFO's) and
    whether it is met."""
    from dataclasses import asdict

    from gpucloud.errors import UserError
    from gpucloud.scheduler import EstimateModel, get_policy
    from gpucloud.scheduler.sim import sweep as sw

    if estimate_error < 0 or not 0 <= estimate_missing <= 1 or not 0 < load <= 1:
        raise UserError("--estimate-error must be >= 0, --estimate-missing and --load in 0..1")
    try:
        seeds = [int(s) for s in synthetic.split(",") if s.strip()]
    except ValueError:
        raise UserError(f"--synthetic {synthetic!r}: write comma-separated integer seeds") from None
    if synthetic_jobs < 1:
        raise UserError("--synthetic-jobs must be >= 1")
    pol = get_policy(policy)
    runs = [sw.load_spec(s, load) for s in sw.expand(trace)]
    runs += sw.synthetic_traces(seeds, synthetic_jobs, load)
    if not runs:
        raise UserError("nothing to sweep: give --trace or --synthetic seeds")
    model = EstimateModel(estimate_error, estimate_missing)
    slot = 4 * 3600.0 if bound else None
    rows = [sw.sweep_one(tr, c, pol, estimates=model, seed=seed, bound_slot=slot) for tr, c in runs]

    def fmt(x: float | None) -> str:
        return "-" if x is None else f"{x:.3f}"

    def render(_: object) -> None:
        console.print(
            table(
                f"{pol.name} vs strict FIFO (ratios; estimate error sigma {estimate_error:g}, "
                f"{estimate_missing:.0%} missing, seed {seed})",
                [
                    "trace",
                    "cluster",
                    "jobs",
                    "avg JCT",
                    "p99 wait",
                    "max wait",
                    "oracle SJF JCT",
                    "LP bound JCT",
                    "target JCT",
                    "met",
                    "FIFO max wait",
                ],
                [
                    [
                        r.trace,
                        r.cluster,
                        r.jobs,
                        fmt(r.jct_ratio),
                        fmt(r.p99_wait_ratio),
                        fmt(r.max_wait_ratio),
                        fmt(r.oracle_sjf_ratio),
                        fmt(r.lp_bound_ratio),
                        fmt(r.target_jct_ratio),
                        "yes" if r.target_met else "no",
                        human_seconds(r.fifo_max_wait_s),
                    ]
                    for r in rows
                ],
            )  # fmt: skip
        )

    emit([asdict(r) for r in rows], as_json, render)


@app.command("policies")
def list_policies(as_json: JsonFlag = False) -> None:
    """The policy presets and what each combines."""
    from gpucloud.scheduler import POLICIES

    data = [
        {
            "name": p.name,
            "ordering": p.ordering.name,
            "backfill": p.backfill,
            "quotas": p.quotas,
            "preempt": p.preempt,
            "reclaim": p.reclaim,
            "starvation_after_s": p.starvation_after,
            "starvation_backlog": p.starvation_backlog,
            "due_slack_s": p.due_slack,
            "guard": p.guard,
        }
        for p in POLICIES.values()
    ]
    emit(
        data,
        as_json,
        lambda d: console.print(
            table("Scheduling policy presets", list(d[0]), [list(r.values()) for r in d])
        ),
    )


@app.command()
def inflate(
    trace: TraceOpt,
    cluster: ClusterOpt,
    placement: Annotated[
        str, typer.Option("--placement", help="Comma-separated strategies: pack, spread, fgd.")
    ] = "pack,fgd",
    seed: Annotated[int, typer.Option("--seed", help="Seed of the pod draws.")] = 0,
    until: Annotated[
        float, typer.Option("--until", help="Stop at this arrived workload (x capacity).")
    ] = 1.0,
    out: Annotated[Path | None, typer.Option("--out", help="Directory for inflation.png.")] = None,
    gpu: GpuOpt = "A100-80GB",
    as_json: JsonFlag = False,
) -> None:
    """FGD-style inflation: draw pods until the cluster is full; fragmentation and failures."""
    from gpucloud.scheduler import load_trace, parse_cluster
    from gpucloud.scheduler.sim.inflate import inflate as run_inflation
    from gpucloud.scheduler.sim.inflate import write_plot

    tr = load_trace(trace)
    nodes = parse_cluster(cluster, gpu)
    results = [run_inflation(tr, nodes, p.strip(), seed, until) for p in placement.split(",")]
    written = [str(write_plot(results, out))] if out is not None else []
    marks = [m for m in (0.5, 0.7, 0.9, 1.0) if m <= until]

    def render(_: object) -> None:
        first = results[0]
        head = [f"frag {m:.0%}" for m in marks] + [f"failed {m:.0%}" for m in marks]
        console.print(
            table(
                f"{first.trace} on {first.cluster}: {first.pods} pods, seed {seed}",
                ["placement", *head, "GPUs allocated", "pods failed"],
                [
                    [r.placement]
                    + [f"{r.at(m).fragmentation_rate:.1%}" for m in marks]
                    + [f"{r.at(m).failure_share:.2%}" for m in marks]
                    + [f"{r.curve[-1].allocated_gpus:.1f}", r.failed_pods]
                    for r in results
                ],
            )
        )
        console.print("frag: fragmented GPUs, % of idle; failed: requested GPUs not placed, %")
        for p in written:
            console.print(f"wrote {p}")

    emit([r.summary(marks) for r in results], as_json, render)
