"""One configuration tree: each default written once (runtime.config.KNOBS), the command lines made of the records'
fields, the same knob under the same flag name and polarity in every command."""

from __future__ import annotations

import argparse
import dataclasses
import inspect
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

from runtime.cli import add_agent_parser, add_coordinator_parser, add_run_parser
from runtime.client import JobSpec, Placement, coordinator_argv, run_argv
from runtime.config import KNOBS, ConfigError, LaunchConfig, ProcessConfig, flags_of, from_namespace
from runtime.control.coordinator import CoordinatorSettings
from runtime.control.hosts import HostTiming
from runtime.host.agent import AgentConfig
from runtime.training.comm import Communicator
from runtime.training.handoff import GlooLinks, HandoffSession

RECORDS: tuple[type, ...] = (LaunchConfig, ProcessConfig, CoordinatorSettings, HostTiming, AgentConfig, JobSpec,
                             Placement, HandoffSession)

KNOB_FIELDS: dict[str, list[tuple[Any, str]]] = {
    "nproc": [(LaunchConfig, "nproc")],
    "standby": [(LaunchConfig, "standby"), (JobSpec, "standby")],
    "backend": [(LaunchConfig, "backend"), (ProcessConfig, "backend"), (JobSpec, "backend")],
    "heartbeat_s": [(LaunchConfig, "heartbeat_s"), (ProcessConfig, "heartbeat_s")],
    "hang_timeout_s": [(LaunchConfig, "hang_timeout_s"), (CoordinatorSettings, "hang_timeout_s")],
    "standby_wait_s": [(LaunchConfig, "standby_wait_s"), (CoordinatorSettings, "standby_wait_s")],
    "replenish": [(LaunchConfig, "replenish"), (CoordinatorSettings, "replenish")],
    "wait_for_standbys": [(LaunchConfig, "wait_for_standbys"), (CoordinatorSettings, "start_when_standbys_ready")],
    "recovery_timeout_s": [(LaunchConfig, "recovery_timeout_s"), (ProcessConfig, "recovery_timeout_s")],
    "startup_timeout_s": [(CoordinatorSettings, "startup_timeout_s")],
    "collective_timeout_s": [(ProcessConfig, "collective_timeout_s"), (GlooLinks.__init__, "timeout_s")],
    "connect_timeout_s": [(ProcessConfig, "connect_timeout_s"), (Communicator.build, "connect_timeout_s")],
    "chunk_bytes": [(LaunchConfig, "chunk_bytes"), (ProcessConfig, "chunk_bytes"), (HandoffSession, "chunk_bytes")],
    "handoff_transport": [(LaunchConfig, "handoff_transport"), (ProcessConfig, "handoff_transport")],
    "handoff_overlap": [(LaunchConfig, "handoff_overlap"), (ProcessConfig, "handoff_overlap")],
    "hot_standbys": [(LaunchConfig, "hot_standbys"), (ProcessConfig, "hot_standbys"), (JobSpec, "hot_standbys")],
    "host": [(LaunchConfig, "host"), (ProcessConfig, "bind_host")],
    "fork_server": [(LaunchConfig, "fork_server"), (AgentConfig, "fork_server")],
    "agent_heartbeat_s": [(LaunchConfig, "agent_heartbeat_s"), (HostTiming, "heartbeat_s")],
    "agent_lease_s": [(HostTiming, "lease_s")],
    "host_timeout_s": [(LaunchConfig, "host_timeout_s"), (HostTiming, "host_timeout_s")],
    "host_settle_s": [(LaunchConfig, "host_settle_s"), (HostTiming, "settle_s")],
    "agents_wait_s": [(LaunchConfig, "agents_wait_s")],
    "agent_connect_timeout_s": [(AgentConfig, "connect_timeout_s")],
    "backup_every": [(LaunchConfig, "backup_every"), (ProcessConfig, "backup_every")],
    "backup_keep": [(LaunchConfig, "backup_keep"), (ProcessConfig, "backup_keep")],
    "shrink": [(LaunchConfig, "shrink"), (ProcessConfig, "shrink"), (CoordinatorSettings, "shrink"),
               (JobSpec, "shrink")],
}
"""Where each shared knob lives: every one of these defaults is KNOBS's."""

SAME_NAME_OTHER_MEANING = {
    "heartbeat_s": "HostTiming's is the agent links' beat (KNOBS.agent_heartbeat_s), not the processes' heartbeat",
    "connect_timeout_s": "AgentConfig's is an agent's wait for its coordinator; ProcessConfig's a group's connect",
    "num_threads": "LaunchConfig's None is resolved (cores / nproc) before a process is told its count",
    "job_id": "AgentConfig's empty job_id joins whichever job; the launcher's is a fresh id",
    "tls_cert": "None: not given (LaunchConfig); '': an unset launch variable (ProcessConfig)",
    "backup_dir": "None: not given (LaunchConfig); '': an unset launch variable (ProcessConfig)",
    "resume_from": "None: not given (LaunchConfig); '': an unset launch variable (ProcessConfig)",
    "tls_key": "as tls_cert",
    "tls_ca": "as tls_cert",
    "faults": "JobSpec's None (the supervisor's no plan) and the launcher's '' both mean no fault plan",
}
"""Fields of the same name in two records that are not one knob, each with why."""

AGENT_ONLY_OPTIONS = {"secret_file", "notices", "metadata_url", "quiet"}
"""`trainmover agent` options that are not AgentConfig fields (the secret, the notice watcher, logging)."""


def _default(where: Any, name: str) -> Any:
    if dataclasses.is_dataclass(where):
        f = next(f for f in dataclasses.fields(where) if f.name == name)
        assert f.default is not dataclasses.MISSING, f"{where.__name__}.{name} has no default"
        return f.default
    return inspect.signature(where).parameters[name].default


def _parsers() -> dict[str, argparse.ArgumentParser]:
    top = argparse.ArgumentParser(prog="trainmover")
    sub = top.add_subparsers(dest="command")
    add_run_parser(sub)
    add_coordinator_parser(sub)
    add_agent_parser(sub)
    return dict(sub.choices)


def _options(p: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {a.dest: a for a in p._actions if a.option_strings and a.dest != "help"}


@pytest.mark.parametrize("knob", sorted(KNOB_FIELDS))
def test_every_default_of_a_shared_knob_is_the_one_in_knobs(knob: str) -> None:
    expected = getattr(KNOBS, knob)
    for where, name in KNOB_FIELDS[knob]:
        got = _default(where, name)
        assert got == expected, f"{getattr(where, '__qualname__', where)}.{name} = {got!r}, KNOBS.{knob} = {expected!r}"
        if knob != "agent_lease_s":  # a property: computed anew
            assert got is expected, f"{getattr(where, '__qualname__', where)}.{name}: write KNOBS.{knob}, not a copy"


def test_every_knob_is_used_and_a_name_shared_by_two_records_is_one_knob_or_says_why_not() -> None:
    assert set(KNOB_FIELDS) == {f.name for f in dataclasses.fields(KNOBS)} | {"agent_lease_s"}
    defaults: dict[str, dict[str, Any]] = defaultdict(dict)
    for record in RECORDS:
        for f in dataclasses.fields(record):
            if f.default is not dataclasses.MISSING:
                defaults[f.name][record.__name__] = f.default
            elif f.default_factory is not dataclasses.MISSING:
                defaults[f.name][record.__name__] = "(a fresh one)"
    differ = {name: by for name, by in defaults.items() if len({repr(v) for v in by.values()}) > 1}
    assert set(differ) == set(SAME_NAME_OTHER_MEANING), differ


def test_every_option_default_is_its_field_default_and_parsing_nothing_gives_the_record_defaults() -> None:
    parsers = _parsers()
    for command, record, extra in (("run", LaunchConfig, set()), ("coordinator", LaunchConfig, set()),
                                   ("agent", AgentConfig, AGENT_ONLY_OPTIONS)):
        fields = {f.name: f for f, _ in flags_of(record)}
        options = _options(parsers[command])
        assert set(options) - set(fields) == extra, command
        for dest, action in options.items():
            if dest in extra or action.required:
                continue
            f = fields[dest]
            want = None if f.default is dataclasses.MISSING else f.default  # a default factory: the record's own
            assert action.default == want, f"{command} {action.option_strings[0]}: {action.default!r} != {want!r}"
    ns = parsers["run"].parse_args(["train.py"])
    assert dataclasses.replace(from_namespace(LaunchConfig, ns), job_id="j") == LaunchConfig("train.py", job_id="j")
    ns = parsers["agent"].parse_args(["--coordinator", "h:1"])
    assert from_namespace(AgentConfig, ns, secret="s", name="n") == AgentConfig(coordinator="h:1", secret="s", name="n")


def test_the_same_knob_has_the_same_flag_and_polarity_in_every_command() -> None:
    flags: dict[str, set[tuple[str, ...]]] = defaultdict(set)
    dests: dict[str, set[str]] = defaultdict(set)
    for p in _parsers().values():
        for dest, action in _options(p).items():
            flags[dest].add(tuple(action.option_strings))
            for s in action.option_strings:
                dests[s].add(dest)
            if isinstance(action, argparse.BooleanOptionalAction) or isinstance(action.default, bool):
                name = action.option_strings[0]
                assert isinstance(action, argparse.BooleanOptionalAction), f"{name}: a switch is --x/--no-x"
                assert not name.startswith("--no-"), f"{name}: a switch is named for what it turns on"
    assert {d: f for d, f in flags.items() if len(f) > 1} == {}
    assert {s: d for s, d in dests.items() if len(d) > 1} == {}
    assert flags["fork_server"] == {("--fork-server", "--no-fork-server")}
    for command in ("run", "agent"):  # the coordinator starts no process: each agent forks its own
        assert _options(_parsers()[command])["fork_server"].default is True, command


def test_the_clients_command_lines_say_what_the_spec_and_the_placement_say(tmp_path: Path) -> None:
    spec = JobSpec(script=Path("examples/train_mlp.py"), workers=3, standby=2, script_args=("--lr", "0.1"),
                   backend="gloo", faults="kill:rank=1,step=5", steps=40, threads=2, hot_standbys=1)
    parsers = _parsers()
    cfg = from_namespace(LaunchConfig, parsers["run"].parse_args(run_argv(spec, tmp_path / "ev", 7)[4:]))
    assert (cfg.nproc, cfg.standby, cfg.backend, cfg.num_threads, cfg.faults, cfg.port, cfg.events_path,
            cfg.hot_standbys) == (3, 2, "gloo", 2, spec.faults, 7, str(tmp_path / "ev"), 1)
    assert (cfg.script, cfg.args) == (str(spec.script.resolve()), ("--lr", "0.1", "--steps", "40"))
    placement = Placement("job-a", 3, "10.0.0.1", 7000, 7001, 30.0)
    cfg = from_namespace(LaunchConfig, parsers["coordinator"].parse_args(
        coordinator_argv(spec, tmp_path / "ev", placement)[4:]))
    assert (cfg.job_id, cfg.agents, cfg.host, cfg.port, cfg.agent_port, cfg.agents_wait_s) == (
        "job-a", 3, "10.0.0.1", 7000, 7001, 30.0)


@pytest.mark.parametrize("settle", [-0.1, 3.0])
def test_a_host_settle_outside_zero_to_the_host_timeout_is_one_clear_error(settle: float) -> None:
    cfg = LaunchConfig(script="train.py", agents=2, host_settle_s=settle)
    with pytest.raises(ConfigError, match=r"--host-settle .* shorter than the host timeout \(3.0 s\)"):
        cfg.validate()
    assert LaunchConfig(script="train.py", agents=2, host_settle_s=0.5).host_timing().settle_s == 0.5
