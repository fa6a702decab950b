"""Where checkpoints, datasets and model directories live: a local path or a URL.

A location is a local path (a shared filesystem's mount works as is) or an fsspec URL such
as `s3://bucket/prefix`, so a job requeued onto another machine finds the same checkpoints.
Checkpoints are read and written in place (`files`, `read_bytes`, `write_bytes`, ...).
Model directories and prepared datasets, read many times through memory maps, are fetched
once into a local cache (`local_copy`) named after the objects' ETags: loading again lists
the objects but downloads nothing, and a changed upload is fetched anew.

S3's endpoint and credentials come from the standard AWS environment (AWS_ENDPOINT_URL,
AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_DEFAULT_REGION), read by botocore; gpucloud
never writes them anywhere. fsspec (and s3fs, the `storage` extra) are imported only when
storage is touched, so the control plane needs neither.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from gpucloud.errors import UserError

Location = Path | str
"""A local path, or a URL: a str with a scheme, e.g. 's3://bucket/run1/ckpt'."""

CACHE_ENV = "GPUCLOUD_STORAGE_CACHE"
# The URLs a tenant's workloads may name through the control plane (checkpoints, models):
# the object storage that the `storage` extra reaches and the tests exercise.
OBJECT_STORAGE = ("s3://",)
_URL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*://")

# botocore logs at INFO where it found the credentials and the endpoint, for every client:
# noise in a server's or a training run's log.
for _noisy in ("botocore", "aiobotocore"):
    logging.getLogger(_noisy).setLevel(logging.WARNING)


def is_url(location: Location) -> bool:
    return isinstance(location, str) and bool(_URL.match(location))


def location(text: str | Path) -> Location:
    """`text` as a location: a URL stays a str, anything else becomes a Path."""
    return text if is_url(text) else Path(text)


def join(base: Location, *names: str) -> Location:
    if is_url(base):
        return "/".join([base.rstrip("/"), *names])
    return Path(base).joinpath(*names)


def files(loc: Location) -> list[str]:
    """Paths relative to `loc` of every file and directory under it; [] when it is absent."""
    fs, root = _filesystem(loc)
    with user_errors(loc):
        found = fs.find(root, withdirs=True)
    return sorted(p[len(root) :].strip("/") for p in found if p.rstrip("/") != root.rstrip("/"))


def read_bytes(loc: Location) -> bytes:
    fs, path = _filesystem(loc)
    with user_errors(loc):
        return fs.cat_file(path)


def write_bytes(loc: Location, data: bytes) -> None:
    """Write a whole file (on object storage, one object appears complete or not at all)."""
    fs, path = _filesystem(loc)
    with user_errors(loc):
        fs.pipe_file(path, data)


def remove_tree(loc: Location) -> None:
    """Delete `loc` and everything under it; nothing happens when it is absent."""
    fs, path = _filesystem(loc)
    with user_errors(loc), contextlib.suppress(FileNotFoundError):
        fs.rm(path, recursive=True)


def check_reachable(url: str) -> None:
    """Raise UserError unless `url`'s bucket exists and the credentials may list it."""
    files(url)  # a missing bucket fails; a missing prefix in a bucket is an empty listing


def local_copy(loc: Location) -> Path:
    """`loc` as a local directory: a path as is, a URL's objects fetched into the cache once.

    The cache entry is named by a hash of the URL and each object's name, size and ETag, so
    another load lists the objects (one request) and downloads nothing. Raises UserError
    naming the URL when it cannot be read or holds no objects.
    """
    if not is_url(loc):
        return Path(loc)
    fs, root = _filesystem(loc)
    with user_errors(loc):
        objects = fs.find(root, detail=True)
        if not objects:
            raise UserError(f"{loc}: no such directory (no objects under this prefix)")
        entry = cache_dir() / _fingerprint(fs, root, objects)
        if not entry.is_dir():
            _download(fs, root, list(objects), entry)
    return entry / _name(root)


def etags(url: str) -> dict[str, str]:
    """Each object under `url` (by its name relative to it) -> its ETag, without quotes;
    {} when there are none. Raises UserError naming the URL when it cannot be listed."""
    fs, root = _filesystem(url)
    with user_errors(url):
        objects = fs.find(root, detail=True)
    return {
        key[len(root) :].strip("/"): str(info.get("ETag") or "").strip('"')
        for key, info in objects.items()
    }


def cache_dir() -> Path:
    """Where `local_copy` keeps fetched directories: $GPUCLOUD_STORAGE_CACHE or
    ~/.cache/gpucloud/storage."""
    default = Path.home() / ".cache" / "gpucloud" / "storage"
    return Path(os.environ.get(CACHE_ENV) or default)


@contextlib.contextmanager
def user_errors(loc: Location) -> Iterator[None]:
    """Turn a storage failure (no bucket, no credentials, endpoint down, ...) into a
    one-line UserError naming `loc`."""
    try:
        yield
    except UserError:
        raise
    except Exception as e:
        reason = _reason(e)
        if reason is None:
            raise
        raise UserError(f"{loc}: {reason}") from None


def fs_options(loc: Location) -> dict[str, Any]:
    """fsspec's options for `loc`. Listings are never cached: other ranks and other machines
    write the same prefixes. fsspec keeps one filesystem per scheme and options, not per
    environment: S3's endpoint is an option, so a process whose AWS_ENDPOINT_URL changed
    gets a client of the new endpoint, not the old one's."""
    options: dict[str, Any] = {"use_listings_cache": False}
    if not is_url(loc):
        options["auto_mkdir"] = True  # as open() of a local file in a new step dir needs
    elif str(loc).startswith("s3://") and os.environ.get("AWS_ENDPOINT_URL"):
        options["client_kwargs"] = {"endpoint_url": os.environ["AWS_ENDPOINT_URL"]}
    return options


def _filesystem(loc: Location) -> tuple[Any, str]:
    """(fsspec filesystem, path inside it)."""
    with user_errors(loc):
        from fsspec.core import url_to_fs

        fs, path = url_to_fs(str(loc), **fs_options(loc))
    if not path.strip("/"):
        raise UserError(f"{loc}: name a bucket and a prefix, e.g. s3://bucket/prefix")
    return fs, path


def _reason(e: Exception) -> str | None:
    """What went wrong, in words a user can act on; None for errors that are bugs."""
    kinds = {cls.__name__ for cls in type(e).__mro__}
    endpoint = os.environ.get("AWS_ENDPOINT_URL", "AWS's default endpoint")
    if isinstance(e, ImportError):
        return f"no driver for this URL ({e}); for s3:// install gpucloud[storage]"
    if kinds & {"NoCredentialsError", "PartialCredentialsError"}:
        return "no credentials: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY"
    if kinds & {"EndpointConnectionError", "ConnectTimeoutError"}:
        return f"cannot reach the storage endpoint {endpoint} (set by AWS_ENDPOINT_URL)"
    if isinstance(e, FileNotFoundError):
        return f"not found ({e})"
    if isinstance(e, PermissionError):
        return f"access denied ({e})"
    if "ClientError" in kinds or isinstance(e, OSError):
        return str(e)
    return None


def _name(root: str) -> str:
    return root.rstrip("/").rsplit("/", 1)[-1]


def _fingerprint(fs, root: str, objects: dict[str, dict]) -> str:
    listed = sorted(
        (key[len(root) :], info.get("size"), info.get("ETag") or info.get("mtime"))
        for key, info in objects.items()
    )
    text = json.dumps([fs.protocol, root, listed], default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def _download(fs, root: str, keys: list[str], entry: Path) -> None:
    """Fetch `keys` into entry/NAME through a private temporary dir renamed into place, so a
    reader never sees a partial copy and concurrent fetches of the same entry both work."""
    name = _name(root)
    part = entry.with_name(f"{entry.name}.part-{os.getpid()}")
    shutil.rmtree(part, ignore_errors=True)
    local = [str(part / name / key[len(root) :].lstrip("/")) for key in keys]
    for path in local:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
    try:
        fs.get(keys, local)
        part.rename(entry)
    except OSError:
        if not entry.is_dir():  # else another process fetched the same entry first
            raise
    finally:
        shutil.rmtree(part, ignore_errors=True)
