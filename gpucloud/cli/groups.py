"""Command groups with a default command: `gpucloud train FILE` is `gpucloud train run FILE`,
`gpucloud eval MODEL ...` is `gpucloud eval run MODEL ...`."""

from __future__ import annotations

from typer.core import TyperGroup


class RunByDefault(TyperGroup):
    """Anything that is not one of the group's commands or a help flag goes to `run`."""

    def parse_args(self, ctx, args):
        if args and args[0] not in self.commands and args[0] not in ("--help", "-h"):
            args = ["run", *args]
        return super().parse_args(ctx, args)
