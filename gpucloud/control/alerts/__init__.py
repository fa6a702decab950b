"""What a Prometheus and a Grafana need to watch a gpucloud cluster: the alert rules and
dashboards shipped in the package (`gpucloud alerts rules`, `gpucloud alerts dashboards`),
and the store-backed gauges those rules read (alerts/metrics.py)."""

from __future__ import annotations

from importlib import resources

RULES = "rules.yml"


def rules_text() -> str:
    """The Prometheus rule file (YAML), as shipped."""
    return resources.files(__package__).joinpath(RULES).read_text()


def dashboards() -> dict[str, str]:
    """Grafana dashboards as JSON, by file name."""
    folder = resources.files(__package__).joinpath("dashboards")
    return {f.name: f.read_text() for f in sorted(folder.iterdir(), key=lambda f: f.name)
            if f.name.endswith(".json")}  # fmt: skip
