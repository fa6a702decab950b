"""`gpucloud data prepare` (corpus → token files) and `gpucloud data corpus` (demo text)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from gpucloud.cli.output import JsonFlag, console, emit, human_bytes, human_count, table

app = typer.Typer(help="Training data: tokenize a corpus into memory-mapped token files.")


@app.command("prepare")
def prepare(
    tokenizer: Annotated[Path, typer.Option("--tokenizer", help="Model dir with tokenizer.json.")],
    input_path: Annotated[Path, typer.Option("--input", help="corpus.txt or data.jsonl.")],
    out: Annotated[Path, typer.Option("--out", help="Dataset directory to write.")],
    val_fraction: Annotated[float, typer.Option("--val-fraction")] = 0.01,
    as_json: JsonFlag = False,
) -> None:
    """Tokenize in parallel into SPLIT.bin (uint16/uint32) + SPLIT.idx with a held-out split.

    A .txt input holds documents separated by blank lines; .jsonl holds {"text": ...} per
    line. Interrupted? Run the same command again: it continues where it stopped.
    """
    from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn

    from gpucloud.train.prepare import prepare as do_prepare

    with Progress(
        "[progress.description]{task.description}",
        BarColumn(),
        DownloadColumn(),
        TimeRemainingColumn(),
        console=console,
        disable=as_json or not console.is_terminal,
    ) as bar:
        task = bar.add_task("tokenizing", total=None)

        def progress(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total)

        meta = do_prepare(tokenizer, input_path, out, val_fraction, on_progress=progress)
    emit(meta, as_json, _print_meta)


def _print_meta(meta: dict) -> None:
    console.print(
        table(
            f"Dataset ({meta['dtype']}, vocab {meta['vocab_size']})",
            ["split", "documents", "tokens", "size"],
            [
                (
                    name,
                    s["documents"],
                    human_count(s["tokens"]),
                    human_bytes(s["tokens"] * (2 if meta["dtype"] == "uint16" else 4)),
                )
                for name, s in meta["splits"].items()
            ],  # fmt: skip
        )
    )


@app.command("corpus")
def corpus(
    out: Annotated[Path, typer.Option("--out", help="Text file to write.")],
    max_bytes: Annotated[int | None, typer.Option("--max-bytes", min=1)] = None,
    as_json: JsonFlag = False,
) -> None:
    """Write real English text built here from the Python standard library's docstrings."""
    from gpucloud.models.corpus import stdlib_text

    text = stdlib_text(max_bytes)
    out.write_text(text)
    size = len(text.encode())
    emit(
        {"out": str(out), "bytes": size},
        as_json,
        lambda d: console.print(f"wrote {human_bytes(d['bytes'])} to {d['out']}", highlight=False),
    )
