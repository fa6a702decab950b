"""The content of a model directory as the registry records it: a digest per file of its
weights, config and tokenizer, and one hash over them all.

A local directory's files are hashed (sha256 of their bytes). An s3:// one is not
downloaded: its objects' ETags stand for their bytes (for a single-part upload the ETag is
the MD5 of the bytes; a multipart one's depends on the part size, so the same bytes uploaded
differently hash differently: pass a hash of your own then). Torch-free.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from gpucloud import storage
from gpucloud.errors import UserError

# What makes the model: weights (full or a PEFT adapter), configs, tokenizer and template.
MODEL_FILES = (
    "*.safetensors",
    "*.safetensors.index.json",
    "config.json",
    "generation_config.json",
    "adapter_config.json",
    "quantize_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
)
CHUNK = 1 << 20


@dataclass(frozen=True, slots=True)
class Content:
    files: dict[str, str]  # relative name -> "sha256:<hex>" or "etag:<etag>"
    kind: str  # "sha256" | "etag"

    @property
    def hash(self) -> str:
        """One hash of every file's name and digest."""
        text = json.dumps(sorted(self.files.items()))
        return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


def model_content(loc: str | Path) -> Content:
    """The model files at `loc` (a directory or an s3:// URL; top level only). Raises
    UserError when it holds neither weights nor a config."""
    content = _content(loc, _is_model_file)
    if not any(n.endswith(".safetensors") or n == "config.json" for n in content.files):
        raise UserError(
            f"{loc} holds no model files (*.safetensors, config.json): give an HF-format model "
            "directory, e.g. one `gpucloud train export` wrote"
        )
    return content


def tree_content(loc: str | Path) -> Content:
    """Every file at `loc`: one file, or a directory's files at any depth (a dataset)."""
    return _content(loc, lambda name: True)


def _content(loc: str | Path, keep: Callable[[str], bool]) -> Content:
    """The digests of the files at `loc` whose relative names `keep` accepts."""
    if storage.is_url(loc):
        etags = storage.etags(str(loc))
        if not etags:
            raise UserError(f"{loc}: no objects under this prefix")
        return Content({n: "etag:" + e for n, e in etags.items() if keep(n)}, "etag")
    path = Path(loc)
    if path.is_file():
        return Content({path.name: _sha256(path)}, "sha256")
    if not path.is_dir():
        raise UserError(f"{loc}: no such file or directory")
    names = sorted(p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file())
    return Content({n: _sha256(path / n) for n in names if keep(n)}, "sha256")


def _is_model_file(name: str) -> bool:
    return "/" not in name and any(fnmatch.fnmatchcase(name, pattern) for pattern in MODEL_FILES)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return "sha256:" + h.hexdigest()
