"""Sealed records, secrets and the coordinator's handling of forged or stale values, in-process and fast."""

from __future__ import annotations

import datetime
from pathlib import Path

import pytest
import torch.distributed as dist

from runtime.control.coordinator import Coordinator, CoordinatorSettings
from runtime.launcher import ConfigError, LaunchConfig
from runtime.wire import store as keys
from runtime.wire.auth import Sealer, check_secret, read_secret_file, write_secret_file
from runtime.wire.event_records import StandbyTargetChanged, UntrustedValue
from runtime.wire.events import EventLog
from tests.runtime.conftest import TINY_JOB
from tests.runtime.test_coordinator_logic import FakePool

SECRET = "s" * 64


@pytest.fixture
def store() -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=5), wait_for_workers=False)


def test_a_sealed_value_opens_only_under_its_own_key_and_with_the_secret() -> None:
    sealer = Sealer(SECRET)
    raw = sealer.seal("gen/1/record", {"gen": 1, "members": ["w0", "s0"]})
    assert sealer.open("gen/1/record", raw) == {"gen": 1, "members": ["w0", "s0"]}
    assert sealer.open("gen/2/record", raw) is None, "moved to another generation"
    assert Sealer("x" * 64).open("gen/1/record", raw) is None, "another secret"
    tampered = raw.replace('"s0"', '"s9"')
    assert sealer.open("gen/1/record", tampered) is None
    for junk in ("", "1", "not json at all", "\xff" * 70, raw[:63]):
        assert sealer.open("gen/1/record", junk) is None
    assert sealer.refused == {"gen/#/record": 7}


def test_records_count_a_bad_value_once_however_often_it_is_read(store: dist.TCPStore) -> None:
    records = keys.Records(store, Sealer(SECRET))
    store.set("job/stop", "1")
    assert [records.has("job/stop") for _ in range(5)] == [False] * 5
    assert records.sealer.refused == {"job/stop": 1}
    store.set("job/stop", "2")
    assert not records.has("job/stop") and records.sealer.refused == {"job/stop": 2}
    records.put("job/stop", True)
    assert records.has("job/stop")


def test_a_wait_for_sealed_values_waits_past_forgeries_and_is_bounded(store: dist.TCPStore) -> None:
    records = keys.Records(store, Sealer(SECRET))
    store.set("gen/0/joined/0", "1")
    records.put("gen/0/joined/1", True)
    with pytest.raises(keys.StoreTimeout, match="every member"):
        records.wait(["gen/0/joined/0", "gen/0/joined/1"], 0.2, what="every member")
    records.put("gen/0/joined/0", True)
    assert records.wait(["gen/0/joined/0", "gen/0/joined/1"], 1.0) == {"gen/0/joined/0": True,
                                                                         "gen/0/joined/1": True}


def test_secrets_from_users_are_checked_and_secret_files_must_be_private(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="at least 32 printable characters"):
        check_secret("short", "TRAINMOVER_JOB_SECRET")
    path = tmp_path / "secret"
    write_secret_file(str(path), SECRET)
    assert oct(path.stat().st_mode & 0o777) == "0o600" and read_secret_file(str(path)) == SECRET
    with pytest.raises(FileExistsError):
        write_secret_file(str(path), SECRET)
    path.chmod(0o644)
    with pytest.raises(ValueError, match="chmod 600"):
        read_secret_file(str(path))


def test_the_launcher_takes_the_secret_from_env_then_file_and_refuses_a_readable_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("TRAINMOVER_JOB_SECRET", raising=False)
    file = tmp_path / "job.secret"
    cfg = LaunchConfig(script=str(TINY_JOB), secret_file=str(file))
    created = cfg.job_secret()
    assert file.read_text().strip() == created and cfg.job_secret() == created, "created once, then read"
    monkeypatch.setenv("TRAINMOVER_JOB_SECRET", SECRET)
    assert cfg.job_secret() == SECRET
    monkeypatch.delenv("TRAINMOVER_JOB_SECRET")
    file.chmod(0o640)
    with pytest.raises(ConfigError, match="readable by other users"):
        cfg.job_secret()
    assert SECRET not in repr(LaunchConfig(script=str(TINY_JOB), secret=SECRET))


def test_tls_options_are_checked_before_anything_starts(tmp_path: Path) -> None:
    cert = tmp_path / "c.pem"
    cert.write_text("x")
    with pytest.raises(ConfigError, match="go together"):
        LaunchConfig(script=str(TINY_JOB), handoff_transport="tls", tls_cert=str(cert)).validate()
    with pytest.raises(ConfigError, match="tls only"):
        LaunchConfig(script=str(TINY_JOB), tls_cert=str(cert), tls_key=str(cert)).validate()
    with pytest.raises(ConfigError, match="is not a file"):
        LaunchConfig(script=str(TINY_JOB), handoff_transport="tls", tls_cert=str(cert),
                     tls_key=str(tmp_path / "none")).validate()


def _coordinator(store: dist.TCPStore) -> tuple[Coordinator, FakePool]:
    pool = FakePool(lambda name, role: (None, 0))
    settings = CoordinatorSettings(job_id="j", job_token=SECRET, nproc=2, standby=1)
    c = Coordinator(settings, store, pool, EventLog(None))
    for name in c.gen.members:
        c._spawn(name, "worker")
    c.started = True
    return c, pool


def test_the_coordinator_obeys_sealed_commands_once_and_refuses_unsealed_and_stale_ones(
    store: dist.TCPStore,
) -> None:
    c, pool = _coordinator(store)
    orchestrator = keys.Records(store, Sealer(SECRET, "control"))
    key = keys.k_control_standby_target()
    store.set(key, '{"seq": 9, "request": "3"}')  # unsealed
    c._poll_control()
    assert c.standby_target == 1
    orchestrator.put(key, {"seq": 5, "request": "3"})
    c._poll_control()
    c._poll_control()  # the same value seen twice is acted on once
    assert c.standby_target == 3 and sum(p.role == "standby" for p in pool.spawned) == 3
    old = store.get(key)
    orchestrator.put(key, {"seq": 6, "request": "2"})
    c._poll_control()
    assert c.standby_target == 2
    store.set(key, old)  # a genuine command, replayed
    c._poll_control()
    assert c.standby_target == 2
    refused = c.events.of_type(UntrustedValue)
    assert [e.reason for e in refused] == ["not signed with the job's secret",
                                              "stale (seq 5, the last applied is 6)"]
    assert [(e.old, e.new) for e in c.events.of_type(StandbyTargetChanged)] == [
        (1, 3), (3, 2)]


def test_a_sealed_failure_report_naming_a_rank_outside_the_generation_is_no_crash(store: dist.TCPStore) -> None:
    c, _ = _coordinator(store)
    member = keys.Records(store, Sealer(SECRET, "w0"))
    member.put(keys.k_failed(0, "w0"), {"message": "x", "untrusted_rank": 7, "kind": "comm"})
    store.add(keys.k_failed_count(0), 1)
    c._handle_failed_reports(0.0)
    member.put(keys.k_failed(0, "w0"), {"message": "x", "untrusted_rank": "1", "kind": "comm"})
    c._handle_failed_reports(0.1)
    assert not any(m.dead for m in c.procs.values())
