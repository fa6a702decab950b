"""The `gpucloud` command. Each group lives in its own module and imports its part lazily,
so `gpucloud plan` never loads torch."""

from __future__ import annotations

import shutil
import sys

import rich.markup
import typer
import typer.rich_utils

from gpucloud.cli import control as control_cli
from gpucloud.cli import data as data_cli
from gpucloud.cli import diff as diff_cli
from gpucloud.cli import doctor as doctor_cli
from gpucloud.cli import eval as eval_cli
from gpucloud.cli import generate as generate_cli
from gpucloud.cli import hal as hal_cli
from gpucloud.cli import hardware as hardware_cli
from gpucloud.cli import k8s as k8s_cli
from gpucloud.cli import model as model_cli
from gpucloud.cli import plan as plan_cli
from gpucloud.cli import serve as serve_cli
from gpucloud.cli import sim as sim_cli
from gpucloud.cli import train as train_cli
from gpucloud.cli.output import err_console
from gpucloud.errors import GpucloudError, UserError

_app = typer.Typer(
    name="gpucloud",
    help="A self-hosted GPU cloud: plan, share, train and serve.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
_app.add_typer(hardware_cli.app, name="hardware")
_app.add_typer(hal_cli.app, name="hal")
_app.add_typer(model_cli.app, name="model")
_app.command("serve")(serve_cli.serve)
_app.command("generate")(generate_cli.generate)
_app.add_typer(plan_cli.app, name="plan")
_app.add_typer(sim_cli.app, name="sim")
_app.add_typer(train_cli.app, name="train")
_app.add_typer(data_cli.app, name="data")
_app.add_typer(eval_cli.app, name="eval")
_app.command("diff")(diff_cli.diff)
_app.command("doctor")(doctor_cli.doctor)
_app.add_typer(k8s_cli.app, name="k8s")
control_cli.register(_app)  # up, server, down, login, usage, tenant, key, quota, node, job, deploy


# Help narrower than this cuts long option names ("--kv-cache-memory-f…") in its tables.
HELP_WIDTH = 100


def configure_help() -> None:
    """Render help as wide as the terminal and never narrower than HELP_WIDTH: rich would
    use 80 columns in a pipe or a narrow terminal, cutting option names with "…"."""
    typer.rich_utils.MAX_WIDTH = max(shutil.get_terminal_size().columns, HELP_WIDTH)


def app() -> None:
    """Entry point: run the CLI, turning gpucloud errors into one line and an exit code.

    Usage errors (unknown option, bad value) are click's and exit with 2 by themselves.
    """
    configure_help()
    try:
        _app()
    except UserError as e:
        _print_error(e)
        sys.exit(2)
    except GpucloudError as e:
        _print_error(e)
        sys.exit(1)


def _print_error(e: GpucloudError) -> None:
    """The message as written: it quotes user input, where rich would read `[x]` as markup
    and `:two:` as an emoji."""
    message = rich.markup.escape(str(e))
    err_console.print(f"[red]error:[/red] {message}", highlight=False, soft_wrap=True, emoji=False)
