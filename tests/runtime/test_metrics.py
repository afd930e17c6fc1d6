"""The job's Prometheus metrics (runtime/control/metrics.py, `trainmover run --metrics HOST:PORT`): the figures of
the events, in-process; then a real job, a worker SIGKILLed, scraped by a real Prometheus server (Debian's
`prometheus`) and queried over its HTTP API: every documented metric is there and agrees with the events file."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from runtime.config import metrics_address
from runtime.control.metrics import CAUSES, PHASES, JobMetrics, cause_label
from runtime.wire.event_records import (
    Coverage,
    GenerationStarted,
    HostJoined,
    HostLost,
    JobFinished,
    MemberFailed,
    Recovered,
    StandbyLost,
    StandbySpawned,
    UntrustedValue,
)
from tests.runtime.test_control import running
from tests.servers import stop

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "metrics.md"
INSTALL = "install Debian's prometheus (`apt-get install prometheus`), or put a prometheus binary on PATH"


def _samples(metrics: JobMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = generate_latest(metrics.registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def _recovered(recovery_s: float, cause: str, **parts: float) -> Recovered:
    times = {"detect_s": 0.1, "reconfigure_s": 0.2, "handoff_s": 0.3, "replay_s": 0.4, **parts}
    return Recovered(time=1.0, generation=1, step=5, ranks=[{"rank": 1, "old": "w1", "new": "s0"}], causes=[cause],
                     recovery_s=recovery_s, handoff_bytes=1000, sources=[0], **times)


def test_the_events_become_counters_summaries_and_gauges() -> None:
    m = JobMetrics("llm-7b")
    for event in (
        GenerationStarted(time=0.0, generation=0, reason="start", world_size=2, members=[]),
        Coverage(time=0.0, covered=True, warm=1, warming=1, target=2),
        StandbySpawned(time=0.0, proc="s0", reason="pool"),
        MemberFailed(time=1.0, generation=0, rank=1, proc="w1", pid=9, cause="exit code -9 (SIGKILL)", step=5,
                     failure_at=1.0, declared_at=1.1, detect_s=0.1),
        _recovered(1.25, "exit code -9 (SIGKILL)"),
        _recovered(2.5, "hung: no heartbeat for 2.0 s", warmup_penalty_s=0.05),
        StandbyLost(time=2.0, proc="s1", pid=10, cause="exit", was_ready=True, failure_at=2.0, declared_at=2.0,
                    detect_s=0.0),
        HostJoined(time=2.0, host="h1", incarnation="a", slots=2, address="10.0.0.1"),
        HostJoined(time=2.0, host="h2", incarnation="b", slots=2, address="10.0.0.2"),
        HostLost(time=3.0, host="h1", incarnation="a", cause="silent", procs=[], failure_at=3.0),
        UntrustedValue(time=3.0, key="k", key_kind="heartbeat", reason="bad seal"),
    ):
        m.observe(event)
    m.committed(7)
    got = _samples(m)

    assert got[("trainmover_recoveries_total", (("cause", "exit"),))] == 1
    assert got[("trainmover_recoveries_total", (("cause", "hang"),))] == 1
    assert got[("trainmover_recovery_seconds_count", ())] == 2
    assert got[("trainmover_recovery_seconds_sum", ())] == pytest.approx(3.75, abs=1e-12)
    assert got[("trainmover_recovery_phase_seconds_sum", (("phase", "replay"),))] == pytest.approx(0.8)
    assert got[("trainmover_recovery_phase_seconds_sum", (("phase", "warmup_penalty"),))] == pytest.approx(0.05)
    assert got[("trainmover_handoff_bytes_total", ())] == 2000
    assert got[("trainmover_member_failures_total", ())] == 1
    assert got[("trainmover_generation", ())] == 0 and got[("trainmover_workers", ())] == 2
    assert got[("trainmover_standbys", (("state", "warm"),))] == 1
    assert got[("trainmover_standby_target", ())] == 2 and got[("trainmover_covered", ())] == 1
    assert got[("trainmover_standby_events_total", (("event", "lost"),))] == 1
    assert got[("trainmover_hosts", ())] == 1
    assert got[("trainmover_host_events_total", (("event", "joined"),))] == 2
    assert got[("trainmover_refused_total", (("kind", "untrusted"),))] == 1
    assert got[("trainmover_committed_step", ())] == 7
    assert got[("trainmover_job_running", ())] == 1 and got[("trainmover_job_info", (("job_id", "llm-7b"),))] == 1

    m.observe(JobFinished(time=4.0, wall_s=4.0, generation=2, digests={}, step=20, final_digest=None))
    assert _samples(m)[("trainmover_job_running", ())] == 0


def test_every_metric_is_documented_and_every_label_is_bounded() -> None:
    doc = DOC.read_text()
    families = {f.name for f in text_string_to_metric_families(generate_latest(JobMetrics("j").registry).decode())}
    undocumented = sorted(n for n in families if f"`{n}" not in doc)
    assert not undocumented, f"document them in {DOC}: {undocumented}"
    assert {cause_label(c) for c in ("exit code -9", "hung", "host h1 lost", "spot notice", "planned_move: x",
                                     "weird")} <= set(CAUSES)
    assert len(PHASES) == 5
    assert metrics_address("127.0.0.1:0") == ("127.0.0.1", 0) and metrics_address("[::1]:9464") == ("::1", 9464)
    for bad in ("9464", ":9464", "host:port", "h:70000"):
        with pytest.raises(ValueError, match="HOST:PORT"):
            metrics_address(bad)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def prometheus(tmp_path: Path) -> Iterator[tuple[str, int]]:
    """A Prometheus server scraping 127.0.0.1:PORT every second; (its URL, the port it scrapes)."""
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.fail(f"the prometheus server is not installed: {INSTALL}")
    target, web = _free_port(), _free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text(json.dumps({  # YAML is a superset of JSON
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s"},
        "scrape_configs": [{"job_name": "trainmover", "static_configs": [{"targets": [f"127.0.0.1:{target}"]}]}],
    }))
    log = open(tmp_path / "prometheus.log", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen([binary, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                             f"--web.listen-address=127.0.0.1:{web}", "--log.level=warn"],
                            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{web}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"{url}/-/ready", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert proc.poll() is None, (tmp_path / "prometheus.log").read_text()[-2000:]
            assert time.monotonic() < deadline, "prometheus was not ready within 60 s"
            time.sleep(0.1)
        yield url, target
    finally:
        stop(proc, grace_s=20)
        log.close()


def _query(url: str, promql: str) -> list[dict[str, Any]]:
    with urllib.request.urlopen(f"{url}/api/v1/query?{urllib.parse.urlencode({'query': promql})}", timeout=5) as r:
        body = json.loads(r.read())
    assert body["status"] == "success", body
    return list(body["data"]["result"])


def _value(url: str, promql: str) -> float | None:
    result = _query(url, promql)
    return float(result[0]["value"][1]) if result else None


def _wait_value(url: str, promql: str, ok: Any, timeout_s: float = 60.0) -> float:
    deadline = time.monotonic() + timeout_s
    while True:
        value = _value(url, promql)
        if value is not None and ok(value):
            return value
        assert time.monotonic() < deadline, f"{promql} = {value} after {timeout_s} s"
        time.sleep(0.25)


def test_prometheus_scrapes_a_running_job_and_agrees_with_its_events(
    prometheus: tuple[str, int], tmp_path: Path
) -> None:
    url, port = prometheus
    with running(tmp_path, "--standby", "1", "--metrics", f"127.0.0.1:{port}", "--faults",
                 "kill:rank=1,step=5,phase=exchange", pace_ms=25) as job:
        (recovered,) = job.wait_for("recovered")
        # Prometheus has scraped the job after its recovery: the recovery is counted, the step moves on.
        _wait_value(url, 'sum(trainmover_recoveries_total{job="trainmover"})', lambda v: v == 1)
        step = _wait_value(url, "trainmover_committed_step", lambda v: v > recovered["step"])
        # Everything read while the job runs (once its endpoint is gone, Prometheus marks its series stale).
        lost = _value(url, "trainmover_recovery_seconds_sum")
        parts = {p: _value(url, f'trainmover_recovery_phase_seconds_sum{{phase="{p}"}}') for p in PHASES}
        families = {r["metric"]["__name__"] for r in _query(url, '{job="trainmover",__name__=~"trainmover_.*"}')}
        by_cause = {r["metric"]["cause"]: float(r["value"][1]) for r in _query(url, "trainmover_recoveries_total")}
        counts = {name: _value(url, name) for name in (
            "trainmover_member_failures_total", "trainmover_handoff_bytes_total", "trainmover_generation",
            "trainmover_workers", "trainmover_recovery_seconds_count", "trainmover_job_running")}
        generations = max(e["generation"] for e in job.events("generation"))
        failures = len(job.events("member_failed"))
        job.full_speed()
        job.finish()

    assert lost == pytest.approx(recovered["recovery_s"], abs=1e-3)
    assert all(parts[p] == pytest.approx(recovered[f"{p}_s"], abs=1e-3) for p in PHASES), (parts, recovered)
    assert by_cause == {c: (1.0 if c == "exit" else 0.0) for c in CAUSES}, (by_cause, recovered["causes"])
    assert failures == 1
    assert counts == {"trainmover_member_failures_total": 1, "trainmover_handoff_bytes_total":
                      recovered["handoff_bytes"], "trainmover_generation": generations, "trainmover_workers": 2,
                      "trainmover_recovery_seconds_count": 1, "trainmover_job_running": 1}, counts
    assert step > recovered["step"]
    documented = {line.split("`")[1] for line in DOC.read_text().splitlines() if line.startswith("| `trainmover_")}
    missing = sorted(d for d in documented if d not in families and f"{d}_sum" not in families)
    assert len(documented) >= 15 and not missing, f"documented but never scraped: {missing}"
