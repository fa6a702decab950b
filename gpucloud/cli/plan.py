"""`gpucloud plan`: how much memory, how fast and at what cost to train or serve a model.

Pure arithmetic: nothing here imports torch.
"""

from __future__ import annotations

from typing import Annotated

import typer

from gpucloud.cli.output import (
    JsonFlag,
    console,
    emit,
    human_bytes,
    human_count,
    human_seconds,
    table,
)

app = typer.Typer(help="Capacity planning: memory, speed and cost.", no_args_is_help=True)

Model = Annotated[str, typer.Option("--model", "-m", help="Preset name or HF model directory.")]
Gpu = Annotated[str, typer.Option("--gpu", help="Accelerator type (see `gpucloud hardware list`).")]
Tp = Annotated[int, typer.Option("--tp", help="Tensor-parallel degree.")]
Mfu = Annotated[float, typer.Option("--mfu", help="Share of the dense peak the kernels reach.")]


@app.command("train")
def train(
    model: Model,
    gpu: Gpu,
    gpus: Annotated[int, typer.Option("--gpus", help="GPUs per node.")] = 1,
    nodes: Annotated[int, typer.Option("--nodes")] = 1,
    zero: Annotated[int, typer.Option("--zero", help="ZeRO stage 0-3 (3 = FSDP).")] = 0,
    precision: Annotated[str, typer.Option(help="fp32 | bf16 | fp16 | pure-bf16")] = "bf16",
    optimizer: Annotated[str, typer.Option(help="adamw | sgd | adam8bit")] = "adamw",
    micro_batch: Annotated[int, typer.Option("--micro-batch")] = 1,
    seq_len: Annotated[int, typer.Option("--seq-len")] = 2048,
    recompute: Annotated[str, typer.Option(help="none | selective | full")] = "none",
    tp: Tp = 1,
    pp: Annotated[int, typer.Option("--pp", help="Pipeline-parallel degree.")] = 1,
    sequence_parallel: Annotated[bool, typer.Option("--sequence-parallel")] = False,
    ep: Annotated[
        int, typer.Option("--ep", help="Expert-parallel degree: MoE experts split over DP ranks.")
    ] = 1,
    offload_optimizer: Annotated[
        bool,
        typer.Option(
            "--offload-optimizer",
            help="Master + optimizer states in host RAM (ZeRO-3: "
            "the parameter and gradient shards too, as FSDP2's CPUOffloadPolicy).",
        ),
    ] = False,
    grad_accum: Annotated[
        int, typer.Option("--grad-accum", help="Micro-batches per step (a pipeline's too).")
    ] = 1,
    pipeline_schedule: Annotated[
        str, typer.Option("--pipeline-schedule", help="1f1b | gpipe")
    ] = "1f1b",
    mfu: Mfu = 0.4,
    tokens: Annotated[
        float | None, typer.Option("--tokens", help="Token budget: time and cost to train.")
    ] = None,
    as_json: JsonFlag = False,
) -> None:
    """Training memory per GPU (ZeRO paper and measured-peak conventions), speed and cost."""
    from gpucloud import hardware
    from gpucloud.models.presets import resolve_spec
    from gpucloud.planner import TrainSetup, estimate_training

    spec = resolve_spec(model)
    setup = TrainSetup(hardware.get(gpu), gpus_per_node=gpus, nodes=nodes, zero=zero,
                       precision=precision, optimizer=optimizer, micro_batch=micro_batch,
                       seq_len=seq_len, recompute=recompute, tp=tp, pp=pp, ep=ep,
                       sequence_parallel=sequence_parallel,
                       offload_optimizer=offload_optimizer, grad_accum=grad_accum,
                       pipeline_schedule=pipeline_schedule, mfu=mfu)  # fmt: skip
    emit(estimate_training(spec, setup, tokens).to_dict(), as_json, _render_train)


def _render_train(d: dict) -> None:
    s, g, c = d["setup"], d["per_gpu"], d["conventions"]
    strategy = "DDP" if s["zero"] == 0 else f"ZeRO-{s['zero']}"
    ep = f" ep={s['ep']}" if s["ep"] > 1 else ""
    title = (
        f"{d['model']} ({human_count(d['params'])} params) on {s['world']}× {s['gpu']} — "
        f"{strategy}, dp={s['dp']} tp={s['tp']} pp={s['pp']}{ep}, {s['precision']}, "
        f"{s['optimizer']}, micro-batch {s['micro_batch']} × {s['seq_len']}, "
        f"recompute {s['recompute']}"
    )
    kort = c["korthikanti_activations"]["bytes"]
    ds = c["deepspeed_estimator"]["bytes"]
    rows = [
        ("parameters", g["params_bytes"], ""),
        ("gradients", g["grads_bytes"], ""),
        ("fp32 master weights", g["master_bytes"], ""),
        ("optimizer states", g["optimizer_bytes"], s["optimizer"]),
        ("= model states", g["model_states_bytes"], f"ZeRO paper: {c['model_states']['formula']}"),
        ("saved activations", g["activations_bytes"],
         f"our decoder, counted per tensor (Korthikanti: {human_bytes(kort)})"),
        ("logits + cross-entropy", g["logits_bytes"],
         "fp32 log-softmax, its grads at backward start (pipeline: logits)"),
        ("ZeRO-3 gathered layers", g["gathered_bytes"], "current + prefetched layer"),
        ("communication buffers", g["comm_buffers_bytes"],
         "DDP flat gradient buckets" if s["zero"] <= 1 else "one layer's unsharded grads"),
        ("optimizer temporaries", g["optimizer_temp_bytes"], "foreach AdamW"),
        ("peak allocated", g["peak_allocated_bytes"], f"at {g['peak_phase']}"),
        ("runtime overhead", g["runtime_overhead_bytes"], "CUDA context, cuBLAS/NCCL workspaces"),
        ("allocator fragmentation", g["fragmentation_bytes"], "5% of the peak"),
        ("total per GPU", g["total_bytes"], f"of {human_bytes(g['gpu_memory_bytes'])}"),
    ]  # fmt: skip
    if ds is not None:
        rows.append(("DeepSpeed estimator", ds, "model states: 18 B/param (+4× largest layer)"))
    shown = [(n, human_bytes(b), note) for n, b, note in rows if b or n not in _OPTIONAL]
    console.print(_notes_left(table(title, ["per GPU", "bytes", "convention"], shown)))
    console.print(_verdict(d["fits"], d["free_bytes"], d["shortfall_bytes"]))
    speed = [
        ("FLOPs per token", f"{d['flops_per_token']:.3g}", "6·N + attention"),
        ("step time", human_seconds(d["step_time_s"]), f"{d['tokens_per_step']} tokens/step"),
        (
            "compute",
            human_seconds(d["compute_s"]),
            f"pipeline bubble {d['bubble_fraction']:.0%}" if s["pp"] > 1 else "at the MFU",
        ),
        (
            "communication",
            human_seconds(d["comm_s"]),
            f"{human_bytes(d['comm_bytes_per_gpu'])} per GPU; "
            f"{human_seconds(d['exposed_comm_s'])} not hidden by compute",
        ),
        ("throughput", f"{d['tokens_per_s']:,.0f} tokens/s", f"MFU {d['mfu']:.0%}"),
    ]
    if s["ep"] > 1:
        speed.insert(-1, ("expert all-to-all", human_seconds(d["all_to_all_s"]),
                          f"{human_bytes(d['all_to_all_bytes_per_gpu'])} sent per GPU, "
                          "not hidden by compute"))  # fmt: skip
    if d["train"]:
        t = d["train"]
        speed += [
            ("time to train", human_seconds(t["time_s"]), f"{t['tokens']:.3g} tokens"),
            ("cost", f"${t['usd']:,.0f}", f"{t['gpu_hours']:,.0f} GPU-hours"),
        ]
    if d["host_offload_bytes_per_node"]:
        speed.append(("host RAM per node", human_bytes(d["host_offload_bytes_per_node"]),
                      "offloaded states"))  # fmt: skip
    console.print(_notes_left(table("Speed and cost", ["", "value", "note"], speed)))
    for note in d["notes"]:
        console.print(f"note: {note}", highlight=False)


# Lines that only some strategies have: hidden when zero.
_OPTIONAL = {"fp32 master weights", "ZeRO-3 gathered layers", "communication buffers",
             "optimizer temporaries"}  # fmt: skip


def _notes_left(t):
    """Notes read better left-aligned; `table` right-aligns every column but the first."""
    t.columns[-1].justify = "left"
    return t


def _verdict(fits: bool, free: float, shortfall: float) -> str:
    if fits:
        return f"[green]fits[/green]: {human_bytes(free)} free per GPU"
    return f"[red]does not fit[/red]: {human_bytes(shortfall)} short per GPU"


@app.command("serve")
def serve(
    model: Model,
    gpu: Gpu,
    quant: Annotated[str, typer.Option(help="fp32 | bf16 | fp16 | fp8 | int8 | int4")] = "bf16",
    kv_dtype: Annotated[str, typer.Option("--kv-dtype", help="auto | bf16 | fp8 | ...")] = "auto",
    max_seq_len: Annotated[int, typer.Option("--max-seq-len")] = 4096,
    tp: Tp = 1,
    concurrency: Annotated[
        int | None, typer.Option(help="Sequences of max-seq-len that must fit at once.")
    ] = None,
    memory_fraction: Annotated[float, typer.Option("--memory-fraction")] = 0.9,
    mfu: Mfu = 0.4,
    as_json: JsonFlag = False,
) -> None:
    """Serving memory: weights, KV cache capacity, concurrent sequences, speed and cost."""
    from gpucloud import hardware
    from gpucloud.models.presets import resolve_spec
    from gpucloud.planner import ServeSetup, estimate_inference

    spec = resolve_spec(model)
    setup = ServeSetup(hardware.get(gpu), quant=quant, kv_dtype=kv_dtype,
                       max_seq_len=max_seq_len, tp=tp, memory_fraction=memory_fraction,
                       concurrency=concurrency, mfu=mfu)  # fmt: skip
    emit(estimate_inference(spec, setup).to_dict(), as_json, _render_serve)


def _render_serve(d: dict) -> None:
    s = d["setup"]
    title = (
        f"{d['model']} ({human_count(d['params'])} params) on {s['tp']}× {s['gpu']} — "
        f"{s['quant']} weights, {s['kv_bytes_per_element']}-byte KV, max {s['max_seq_len']} tokens"
    )
    rows = [
        ("weights (whole model)", human_bytes(d["weights_bytes"]), s["quant"]),
        ("weights per GPU", human_bytes(d["weights_per_gpu_bytes"]), f"tp={s['tp']}"),
        ("activation workspace", human_bytes(d["workspace_bytes"]), "one prefill chunk"),
        ("runtime overhead", human_bytes(d["runtime_overhead_bytes"]), "CUDA context etc."),
        ("KV per token", human_bytes(d["kv_bytes_per_token"]), "2·layers·kv_heads·head_dim·bytes"),
        ("KV cache per GPU", human_bytes(max(0, d["kv_cache_bytes"])),
         f"{s['memory_fraction']:.0%} of GPU memory minus the above"),
        ("tokens in cache", f"{d['max_tokens_in_cache']:,}", f"blocks of {s['block_size']}"),
        ("concurrent sequences", f"{d['max_concurrent_seqs']:,}", f"of {s['max_seq_len']} tokens"),
        ("prefill", human_seconds(d["prefill_time_s"]), f"{s['max_seq_len']}-token prompt"),
        ("decode, batch 1", f"{d['decode_tokens_per_s_batch1']:,.0f} tokens/s", "bandwidth bound"),
        ("decode, FLOPs bound", f"{d['decode_tokens_per_s_flops_bound']:,.0f} tokens/s",
         f"MFU {s['mfu']:.0%}"),
        (f"decode, batch {d['batch']}", f"{d['decode_tokens_per_s']:,.0f} tokens/s",
         "half-full contexts"),
        ("cost", f"${d['usd_per_hour']:.2f}/h",
         f"${d['usd_per_million_tokens']:.3f} per 1M tokens"),
    ]  # fmt: skip
    console.print(_notes_left(table(title, ["", "value", "note"], rows)))
    short = d["shortfall_bytes"]
    console.print(_verdict(d["fits"], 0, short) if not d["fits"] else "[green]fits[/green]")


@app.command("recommend")
def recommend(
    model: Model,
    task: Annotated[str, typer.Option(help="train | serve")],
    tokens: Annotated[float, typer.Option(help="train: token budget.")] = 1e9,
    seq_len: Annotated[int, typer.Option("--seq-len", help="train: sequence length.")] = 4096,
    micro_batch: Annotated[int, typer.Option("--micro-batch")] = 1,
    precision: Annotated[str, typer.Option(help="train: fp32 | bf16 | pure-bf16")] = "bf16",
    concurrency: Annotated[int, typer.Option(help="serve: concurrent sequences.")] = 1,
    max_seq_len: Annotated[int, typer.Option("--max-seq-len", help="serve: context.")] = 4096,
    headroom: Annotated[float, typer.Option(help="Memory kept free.")] = 0.10,
    max_gpus: Annotated[int, typer.Option("--max-gpus")] = 512,
    top: Annotated[int, typer.Option(help="Rows in the table (0: all); JSON has all.")] = 12,
    as_json: JsonFlag = False,
) -> None:
    """Configurations (GPU × count × strategy or quantization) that fit, cheapest first."""
    from gpucloud.models.presets import resolve_spec
    from gpucloud.planner import recommend as plan_recommend

    spec = resolve_spec(model)
    rec = plan_recommend(spec, task, tokens=tokens, seq_len=seq_len, micro_batch=micro_batch,
                         precision=precision, concurrency=concurrency, max_seq_len=max_seq_len,
                         headroom=headroom, max_gpus=max_gpus)  # fmt: skip
    emit(rec.to_dict(), as_json, lambda d: _render_recommend(d, top))


def _render_recommend(d: dict, top: int) -> None:
    if d["task"] == "train":
        cols = ["GPU", "GPUs", "strategy", "per GPU", "tokens/s", "time", "cost"]
        rows = [(o["gpu"], o["gpus"], o["strategy"], human_bytes(o["per_gpu_bytes"]),
                 f"{o['tokens_per_s']:,.0f}", human_seconds(o["time_s"]), f"${o['usd']:,.0f}")
                for o in d["options"]]  # fmt: skip
    else:
        cols = ["GPU", "GPUs", "quant", "per GPU", "tokens/s", "$/h", "$/1M tokens"]
        rows = [(o["gpu"], o["gpus"], o["strategy"], human_bytes(o["per_gpu_bytes"]),
                 f"{o['tokens_per_s']:,.0f}", f"{o['usd_per_hour']:.2f}",
                 f"{o['usd_per_million_tokens']:.3f}") for o in d["options"]]  # fmt: skip
    title = (
        f"{d['model']}: {d['task']} configurations with {d['headroom']:.0%} headroom, "
        "cheapest first"
    )
    console.print(table(title, cols, rows[:top] if top else rows))
    if top and len(rows) > top:
        console.print(f"… {len(rows) - top} more (--top 0 lists all)")
    if d["rejected"]:
        rows = [(o["gpu"], o["strategy"], o["reason"]) for o in d["rejected"]]
        console.print(_notes_left(table("Does not fit", ["GPU", "option", "why"], rows)))
