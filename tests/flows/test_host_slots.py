"""Every accelerator used: a run's hosts run one training process per GPU of their instance type, as the provider's
own instance-type data says (`Provider.accelerators`, flows.hosts), against moto's EC2 (whose type data is AWS's).

What the flow computes and sends: 16 ranks on p5.48xlarge (8 H100 each) take 2 worker instances and a standby
instance of 8 standby processes; every instance boots `trainmover agent --slots 8`; the coordinator is started for
3 agents, 16 ranks and 8 standbys. A whole 8-GPU host lost with no warm standby wakes one parked host for all 8
ranks, not one per rank. No instance runs (moto starts none), so nothing trains here: tests/flows/test_hosts.py
runs real hosts.
"""

from __future__ import annotations

import base64
import json
import logging
import time
from collections.abc import Iterator
from pathlib import Path

import boto3
import pytest

from cloud.base import InvalidRequestError, Provider
from cloud.bootstrap import AGENT_UNIT
from flows.hosts import host_slots, hosts_for, job_hosts
from flows.models import StandbyLimits, TrainingRun
from flows.supervisor import Supervisor
from runtime.client import coordinator_argv
from runtime.wire.event_records import HostLost, MemberFailed, Recovered
from tests.cloud.aws_servers import FaultProxy, PlacementGroups, fault_proxy, moto_server

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "train_mlp.py"
REGION = "us-east-1"
AMI = "ami-12c6146b"  # one of the AMIs moto ships
PROFILE = "trainmover-node"


@pytest.fixture(scope="module")
def aws_servers() -> Iterator[FaultProxy]:
    """moto's server (its backends are this process's: one instance profile for the module) behind the recording
    proxy, which answers the placement-group calls moto lacks."""
    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    with moto_server() as url, fault_proxy(url) as recording:
        PlacementGroups().install(recording)
        boto3.client("iam", endpoint_url=url, region_name=REGION, aws_access_key_id="testing",
                     aws_secret_access_key="not-a-real-secret").create_instance_profile(InstanceProfileName=PROFILE)
        yield recording


@pytest.fixture
def proxy(aws_servers: FaultProxy, monkeypatch: pytest.MonkeyPatch) -> FaultProxy:
    """The recording proxy, emptied, found by the SDKs' standard chain as on a worker host."""
    for name, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "not-a-real-secret",
                        "AWS_DEFAULT_REGION": REGION, "AWS_ENDPOINT_URL": aws_servers.url}.items():
        monkeypatch.setenv(name, value)
    aws_servers.reset()
    return aws_servers


def aws_run(job_id: str, **changes: object) -> TrainingRun:
    fields: dict[str, object] = {
        "job_id": job_id, "provider": "aws", "region": REGION, "instance_type": "p5.48xlarge", "workers": 16,
        "standby": StandbyLimits(min_warm=1, max_warm=1, max_stopped=0), "script": str(SCRIPT),
        "coordinator_address": "127.0.0.1", "image": AMI, "instance_profile": PROFILE, "notice_queue": False,
        "trainmover_source": "trainmover==0.1.0",
    }
    return TrainingRun(**{**fields, **changes})  # type: ignore[arg-type]


def provider_of(run: TrainingRun) -> Provider:
    from flows.training import make_provider

    return make_provider(run)  # the flow's own: region, image and instance profile from the run


def agent_documents(proxy: FaultProxy) -> list[dict[str, str]]:
    """Per RunInstances call: its instance count, the agent's exec line and the agent unit's environment."""
    out = []
    for seen in proxy.seen("RunInstances"):
        config = json.loads(base64.b64decode(seen.params["UserData"]).decode().removeprefix("#cloud-config\n"))
        files = {f["path"]: f["content"] for f in config["write_files"]}
        out.append({
            "count": seen.params["MaxCount"],
            "exec": files["/opt/trainmover/bin/agent-start"].splitlines()[-1],
            "environment": " ".join(line for line in files[f"/etc/systemd/system/{AGENT_UNIT}"].splitlines()
                                    if line.startswith("Environment=")),
        })
    return out


def test_sixteen_ranks_on_8_gpu_instances_take_two_worker_hosts_of_8_processes(
    proxy: FaultProxy, tmp_path: Path
) -> None:
    run = aws_run("slots-p5")
    provider = provider_of(run)
    hosts = job_hosts(run, provider, tmp_path)
    assert hosts is not None and hosts.slots == 8
    sup = Supervisor(run, provider, tmp_path, hosts=hosts, policy_every_s=3600.0)
    try:
        sup.provision(SCRIPT)
        instances = {i.instance_id: i for i in provider.describe(job_id=run.job_id)}
        documents = agent_documents(proxy)
        spec = sup.spec(SCRIPT)
        argv = coordinator_argv(spec, tmp_path / "events.jsonl", hosts.placement(run, agents=len(instances)))
    finally:
        released = sup.release()

    assert sorted(i.role for i in instances.values()) == ["standby", "worker", "worker"]
    assert all(i.instance_type == "p5.48xlarge" for i in instances.values())
    # Ranks 0-7 on one worker host, 8-15 on the other, until the coordinator's placements say otherwise.
    by_host: dict[str, list[int]] = {}
    for rank, instance in sup.workers.items():
        by_host.setdefault(instance, []).append(rank)
    assert sorted(by_host.values()) == [list(range(8)), list(range(8, 16))]
    assert set(by_host) == {i for i, inst in instances.items() if inst.role == "worker"}
    # Every instance boots an agent of 8 slots, its GPUs in PCI order; the coordinator waits for the 3 hosts and
    # keeps a whole host's worth of standbys (8 processes on the standby host).
    assert sum(int(d["count"]) for d in documents) == 3
    for document in documents:
        assert " --slots 8 " in document["exec"], document["exec"]
        assert "Environment=CUDA_DEVICE_ORDER=PCI_BUS_ID" in document["environment"]
        assert "FI_PROVIDER" not in document["environment"], "no EFA asked for: none configured"
    assert (spec.workers, spec.standby) == (16, 8)
    text = " ".join(argv)
    assert "--agents 3 " in text and "--nproc 16 " in text and "--standby 8 " in text, text
    assert sorted(released) == sorted(instances)


def test_a_one_gpu_type_keeps_one_process_per_host_and_a_cpu_type_trains_in_one_slot(
    proxy: FaultProxy, tmp_path: Path
) -> None:
    for instance_type, workers in (("g5.xlarge", 2), ("m5.large", 3)):
        run = aws_run(f"slots-{instance_type.replace('.', '-')}", instance_type=instance_type, workers=workers)
        assert host_slots(run, provider_of(run)) == 1
    assert [hosts_for(n, 8) for n in (1, 8, 9, 12, 16, 17)] == [1, 1, 2, 2, 2, 3]
    assert [hosts_for(n, 1) for n in (1, 2, 3)] == [1, 2, 3]


def test_a_fallback_type_with_other_accelerators_is_refused_before_anything_is_made(
    proxy: FaultProxy, tmp_path: Path
) -> None:
    run = aws_run("slots-fallback", fallback_instance_types=("p5e.48xlarge", "g5.12xlarge"))
    with pytest.raises(InvalidRequestError, match=r"fallback instance type g5\.12xlarge has 4 accelerator\(s\).*"
                                                  r"p5\.48xlarge 8"):
        job_hosts(run, provider_of(run), tmp_path)
    assert proxy.seen("PutParameter") == [] and proxy.seen("RunInstances") == []
    same = aws_run("slots-fallback-ok", fallback_instance_types=("p5e.48xlarge",))  # 8 H200: same slots
    assert host_slots(same, provider_of(same)) == 8


def test_a_lost_8_gpu_host_wakes_one_parked_host_for_its_8_ranks(proxy: FaultProxy, tmp_path: Path) -> None:
    """No warm standby, two parked hosts: the 8 ranks of the lost host wait for one woken host (its agent runs 8
    standbys), and the policy's target comes back down once all 8 are recovered, not after the first."""
    run = aws_run("slots-wake", workers=8, standby=StandbyLimits(min_warm=0, max_warm=1, max_stopped=2))
    provider = provider_of(run)
    hosts = job_hosts(run, provider, tmp_path)
    assert hosts is not None
    sup = Supervisor(run, provider, tmp_path, hosts=hosts, policy_every_s=3600.0)
    try:
        sup.provision(SCRIPT)
        (worker,) = set(sup.workers.values())
        # Two parked standby hosts, launched and stopped as the policy parks them (Supervisor._apply).
        parked = [i.instance_id for i in sup._launch("standby", 2)]
        provider.stop(parked)
        sup.parked = list(parked)
        now = time.time()
        seen = [h.event for h in sup._on_event(HostLost(host=worker, incarnation="1", cause="host lost",
                                                        procs=[f"w{r}" for r in range(8)], failure_at=now))]
        for rank in range(8):
            seen += [h.event for h in sup._on_event(MemberFailed(
                generation=0, rank=rank, proc=f"w{rank}", pid=100 + rank, cause="host lost", step=5,
                failure_at=now, declared_at=now, detect_s=0.1))]
        assert seen.count("trainmover.standby.woken") == 1, seen
        assert sup.parked == [parked[1]], "the second parked host stays parked"
        assert sup.spec(SCRIPT).standby == 8, "one woken host: 8 standby processes for the coordinator"
        states = {i.instance_id: i.state for i in provider.describe(parked)}
        assert states[parked[1]] == "stopped" and states[parked[0]] != "stopped", states
        ranks = [{"rank": r, "old": f"w{r}", "new": f"s{r}"} for r in range(8)]
        sup._on_event(Recovered(generation=1, step=5, ranks=ranks[:7], causes=["host lost"], recovery_s=9.0,
                                handoff_bytes=0, sources=[], detect_s=0.1, reconfigure_s=1.0, handoff_s=1.0,
                                replay_s=1.0, tier="warm"))
        assert sup.warm_target == 1, "one rank still waits for the woken host"
        sup._on_event(Recovered(generation=2, step=5, ranks=ranks[7:], causes=["host lost"], recovery_s=9.0,
                                handoff_bytes=0, sources=[], detect_s=0.1, reconfigure_s=1.0, handoff_s=1.0,
                                replay_s=1.0, tier="warm"))
        assert sup.warm_target == 0 and [i.tier for i in sup.interruptions] == ["stopped"] * 8
    finally:
        sup.release()
