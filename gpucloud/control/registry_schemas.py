"""Request and response bodies of the model registry (pydantic)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, StringConstraints, field_validator

from gpucloud.control.model_ref import ModelRef
from gpucloud.control.schemas import FilePath, _path_or_object_storage, _Spec

# "sha256:<64 hex>" of bytes, or the hash of the objects' ETags, or the caller's own.
ContentHash = Annotated[str, StringConstraints(pattern=r"^[a-z0-9]{1,15}:[0-9a-f]{8,64}$")]
# A file's digest: "sha256:<hex>", or "etag:<the object's ETag>" (a multipart one has a dash).
FileDigest = Annotated[str, StringConstraints(pattern=r"^[a-z0-9]+:[0-9A-Za-z_-]{1,128}$")]
HashKind = Literal["sha256", "etag", "given"]
Text = Annotated[str, StringConstraints(max_length=4096)]


class ModelRegister(_Spec):
    """What `gpucloud model register` sends: where the files are, what they hash to, and
    what produced them (each field of the lineage only if known)."""

    uri: FilePath = Field(description="the model dir (absolute path) or its s3:// URL")
    content_hash: ContentHash
    hash_kind: HashKind = Field(
        description="sha256 of the files' bytes, the objects' etag, or a hash the caller given"
    )
    files: dict[Annotated[str, StringConstraints(max_length=1024)], FileDigest] = Field(
        default_factory=dict, max_length=10_000, description="each hashed file -> its digest"
    )
    base: ModelRef | None = Field(default=None, description="the registered version it came from")
    base_model: Text | None = Field(default=None, description="what training started from")
    dataset: Text | None = None
    dataset_hash: ContentHash | None = None
    train_config: dict[str, Any] | None = Field(default=None, description="the resolved config")
    run: Text | None = Field(default=None, description="the training run (its run dir)")
    step: int | None = Field(default=None, ge=0, le=2**31 - 1, description="its checkpoint's step")

    _check_uri = field_validator("uri")(_path_or_object_storage)


class EvalSubmit(_Spec):
    """A result of `gpucloud eval ... --json` to store on a model version."""

    task: Annotated[str, StringConstraints(min_length=1, max_length=255)]
    metric: Annotated[str, StringConstraints(max_length=32)]
    score: float
    ci_low: float
    ci_high: float
    n: int = Field(ge=1, le=100_000)
    task_hash: ContentHash
    kind: Annotated[str, StringConstraints(max_length=32)]
    model: Text
    seed: int
    metrics: dict[str, dict[str, float]]
    # a perplexity's rolling windows (gpucloud/eval/windows.py): results of other strides differ
    max_length: int | None = Field(None, ge=1)
    stride: int | None = Field(None, ge=1)
    items: list[dict[str, Any]] = Field(
        min_length=1, max_length=100_000, description="per-item records: what compare resamples"
    )


class EvalPublic(BaseModel):
    model_config = {"from_attributes": True}

    task: str
    task_hash: str
    kind: str
    metric: str
    score: float
    ci_low: float
    ci_high: float
    n: int
    created_at: float


class ModelVersionPublic(BaseModel):
    tenant: str
    name: str
    version: int
    ref: str = Field(description="NAME:VERSION")
    uri: str
    content_hash: str
    hash_kind: str
    files: dict[str, str]
    base: str | None = Field(description="the registered version it came from (NAME:VERSION)")
    base_model: str | None
    dataset: str | None
    dataset_hash: str | None
    train_config: dict[str, Any] | None
    run: str | None
    step: int | None
    created_at: float
    created: bool = Field(
        default=True, description="false: this content was registered already, as this version"
    )
    evals: list[EvalPublic] = []


class ModelSummary(BaseModel):
    tenant: str
    name: str
    versions: int
    latest: int
    uri: str = Field(description="the latest version's")
    created_at: float = Field(description="when the latest version was registered")


class ModelHistory(BaseModel):
    """A model's versions, oldest first, each with its base and its eval results; `bases`
    are the registered versions of other models that some version came from."""

    name: str
    versions: list[ModelVersionPublic]
    bases: list[ModelVersionPublic]
