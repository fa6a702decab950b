"""`gpucloud login`: point the CLI at a control plane, and the client every command uses."""

from __future__ import annotations

from typing import Annotated

import typer

from gpucloud.cli.output import JsonFlag, console, emit


def client():
    """A client for the control plane the credentials file (or environment) names."""
    from gpucloud.control import credentials
    from gpucloud.control.client import Client

    creds = credentials.load()
    return Client(creds.url, creds.api_key)


def login(
    url: Annotated[str, typer.Argument(help="The control plane, e.g. http://127.0.0.1:8470")],
    api_key: Annotated[str, typer.Option(envvar="GPUCLOUD_API_KEY", help="Your API key.")],
    as_json: JsonFlag = False,
) -> None:
    """Check the key against the server and save both in the credentials file."""
    from gpucloud.control import credentials
    from gpucloud.control.client import Client

    me = Client(url, api_key).get("/me")
    path = credentials.save(url.rstrip("/"), api_key)
    emit(
        {**me, "credentials": str(path)},
        as_json,
        lambda m: console.print(
            f"logged in to {url} as {m['user']} ({m['role']}) of tenant {m['tenant']}; "
            f"saved to {m['credentials']}",
            highlight=False,
        ),
    )
