from __future__ import annotations

from pathlib import Path

import pytest

from gpucloud.errors import ConfigError, NotFoundError
from gpucloud.scheduler.sim import Trace, TraceJob, load_trace, synthetic_trace, write_trace
from gpucloud.scheduler.sim.cluster import describe, parse_cluster

TRACES = Path("/work/shared/traces")
SKIPPED_PENDING = 861  # Pending pods that ask for a GPU (36 more ask for none)


def test_real_traces_are_recognised_from_their_columns() -> None:
    itp = load_trace(TRACES / "microsoft_itp_2021/raw/cluster03.csv", limit=50)
    assert itp.format == "itp" and len(itp.jobs) == 50 and itp.jobs[0].submit_time == 0
    times = [j.submit_time for j in itp.jobs]
    assert times == sorted(times)
    philly = load_trace(TRACES / "microsoft_philly_2017/philly_jobs_pollux.csv", vc="ee9e8c")
    assert philly.format == "philly" and len(philly.jobs) == 1511
    assert philly.tenants == ["ee9e8c"] and max(j.num_gpus for j in philly.jobs) == 128
    tir = load_trace(TRACES / "tiresias/60_job.csv")
    assert tir.format == "tiresias" and len(tir.jobs) == 60


def test_alibaba_pods_keep_fractions_and_count_what_is_skipped() -> None:
    ali = load_trace(TRACES / "alibaba_openb_2023/openb_pod_list_default.csv")
    assert ali.format == "alibaba"
    assert dict(ali.skipped) == {
        "no GPU requested": 1088,
        "never scheduled in the original cluster": SKIPPED_PENDING,
    }
    assert len(ali.jobs) + 1088 + SKIPPED_PENDING == 8152
    assert any(j.gpu_milli < 1000 for j in ali.jobs)
    assert all(j.gpu_milli == 1000 for j in ali.jobs if j.num_gpus > 1)
    first = ali.jobs[0]  # openb-pod-0000,12000,16384,1,1000,...
    assert (first.id, first.cpu_milli, first.memory_mib) == ("openb-pod-0000", 12000, 16384)


def test_unknown_vc_names_the_closest(tmp_path: Path) -> None:
    with pytest.raises(NotFoundError, match="did you mean ee9e8c"):
        load_trace(TRACES / "microsoft_philly_2017/philly_jobs_pollux.csv", vc="ee9e8")


def test_bad_traces_name_the_row_or_the_missing_columns(tmp_path: Path) -> None:
    p = tmp_path / "t.csv"
    p.write_text("job_id,submission_time,num_gpu\n1,0,2\n")
    with pytest.raises(ConfigError, match="closest format is itp, which also needs duration"):
        load_trace(p)
    p.write_text("job_id,submission_time,duration,num_gpu\n1,0,5,2\n2,3,-4,1\n")
    with pytest.raises(ConfigError, match=r"row 3: duration -4 must be a number >= 0"):
        load_trace(p)
    p.write_text("job_id,submission_time,duration,num_gpu\n1,0,5,two\n")
    with pytest.raises(ConfigError, match=r"row 2: num_gpu 'two' is not a number"):
        load_trace(p)


def test_synthetic_trace_round_trips_through_the_gpucloud_format(tmp_path: Path) -> None:
    tr = synthetic_trace(200, capacity=64, load=0.8, seed=3)
    assert tr.jobs == synthetic_trace(200, capacity=64, load=0.8, seed=3).jobs
    write_trace(tr, tmp_path / "s.csv")
    back = load_trace(tmp_path / "s.csv")
    assert back.format == "gpucloud" and len(back.jobs) == 200
    assert back.jobs[5].num_gpus == tr.jobs[5].num_gpus
    assert back.jobs[5].duration == pytest.approx(tr.jobs[5].duration, abs=1e-3)
    host = Trace("h", "gpucloud", [TraceJob("j", 0.0, 5.0, 2, cpu_milli=8000, memory_mib=4096)])
    write_trace(host, tmp_path / "h.csv")
    assert load_trace(tmp_path / "h.csv").jobs == host.jobs


def test_cluster_specs() -> None:
    nodes = parse_cluster("2x8/4:H100,1x8:910B")
    assert describe(nodes) == "2x8 H100-SXM + 1x8 Ascend-910B"
    assert nodes[0].domain_size == 4 and nodes[2].gpu_type == "Ascend-910B"
    ali = parse_cluster(str(TRACES / "alibaba_openb_2023/openb_node_list_gpu_node.csv"), "A10")
    assert len(ali) == 1213 and sum(n.num_gpus for n in ali) == 6212
    with pytest.raises(ConfigError, match="write NODESxGPUS"):
        parse_cluster("16by8")
