"""The local provider's hosts: a bootstrapped instance really runs its job's agent, and the cloud's state machine
powers it: launch and start boot it, stop powers it off (every process on it at once), terminate removes it.

The agents here point at a port nobody listens on, so each keeps trying to join (up to its connect timeout): what
is checked is which processes exist on which host, not the job (tests/flows/test_hosts.py runs real jobs).
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cloud.base import InvalidRequestError, LaunchRequest, NotFoundError, PermissionDeniedError, UnsupportedError
from cloud.bootstrap import AgentBootstrap
from cloud.local import LocalProvider
from cloud.local.hosts import (
    LocalHosts,
    NamespaceHosts,
    ProcessHosts,
    agent_argv,
    namespaces_unavailable,
    power_cut,
)
from cloud.secrets import LocalFileStore, SecretRef, fetch_secret

SECRET = "s" * 48


def _closed_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])  # closed again when this returns: nobody listens there


def _spec(ref: SecretRef, host: str = "127.0.0.1") -> AgentBootstrap:
    return AgentBootstrap(job_id="hosts-unit", coordinator_host=host, agent_port=_closed_port(), slots=1,
                          source="trainmover==0.1.0", secret=ref, script=str(Path(__file__).resolve()))


def _wait(what: str, found: object, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not found():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"not {what} within {timeout_s:.0f} s"
        time.sleep(0.05)  # polling another process's state


@pytest.fixture
def store(tmp_path: Path) -> LocalFileStore:
    return LocalFileStore(tmp_path / "secrets")


def test_the_local_file_store_keeps_a_job_secret_readable_by_its_owner_only(store: LocalFileStore) -> None:
    ref = store.put("hosts-unit", SECRET)
    assert ref.kind == "local-file" and ref.name.endswith("hosts-unit.secret")
    assert stat.S_IMODE(os.stat(ref.name).st_mode) == 0o600
    assert store.get(ref) == SECRET and fetch_secret(ref) == SECRET
    os.chmod(ref.name, 0o644)
    with pytest.raises(PermissionDeniedError, match="chmod 600"):
        store.get(ref)
    store.delete(ref)
    store.delete(ref)  # a missing secret is no error
    with pytest.raises(NotFoundError):
        store.get(ref)
    with pytest.raises(InvalidRequestError, match="absolute path"):
        SecretRef("local-file", "relative/job.secret")
    with pytest.raises(InvalidRequestError, match="is not in"):
        store.get(SecretRef("local-file", "/etc/other.secret"))


def test_a_local_provider_without_hosts_refuses_a_bootstrap_and_a_cloud_secret_is_refused(
    store: LocalFileStore, tmp_path: Path
) -> None:
    spec = _spec(store.put("hosts-unit", SECRET))
    with pytest.raises(UnsupportedError, match="hosts="):
        LocalProvider(slots=2).launch(LaunchRequest("hosts-unit", "worker", "local", bootstrap=spec))
    ssm = AgentBootstrap(job_id="hosts-unit", coordinator_host="127.0.0.1", agent_port=1, slots=1,
                         source="trainmover==0.1.0", secret=SecretRef("aws-ssm", "/trainmover/x/job-secret",
                                                                         "us-east-1"), script="/x.py")
    hosts = ProcessHosts(tmp_path / "logs")
    try:
        cloud = LocalProvider(slots=2, hosts=hosts)
        with pytest.raises(UnsupportedError, match="LocalFileStore"):
            cloud.launch(LaunchRequest("hosts-unit", "worker", "local", bootstrap=ssm))
        assert cloud.describe(job_id="hosts-unit") == []
    finally:
        hosts.close()


_FORKER = """
import os, time
children = 0
while children < 400:  # forks as fast as it can: a listing is out of date by the time it is acted on
    if os.fork() == 0:
        time.sleep(120)
        os._exit(0)
    children += 1
time.sleep(120)
"""


def _alive_in_session(sid: int) -> list[int]:
    alive = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat_line = (entry / "stat").read_text()
            except OSError:
                continue
            fields = stat_line[stat_line.rindex(")") + 2:].split()
            if fields[0] != "Z" and int(fields[3]) == sid:
                alive.append(int(entry.name))
    return alive


def test_a_power_cut_leaves_no_child_forked_while_it_was_listing() -> None:
    """A power cut kills what was forked between its listing and its kill too (CI once saw one survive a stop)."""
    proc = subprocess.Popen([sys.executable, "-c", _FORKER], start_new_session=True)
    try:
        _wait("the forker forking", lambda: len(_alive_in_session(proc.pid)) > 20)
        power_cut(lambda: _alive_in_session(proc.pid))
        assert proc.wait(timeout=10) == -9
        _wait("every child dead", lambda: _alive_in_session(proc.pid) == [])
    finally:
        for pid in _alive_in_session(proc.pid):
            os.kill(pid, 9)
        proc.wait(timeout=10)


def test_the_agent_argv_carries_the_secret_file_never_the_secret(store: LocalFileStore) -> None:
    spec = _spec(store.put("hosts-unit", SECRET))
    argv = agent_argv(spec, "local-000001", secret_file=spec.secret.name, address="10.0.0.5")
    assert SECRET not in " ".join(argv)
    assert argv[argv.index("--secret-file") + 1] == spec.secret.name
    assert argv[argv.index("--name") + 1] == "local-000001" and argv[argv.index("--address") + 1] == "10.0.0.5"
    assert argv[argv.index("--job-id") + 1] == "hosts-unit"


@pytest.mark.parametrize("kind", ["processes", "namespaces"])
def test_launch_boots_the_agent_stop_powers_the_host_off_start_boots_it_again_terminate_removes_it(
    kind: str, store: LocalFileStore, tmp_path: Path
) -> None:
    if kind == "namespaces" and (why := namespaces_unavailable()) is not None:
        pytest.skip(why)
    hosts: LocalHosts = NamespaceHosts(tmp_path / "logs") if kind == "namespaces" else ProcessHosts(tmp_path / "logs")
    try:
        cloud = LocalProvider(slots=4, hosts=hosts)
        spec = _spec(store.put("hosts-unit", SECRET), hosts.coordinator_host)
        (a, b) = cloud.launch(LaunchRequest("hosts-unit", "standby", "local", count=2, bootstrap=spec))
        plain = cloud.launch(LaunchRequest("hosts-unit", "standby", "local"))[0]  # no bootstrap: bookkeeping only
        assert hosts.is_on(a.instance_id) and hosts.is_on(b.instance_id) and not hosts.is_on(plain.instance_id)
        if kind == "namespaces":
            assert a.private_ip != b.private_ip and a.private_ip.startswith("10.")
        agent = hosts.agent_pid(a.instance_id)
        assert agent is not None and hosts.pids(a.instance_id)[0] == agent
        cloud.stop([a.instance_id])
        assert not hosts.is_on(a.instance_id) and hosts.pids(a.instance_id) == []
        assert hosts.is_on(b.instance_id), "stopping one instance leaves the others running"
        cloud.start([a.instance_id])
        assert hosts.is_on(a.instance_id) and hosts.agent_pid(a.instance_id) != agent
        assert sorted(p.name for p in (tmp_path / "logs").glob(f"{a.instance_id}.*")) == [
            f"{a.instance_id}.boot1.log", f"{a.instance_id}.boot2.log"]
        # A host that dies on its own stays dead: the provider does not resurrect it on the next call.
        os.kill(hosts.agent_pid(b.instance_id) or 0, 9)
        _wait("the killed agent reaped", lambda: not hosts.is_on(b.instance_id))
        cloud.describe(job_id="hosts-unit")
        assert not hosts.is_on(b.instance_id)
        cloud.terminate([a.instance_id, b.instance_id])
        assert hosts.pids(a.instance_id) == [] and not hosts.is_on(a.instance_id)
        for log in (tmp_path / "logs").glob("*.log"):
            assert SECRET not in log.read_text(errors="replace")
    finally:
        hosts.close()
    if isinstance(hosts, NamespaceHosts):
        assert hosts.bridge.leftovers() == []


def test_an_outsider_process_on_this_machine_cannot_read_the_secret_from_an_agents_environment(
    store: LocalFileStore, tmp_path: Path
) -> None:
    os.environ["TRAINMOVER_JOB_SECRET"] = "x" * 40  # a secret of another job, in the orchestrator's environment
    hosts = ProcessHosts(tmp_path / "logs")
    try:
        cloud = LocalProvider(slots=1, hosts=hosts)
        (inst,) = cloud.launch(LaunchRequest("hosts-unit", "worker", "local",
                                             bootstrap=_spec(store.put("hosts-unit", SECRET))))
        pid = hosts.agent_pid(inst.instance_id)
        environ = Path(f"/proc/{pid}/environ").read_bytes()
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        assert SECRET.encode() not in environ + cmdline and b"x" * 40 not in environ
    finally:
        del os.environ["TRAINMOVER_JOB_SECRET"]
        hosts.close()
