"""The supervisor when the job runs on its instances: every instance the job launches boots `trainmover agent`
and joins the coordinator, which runs alone on the flow's machine (`TrainingRun.hosts`, flows.hosts).

Real jobs: a host of the job dies whole (the runtime's `host` fault kills its agent and its process at once), and
the job must end bit for bit where an uninterrupted run ends, with the lost instance terminated, a replacement
ordered, the role tags following the ranks, and nothing left behind: no process, namespace or secret file.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from cloud.base import CapacityError
from cloud.local import LocalProvider
from cloud.local.hosts import NamespaceHosts, namespaces_unavailable
from flows.hosts import job_hosts
from flows.models import StandbyLimits, TrainingRun
from flows.supervisor import Supervisor
from tests.flows.supervising import supervise
from tests.runtime.conftest import TINY_JOB, clean_digest

pytestmark = pytest.mark.slow
ARGS = ("--step-ms", "40")


def _processes_of(workdir: Path) -> list[int]:
    """Pids whose command line names the run's work directory (the coordinator, every agent)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if str(workdir).encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def test_a_host_lost_whole_moves_its_rank_to_a_standby_host_and_the_job_ends_bit_exact(tmp_path: Path) -> None:
    if (why := namespaces_unavailable()) is not None:
        pytest.fail(f"this test makes network namespaces and {why}")
    steps = 40
    run = TrainingRun(job_id="hosts-ns", workers=2, steps=steps, script=str(TINY_JOB), script_args=ARGS,
                      standby=StandbyLimits(min_warm=1, max_warm=1, max_stopped=0), hosts="namespaces",
                      faults="host:rank=1,step=15")
    cloud = LocalProvider(slots=8)
    hosts = job_hosts(run, cloud, tmp_path)
    assert hosts is not None and isinstance(hosts.local_hosts, NamespaceHosts)
    sup = Supervisor(run, cloud, tmp_path, hosts=hosts, policy_every_s=3600.0)
    try:
        sup.provision(TINY_JOB)
        secret_file = Path(hosts.secret_ref.name) if hosts.secret_ref else None
        assert secret_file is not None and secret_file.stat().st_mode & 0o077 == 0
        launched = {i.instance_id: i for i in cloud.describe(job_id=run.job_id)}
        assert len(launched) == 3 and len({i.private_ip for i in launched.values()}) == 3
        seen = supervise(sup, TINY_JOB, timeout_s=180.0)
        report = sup.report()
        instances = {i.instance_id: i for i in cloud.describe(job_id=run.job_id)}
    finally:
        released = sup.release()
    assert report.exit_code == 0, (tmp_path / "job.log").read_text()
    assert report.final_digest == clean_digest(2, steps, TINY_JOB, ARGS), \
        "the run with a lost host must end bit for bit where the uninterrupted run ends"

    events = [h.event for h in seen]
    (lost,) = [h for h in seen if h.event == "trainmover.node.lost"]
    (row,) = report.interruptions
    assert row.rank == 1 and row.step == 15 and "lost" in row.cause and row.tier == "warm", row
    assert events.index("trainmover.node.lost") < events.index("trainmover.standby.promoted")
    assert "trainmover.standby.ordered" in events
    # The lost instance is gone; the standby's instance holds rank 1 and is tagged a worker; a new standby replaces it.
    gone = lost.payload["node"]
    assert gone in launched and gone not in instances
    assert sorted(i.role for i in instances.values()) == ["standby", "worker", "worker"]
    assert set(sup.workers.values()) == {i for i, inst in instances.items() if inst.role == "worker"}
    assert sorted(released) == sorted(instances)
    # Nothing is left: no process of the job, no namespace, no secret.
    assert not secret_file.exists()
    assert hosts.local_hosts.bridge.leftovers() == []
    assert _processes_of(tmp_path) == []


@pytest.mark.parametrize("capacity", ["available", "none"])
def test_a_parked_standby_host_is_woken_for_a_lost_worker_and_its_agent_warms_a_standby(
    tmp_path: Path, capacity: str
) -> None:
    """No warm standby: the policy parks one (its host is powered off); rank 1's host dies, the supervisor wakes
    the parked instance, its agent boots again and joins, the standby starts cold there and takes rank 1. With no
    capacity to wake it, a replacement is launched instead (cloud.capacity's on-demand step) and the parked one is
    released."""
    steps = 120
    run = TrainingRun(job_id="hosts-park", workers=2, steps=steps, script=str(TINY_JOB), script_args=ARGS,
                      job_nodes=512, hazard_multiplier=100.0,
                      standby=StandbyLimits(min_warm=0, max_warm=0, max_stopped=1), hosts="processes",
                      faults="host:rank=1,step=60")
    cloud = LocalProvider(slots=8)
    if capacity == "none":
        cloud.fail_next("start", CapacityError("local: no capacity", code="InsufficientInstanceCapacity"))
    hosts = job_hosts(run, cloud, tmp_path)
    assert hosts is not None and hosts.local_hosts is not None
    sup = Supervisor(run, cloud, tmp_path, hosts=hosts, policy_every_s=0.2, time_scale=3600.0)
    try:
        sup.provision(TINY_JOB)
        seen = supervise(sup, TINY_JOB, timeout_s=180.0)
        report = sup.report()
        left = {i.instance_id: i.state for i in cloud.describe(job_id=run.job_id)}
    finally:
        sup.release()
    events = [h.event for h in seen]
    assert report.exit_code == 0, (tmp_path / "job.log").read_text()
    assert events.index("trainmover.standby.parked") < events.index("trainmover.node.lost"), events
    (woken,) = [h for h in seen if h.event == "trainmover.standby.woken"]
    (row,) = report.interruptions
    assert row.rank == 1 and row.tier == "stopped", row
    boots = sorted(p.name for p in (tmp_path / "hosts").glob("*.log"))
    holder = sup.workers[1]
    assert woken.resource.endswith(holder)
    if capacity == "available":
        assert woken.payload["step"] == "wake" and woken.payload["parked"] == holder
        assert f"{holder}.boot2.log" in boots, boots
    else:
        assert woken.payload["step"] == "on-demand" and woken.payload["parked"] != holder, woken.payload
        assert "InsufficientInstanceCapacity" in woken.message and woken.payload["parked"] not in left
        assert f"{holder}.boot1.log" in boots and f"{holder}.boot2.log" not in boots, boots
    assert report.final_digest == clean_digest(2, steps, TINY_JOB, ARGS)
    assert _processes_of(tmp_path) == []
