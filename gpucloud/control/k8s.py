"""Kubernetes manifests that run gpucloud on a cluster: the control plane (Deployment,
Service, a PersistentVolumeClaim for its home) and a KubeRay `RayCluster` whose GPU worker
groups are the nodes the control plane's Ray executor schedules on.

Pure functions returning plain dicts (the API objects as `kubectl apply` reads them); the
CLI (`gpucloud k8s render`) only parses flags and prints. Nothing here talks to a cluster.
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass

from gpucloud import hardware
from gpucloud.errors import NotFoundError, UserError

RAY_VERSION = "2.60.0"  # the version the `ray` extra pins: the head, workers and driver agree
RAY_GCS_PORT = 6379  # the head's GCS, on the head service KubeRay makes
CONTROL_PORT = 8470  # `gpucloud up`'s default
HOME = "/var/lib/gpucloud"  # GPUCLOUD_HOME in the control plane's container: the volume

# The extended resource each vendor's Kubernetes device plugin advertises for a whole device.
DEVICE_RESOURCE = {
    "nvidia": "nvidia.com/gpu",
    "amd": "amd.com/gpu",
    "huawei": "huawei.com/Ascend910",
    "hygon": "hygon.com/dcu",
    "cambricon": "cambricon.com/mlu",
}

# Object names (a Service's must start with a letter) and namespaces; the name is short
# enough that KubeRay's derived names (`NAME-ray-head-svc`, pod names) stay under 63.
_NAME = re.compile(r"[a-z]([-a-z0-9]{0,38}[a-z0-9])?")
_NAMESPACE = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
_SECRET_KEY = re.compile(r"[-._a-zA-Z0-9]+")
_STORAGE = re.compile(r"[0-9]+(\.[0-9]+)?([KMGTPE]i?)?")  # a Kubernetes quantity of bytes


@dataclass(frozen=True, slots=True)
class WorkerGroup:
    """`replicas` Ray worker pods of `gpus` accelerators of one catalog type each."""

    gpu_type: str  # a catalog name (hardware.get resolves aliases such as A100)
    replicas: int
    gpus: int

    @classmethod
    def of(cls, gpu_type: str, replicas: int, gpus: int | None = None) -> WorkerGroup:
        """A group with the catalog's name for `gpu_type`; `gpus` defaults to the type's usual
        server size. Raises UserError for an unknown type or a count below 1."""
        acc = _accelerator(gpu_type)
        gpus = acc.gpus_per_node if gpus is None else gpus
        if replicas < 1 or gpus < 1:
            raise UserError(
                f"worker group {acc.name}: replicas ({replicas}) and GPUs per worker ({gpus}) "
                "must be at least 1"
            )
        return cls(acc.name, replicas, gpus)

    @classmethod
    def parse(cls, text: str) -> WorkerGroup:
        """`TYPE:REPLICAS:GPUS`, e.g. `A100:2:8` (GPUS may be left out: the type's usual)."""
        parts = text.split(":")
        counts = parts[1:]
        if not 2 <= len(parts) <= 3 or not all(c.isdigit() for c in counts):
            raise UserError(
                f"worker group {text!r} is not TYPE:REPLICAS:GPUS (e.g. A100:2:8, or A100:2 "
                "for the type's usual GPUs per server)"
            )
        return cls.of(parts[0], *(int(c) for c in counts))

    @property
    def name(self) -> str:
        """The KubeRay group name: DNS-safe, unique per (type, GPUs per worker)."""
        return f"{self.gpu_type.lower()}-x{self.gpus}"

    @property
    def ray_resources(self) -> dict[str, int]:
        """The custom Ray resource that tells the Ray executor the node's accelerators."""
        return {f"accel_{self.gpu_type}": self.gpus}

    @property
    def device_resource(self) -> str:
        return DEVICE_RESOURCE[hardware.get(self.gpu_type).vendor]


@dataclass(frozen=True, slots=True)
class Spec:
    """What to render. `db_secret` is `NAME` or `NAME:KEY` (key default `url`) of a Secret
    holding the PostgreSQL URL; without it the store is SQLite on the home volume."""

    image: str
    groups: tuple[WorkerGroup, ...]
    name: str = "gpucloud"
    namespace: str = "default"
    db_secret: str | None = None
    storage: str = "10Gi"
    storage_class: str | None = None

    def __post_init__(self) -> None:
        _check_name("name", self.name, _NAME, "a letter", 40)
        _check_name("namespace", self.namespace, _NAMESPACE, "a letter or digit", 63)
        if not _STORAGE.fullmatch(self.storage):
            raise UserError(
                f"storage {self.storage!r} is not a size: a number with an optional unit "
                "Ki, Mi, Gi, Ti (or K, M, G, T), e.g. 10Gi"
            )
        if not self.image.strip():
            raise UserError("image must not be empty: give the image that has gpucloud and ray")
        if not self.groups:
            raise UserError("no worker group: give --gpu-type TYPE or --worker-group T:N:G")
        seen = [g.name for g in self.groups]
        if dups := sorted({n for n in seen if seen.count(n) > 1}):
            raise UserError(f"worker group {dups[0]} given twice: give it once with more replicas")
        if self.db_secret is not None:
            self.secret_ref()  # checks the form

    @property
    def ray_cluster(self) -> str:
        return f"{self.name}-ray"

    @property
    def ray_address(self) -> str:
        """The GCS address of the head service KubeRay makes (`<cluster>-head-svc`)."""
        return f"{self.ray_cluster}-head-svc:{RAY_GCS_PORT}"

    def secret_ref(self) -> dict[str, str]:
        """The Secret key selector of `db_secret`. Raises UserError for a malformed one."""
        name, _, key = (self.db_secret or "").partition(":")
        key = key or "url"
        if not _NAMESPACE.fullmatch(name) or not _SECRET_KEY.fullmatch(key):
            raise UserError(
                f"--db-secret {self.db_secret!r} is not NAME or NAME:KEY (a Secret's name, "
                "lowercase letters, digits and '-'; a key of letters, digits, '-', '_', '.')"
            )
        return {"name": name, "key": key}


def render(spec: Spec) -> list[dict]:
    """Every object, in the order `kubectl apply` should create them."""
    return [home_claim(spec), control_deployment(spec), control_service(spec), ray_cluster(spec)]


def home_claim(spec: Spec) -> dict:
    """The control plane's home: its SQLite store (unless --db-secret), logs, credentials
    and the tenants' areas. ReadWriteOnce: one control plane uses it at a time."""
    claim_spec: dict = {
        "accessModes": ["ReadWriteOnce"],
        "resources": {"requests": {"storage": spec.storage}},
    }
    if spec.storage_class:
        claim_spec["storageClassName"] = spec.storage_class
    return _object("v1", "PersistentVolumeClaim", f"{spec.name}-home", spec, claim_spec)


def control_deployment(spec: Spec) -> dict:
    labels = _labels(spec, "control-plane")
    pod = {
        "containers": [_control_container(spec)],
        "volumes": [{"name": "home", "persistentVolumeClaim": {"claimName": f"{spec.name}-home"}}],
    }
    body = {
        "replicas": 1,
        # Recreate: the old pod lets go of the volume (and its claim on the home) first.
        "strategy": {"type": "Recreate"},
        "selector": {"matchLabels": labels},
        "template": {"metadata": {"labels": labels}, "spec": pod},
    }
    return _object("apps/v1", "Deployment", f"{spec.name}-control", spec, body)


def control_service(spec: Spec) -> dict:
    """The REST API, the OpenAI gateway and the dashboard, inside the cluster."""
    body = {
        "type": "ClusterIP",
        "selector": _labels(spec, "control-plane"),
        "ports": [{"name": "http", "port": CONTROL_PORT, "targetPort": "http"}],
    }
    return _object("v1", "Service", spec.name, spec, body)


def ray_cluster(spec: Spec) -> dict:
    """A KubeRay RayCluster (ray.io/v1): a head that runs no workloads (num-cpus 0) and one
    worker group per GPU type and size, each node declaring its accelerators."""
    ports = {"gcs": RAY_GCS_PORT, "dashboard": 8265}
    container = {
        "name": "ray-head",
        "image": spec.image,
        "ports": [{"name": name, "containerPort": port} for name, port in ports.items()],
    }
    head = {
        "rayStartParams": {"dashboard-host": "0.0.0.0", "num-cpus": "0"},
        "template": {"spec": {"containers": [container]}},
    }
    body = {
        "rayVersion": RAY_VERSION,
        "headGroupSpec": head,
        "workerGroupSpecs": [_worker_group(spec, g) for g in spec.groups],
    }
    return _object("ray.io/v1", "RayCluster", spec.ray_cluster, spec, body)


def _worker_group(spec: Spec, group: WorkerGroup) -> dict:
    container = {
        "name": "ray-worker",
        "image": spec.image,
        # A quantity as the API server writes it back (a string): what is applied is read.
        "resources": {"limits": {group.device_resource: str(group.gpus)}},
        "volumeMounts": [{"name": "shm", "mountPath": "/dev/shm"}],
    }
    return {
        "groupName": group.name,
        "replicas": group.replicas,
        "minReplicas": group.replicas,
        "maxReplicas": group.replicas,
        # Ray node labels (KubeRay >= 1.5 passes them to `ray start --labels`; older versions
        # drop the field): the Ray executor keeps a gang's bundles on role=worker nodes.
        "labels": {"role": "worker"},
        # Quoted for the shell line KubeRay builds (`ray start --resources='{...}'`).
        "rayStartParams": {"resources": f"'{json.dumps(group.ray_resources)}'"},
        "template": {
            "spec": {
                "containers": [container],
                # torch's collectives and data loaders use /dev/shm: a container's is 64 MiB.
                "volumes": [{"name": "shm", "emptyDir": {"medium": "Memory"}}],
            },
        },
    }


def _control_container(spec: Spec) -> dict:
    """The control plane is a Ray driver: its pod joins the Ray cluster as a node without
    CPUs or accelerators (nothing is scheduled there), then runs `gpucloud up` on it."""
    join = ["ray", "start", f"--address={spec.ray_address}", "--num-cpus=0", "--num-gpus=0"]
    up = ["gpucloud", "up", "--host", "0.0.0.0", "--port", str(CONTROL_PORT)]
    up += ["--executor", "ray", "--ray-address", spec.ray_address]
    env = [{"name": "GPUCLOUD_HOME", "value": HOME}]
    db = ""
    if spec.db_secret is not None:
        # The URL stays in the Secret: the shell reads it from the container's env.
        env.append({"name": "GPUCLOUD_DB_URL", "valueFrom": {"secretKeyRef": spec.secret_ref()}})
        db = ' --db "$GPUCLOUD_DB_URL"'
    return {
        "name": "control",
        "image": spec.image,
        "command": ["sh", "-c", f"{shlex.join(join)} && exec {shlex.join(up)}{db}"],
        "env": env,
        "ports": [{"name": "http", "containerPort": CONTROL_PORT}],
        "readinessProbe": {"httpGet": {"path": "/healthz", "port": "http"}},
        "volumeMounts": [{"name": "home", "mountPath": HOME}],
    }


def _object(api_version: str, kind: str, name: str, spec: Spec, body: dict) -> dict:
    return {
        "apiVersion": api_version,
        "kind": kind,
        "metadata": {"name": name, "namespace": spec.namespace, "labels": _labels(spec)},
        "spec": body,
    }


def _labels(spec: Spec, component: str | None = None) -> dict[str, str]:
    labels = {"app.kubernetes.io/name": "gpucloud", "app.kubernetes.io/instance": spec.name}
    if component:
        labels["app.kubernetes.io/component"] = component
    return labels


def _accelerator(name: str) -> hardware.Accelerator:
    try:
        return hardware.get(name)
    except NotFoundError as e:  # name every type, not only the closest ones
        unknown = str(e).partition(": choose one of")[0]
        raise NotFoundError(f"{unknown} (known: {', '.join(hardware.names())})") from None


def _check_name(what: str, value: str, pattern: re.Pattern, first: str, most: int) -> None:
    if not pattern.fullmatch(value):
        raise UserError(
            f"{what} {value!r} is not allowed: lowercase letters, digits and '-', starting "
            f"with {first}, ending with a letter or digit, at most {most} characters"
        )
