"""`gpucloud k8s render` through the real entry point: every core object deserializes into
the kubernetes client's model and serializes back unchanged (so no field is misspelled or
silently dropped), the RayCluster has the KubeRay v1 fields the operator reads, and bad
input is one line with exit code 2."""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from pathlib import Path

import jsonschema
import pytest
import yaml
from cli_run import run_cli
from kubernetes import client

from gpucloud import hardware
from gpucloud.control import k8s

ROOT = Path(__file__).resolve().parents[2]
MODELS = {
    "PersistentVolumeClaim": "V1PersistentVolumeClaim",
    "Deployment": "V1Deployment",
    "Service": "V1Service",
}

# The part of KubeRay's RayCluster v1 CRD (ray-operator/config/crd/bases/
# ray.io_rayclusters.yaml) that the rendered object uses. Each level lists every property the
# CRD declares there: the API server prunes unknown fields without a word, so a misspelled
# one must fail here. Pod templates are checked against the kubernetes models instead.
_INT32 = {"type": "integer", "minimum": 0, "maximum": 2**31 - 1}
_STRINGS = {"type": "object", "additionalProperties": {"type": "string"}}
_TEMPLATE = {"type": "object", "required": ["spec"]}


def _level(required: list[str], unused: str, **used: dict) -> dict:
    """One object level of the CRD: the fields we fill typed, the others (`unused`, space
    separated) allowed as anything, every other name refused."""
    properties = dict.fromkeys(unused.split(), {}) | used
    return {"type": "object", "required": required, "properties": properties,
            "additionalProperties": False}  # fmt: skip


RAY_CLUSTER_V1 = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "ray.io/v1"},
        "kind": {"const": "RayCluster"},
        "spec": _level(
            ["headGroupSpec"],
            "authOptions autoscalerOptions enableInTreeAutoscaling gcsFaultToleranceOptions "
            "headServiceAnnotations historyServerOptions managedBy networkPolicy suspend "
            "tlsOptions upgradeStrategy",
            rayVersion={"type": "string"},
            headGroupSpec=_level(
                ["template"],
                "enableIngress headService ingressOptions labels resources serviceType",
                rayStartParams=_STRINGS,
                template=_TEMPLATE,
            ),
            workerGroupSpecs={
                "type": "array",
                "items": _level(
                    ["groupName", "maxReplicas", "minReplicas", "template"],
                    "idleTimeoutSeconds numOfHosts priority resources scaleStrategy suspend",
                    groupName={"type": "string", "pattern": "^[a-z0-9-]{1,63}$"},
                    replicas=_INT32,
                    minReplicas=_INT32,
                    maxReplicas=_INT32,
                    labels=_STRINGS,
                    rayStartParams=_STRINGS,
                    template=_TEMPLATE,
                ),
            },
        ),
    },
}


@pytest.fixture
def run(capsys, monkeypatch):
    return lambda *args: run_cli(capsys, monkeypatch, "k8s", "render", *args)


@pytest.fixture
def render(run):
    """The objects `gpucloud k8s render ARGS` prints as YAML, checked against its JSON."""

    def invoke(*args: str) -> dict[str, dict]:
        as_yaml = run(*args)
        assert as_yaml.returncode == 0, as_yaml.stderr
        objects = list(yaml.safe_load_all(as_yaml.stdout))
        as_json = json.loads(run(*args, "--format", "json").stdout)
        assert as_json == {"apiVersion": "v1", "kind": "List", "items": objects}
        return {o["kind"]: o for o in objects}

    return invoke


def _round_trip(obj: dict, model: str) -> dict:
    """`obj` read as the client reads an API response into `model`, then written back."""
    api = client.ApiClient()
    return api.sanitize_for_serialization(
        api.deserialize(json.dumps(obj), model, "application/json")
    )


SPECS = [
    ["--gpu-type", "A100", "--workers", "2", "--gpus-per-worker", "8"],
    ["--worker-group", "H100:2:8", "--worker-group", "MI300X:1", "--worker-group", "910b:3:4",
     "--namespace", "ml", "--name", "gc", "--image", "registry.example/gpucloud:1",
     "--db-secret", "gpucloud-db:dsn", "--storage", "50Gi", "--storage-class", "fast"],
]  # fmt: skip


@pytest.mark.parametrize("args", SPECS, ids=["one-group", "three-vendors"])
def test_every_object_round_trips_through_its_kubernetes_model(render, args):
    objects = render(*args)
    assert list(objects) == [*MODELS, "RayCluster"]
    for kind, model in MODELS.items():
        assert _round_trip(objects[kind], model) == objects[kind]
    ray = objects["RayCluster"]
    jsonschema.validate(ray, RAY_CLUSTER_V1)
    groups = [ray["spec"]["headGroupSpec"], *ray["spec"]["workerGroupSpecs"]]
    for group in groups:
        assert _round_trip(group["template"], "V1PodTemplateSpec") == group["template"]


def test_the_round_trip_catches_a_misspelled_field(render):
    deployment = render("--gpu-type", "L4")["Deployment"]
    deployment["spec"]["template"]["spec"]["containers"][0]["comand"] = ["gpucloud"]
    assert _round_trip(deployment, "V1Deployment") != deployment
    ray = render("--gpu-type", "L4")["RayCluster"]
    ray["spec"]["workerGroupSpecs"][0]["replica"] = 2
    with pytest.raises(jsonschema.ValidationError, match="'replica' was unexpected"):
        jsonschema.validate(ray, RAY_CLUSTER_V1)


def test_workers_declare_their_accelerators_to_ray_and_to_kubernetes(render):
    ray = render("--worker-group", "H100:2:8", "--worker-group", "MI300X:1:4")["RayCluster"]
    head, (h100, mi300x) = ray["spec"]["headGroupSpec"], ray["spec"]["workerGroupSpecs"]
    assert head["rayStartParams"]["num-cpus"] == "0"  # workloads go to the GPU workers only
    for group, name, accel, device in (
        (h100, "h100-sxm-x8", {"accel_H100-SXM": 8}, {"nvidia.com/gpu": "8"}),
        (mi300x, "mi300x-x4", {"accel_MI300X": 4}, {"amd.com/gpu": "4"}),
    ):
        assert group["groupName"] == name
        assert group["labels"] == {"role": "worker"}  # where the executor places gang bundles
        # KubeRay pastes the value into `ray start --resources=...` in a shell: quoted JSON.
        quoted = group["rayStartParams"]["resources"]
        assert quoted[0] == quoted[-1] == "'" and json.loads(quoted[1:-1]) == accel
        (container,) = group["template"]["spec"]["containers"]
        assert container["resources"] == {"limits": device}
    assert (h100["replicas"], h100["minReplicas"], h100["maxReplicas"]) == (2, 2, 2)
    assert mi300x["replicas"] == 1


@pytest.mark.parametrize("acc", hardware.all_accelerators(), ids=lambda a: a.name)
def test_every_catalog_type_gets_its_vendors_device_resource(acc):
    group = k8s.WorkerGroup.of(acc.name, 1)
    assert group.gpus == acc.gpus_per_node
    assert group.device_resource == k8s.DEVICE_RESOURCE[acc.vendor]


def test_the_control_plane_runs_on_the_ray_head_service_kuberay_makes(render):
    objects = render("--gpu-type", "L4", "--name", "gc")
    ray, deployment, service = objects["RayCluster"], objects["Deployment"], objects["Service"]
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    head_service = f"{ray['metadata']['name']}-head-svc"  # KubeRay's name for it
    # a Ray driver on a node of its own (no CPUs, no accelerators: nothing runs there)
    assert container["command"] == [
        "sh", "-c",
        f"ray start --address={head_service}:6379 --num-cpus=0 --num-gpus=0 && exec gpucloud up"
        f" --host 0.0.0.0 --port 8470 --executor ray --ray-address {head_service}:6379",
    ]  # fmt: skip
    assert {"name": "gcs", "containerPort": 6379} in (
        ray["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["ports"]
    )
    assert service["spec"]["selector"] == deployment["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["ports"][0]["targetPort"] == container["ports"][0]["name"]
    claim = objects["PersistentVolumeClaim"]["metadata"]["name"]
    assert pod["volumes"] == [{"name": "home", "persistentVolumeClaim": {"claimName": claim}}]
    assert {"name": "GPUCLOUD_HOME", "value": container["volumeMounts"][0]["mountPath"]} in (
        container["env"]
    )


def test_the_database_url_comes_from_a_secret_and_is_never_inline(render, run):
    container = render("--gpu-type", "L4", "--db-secret", "pg")["Deployment"]["spec"]["template"][
        "spec"
    ]["containers"][0]
    assert {
        "name": "GPUCLOUD_DB_URL",
        "valueFrom": {"secretKeyRef": {"name": "pg", "key": "url"}},
    } in container["env"]
    assert container["command"][-1].endswith(' --db "$GPUCLOUD_DB_URL"')  # read by the shell
    plain = run("--gpu-type", "L4").stdout
    assert "--db" not in plain and "GPUCLOUD_DB_URL" not in plain  # SQLite on the volume
    refused = run("--gpu-type", "L4", "--db-secret", "postgresql://u:secret@db/gpucloud")
    assert refused.returncode == 2 and "secret@db" not in refused.stdout


@pytest.mark.parametrize("fmt", ["yaml", "json"])
def test_output_dir_gets_one_file_per_object(run, render, tmp_path, fmt):
    args = ("--worker-group", "A10:2:4", "--namespace", "ml")
    out = tmp_path / "out"
    result = run(*args, "-o", str(out), "--format", fmt)
    assert result.returncode == 0, result.stderr
    written = [
        out / f"{name}.{fmt}"
        for name in ("persistentvolumeclaim-gpucloud-home", "deployment-gpucloud-control",
                     "service-gpucloud", "raycluster-gpucloud-ray")
    ]  # fmt: skip
    assert result.stdout.splitlines() == [f"wrote {path}" for path in written]
    assert sorted(out.iterdir()) == sorted(written)
    parsed = [yaml.safe_load(path.read_text()) for path in written]  # JSON is YAML too
    assert parsed == list(render(*args).values())


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--gpu-type", "A1000"], "unknown GPU type 'A1000': did you mean A10, A100-80GB, "
         "A100-40GB? (known: A10, L4, L40S, A100-40GB, "),
        (["--worker-group", "TPU:1:8"], "unknown GPU type 'TPU'"),
        (["--worker-group", "A100:two:8"],  # as typed, not rich's emoji for :two:
         "worker group 'A100:two:8' is not TYPE:REPLICAS:GPUS"),
        (["--worker-group", "A100"], "worker group 'A100' is not TYPE:REPLICAS:GPUS"),
        (["--gpu-type", "L4", "--workers", "0"], "worker group L4: replicas (0) and GPUs"),
        (["--worker-group", "L4:1:0"], "worker group L4: replicas (1) and GPUs per "
         "worker (0) must be at least 1"),
        (["--worker-group", "A100:1:8", "--worker-group", "a100-80gb:2:8"],
         "worker group a100-80gb-x8 given twice"),
        (["--workers", "2"], "--workers and --gpus-per-worker size the --gpu-type group"),
        ([], "no worker group: give --gpu-type TYPE or --worker-group"),
        (["--gpu-type", "L4", "--name", "GPU_cloud"], "name 'GPU_cloud' is not allowed"),
        (["--gpu-type", "L4", "--name", "9lives"], "name '9lives' is not allowed"),
        (["--gpu-type", "L4", "--name", "[bold]x"], "name '[bold]x' is not allowed"),  # no markup
        (["--gpu-type", "L4", "--namespace", "-ml"], "namespace '-ml' is not allowed"),
        (["--gpu-type", "L4", "--image", " "], "image must not be empty"),
        (["--gpu-type", "L4", "--storage", "10GB"], "storage '10GB' is not a size"),
        (["--gpu-type", "L4", "--db-secret", "pg:a/b"], "--db-secret 'pg:a/b' is not NAME"),
    ],
)  # fmt: skip
def test_bad_input_is_one_line_and_exit_code_2(run, args, message):
    result = run(*args)
    assert result.returncode == 2
    assert result.stdout == ""
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert result.stderr.startswith(f"error: {message}")


def test_ray_version_is_the_one_the_ray_extra_pins():
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert pyproject["project"]["optional-dependencies"]["ray"] == [f"ray=={k8s.RAY_VERSION}"]


def test_rendering_imports_neither_torch_nor_ray_nor_kubernetes():
    code = (
        "import sys\nfrom gpucloud.cli import main\n"
        "sys.argv = ['gpucloud', 'k8s', 'render', '--gpu-type', 'H100']\n"
        "try:\n    main.app()\nexcept SystemExit as e:\n    assert not e.code, e.code\n"
        "heavy = {'torch', 'ray', 'kubernetes'} & set(sys.modules)\n"
        "assert not heavy, heavy\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "kind: RayCluster" in result.stdout
