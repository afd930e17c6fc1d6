"""The runtime's configuration tree: each default written once, and the command lines derived from it.

- `Knobs` (`KNOBS`): every knob that more than one record carries (the hang timeout, the heartbeats, the
  timeouts, the handoff's chunk size, the backend, the fork server, ...), with its one default. The records take
  their defaults from it: `LaunchConfig` (`trainmover run` and `trainmover coordinator`), `ProcessConfig` (what a
  training process is told), `runtime.control.coordinator.CoordinatorSettings`, `runtime.control.hosts.HostTiming`,
  `runtime.host.agent.AgentConfig`, `runtime.client.JobSpec`.
- `Flag`: how a record's field appears on a command line, in the field's metadata (`flag(...)`); `add_options`
  adds one option per flagged field (its default, type, choices and help from the record), `from_namespace` builds
  the record from the parsed options. A boolean is always `--name/--no-name`. runtime.cli builds `trainmover run`,
  `coordinator` and `agent` this way; tests/runtime/test_config_tree.py checks the tree.
- `ProcessConfig`: what a training process learns from its launcher (the job's address, its own name and role, the
  knobs), passed in environment variables the way torchrun passes RANK and MASTER_ADDR; `ProcessConfig.from_env`
  validates them once, with a message that says what to do.

This module imports neither torch nor the rest of the runtime (a command line is built without them).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import socket
import types
import typing
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeVar

if TYPE_CHECKING:
    from runtime.control.hosts import HostTiming

Role = Literal["worker", "standby"]
Backend = Literal["gloo", "nccl"]
Transport = Literal["gloo", "tls"]
ShrinkMode = Literal["off", "accumulate", "lr-linear", "lr-sqrt"]


@dataclass(frozen=True, slots=True)
class Knobs:
    """The knobs more than one record carries, each with its one default (`KNOBS`)."""

    nproc: int = 2
    """Workers: logical data-parallel ranks 0..nproc-1."""
    standby: int = 1
    """Warm standby processes kept ready."""
    hot_standbys: int = 0
    """Of the standbys, how many mirror a data-parallel job's state every step (runtime.training.hot), so that their
    takeover moves nothing."""
    backend: Backend = "gloo"
    """Collective backend: gloo (CPU tensors) or nccl (CUDA tensors, one GPU per process)."""
    heartbeat_s: float = 0.25
    """Interval of the heartbeat every training process writes, which the coordinator watches."""
    hang_timeout_s: float = 2.0
    """Heartbeat silence after which a process is declared hung, fenced (SIGKILL) and replaced."""
    standby_wait_s: float = 30.0
    """With no standby ready, how long to wait for one (a replacement warming up) before stopping the job."""
    replenish: bool = True
    """Start a replacement standby whenever one is promoted or lost."""
    wait_for_standbys: bool = False
    """Hold the workers at generation 0 until every standby is warm, so that the first failure is covered."""
    recovery_timeout_s: float = 120.0
    """Longest a member waits for a new generation or for its peers to join one."""
    startup_timeout_s: float = 180.0
    """A process that has not said hello (a standby: not warm) this long after it was started is fenced; the workers
    wait for generation 0 this long plus the recovery timeout (it may wait for the standbys to be warm)."""
    collective_timeout_s: float = 600.0
    """Gloo/NCCL timeout of a collective. Long on purpose: hangs are caught by heartbeats and fenced,
    so a short timeout would only add false alarms when ranks drift apart (evaluation, checkpoint writes)."""
    connect_timeout_s: float = 30.0
    """Longest wait to connect a generation's group (a member lost while connecting costs at most this)."""
    chunk_bytes: int = 64 << 20
    """Largest message of a state handoff; bigger tensors are streamed in slices of this size."""
    handoff_transport: Transport = "gloo"
    """How the state travels to a new member: over the generation's group, or over mutual-TLS connections."""
    handoff_overlap: bool = True
    """Over the group, a data-parallel handoff sends the model first and streams the optimizer's state beside the
    replayed step's forward and backward passes (runtime.training.handoff); off: the whole state, then the step."""
    host: str = "127.0.0.1"
    """Address the job's store and Gloo listen on (that address only)."""
    fork_server: bool = True
    """Fork training processes from a zygote that imported torch once (runtime.host.zygote), on one machine and on every
    agent's host alike: a replacement standby starts in milliseconds instead of seconds, and a host imports torch once
    for all its processes. Gloo only; without it (or when the zygote fails) processes start as usual."""
    agent_heartbeat_s: float = 0.5
    """Beats each way on every agent link."""
    host_timeout_s: float = 3.0
    """A host whose agent is silent this long is lost, with every process on it."""
    host_settle_s: float = 0.05
    """Across hosts, after a process is lost, how long the coordinator waits for more losses before it replaces them:
    hosts failing together (a rack, a switch) are seen within milliseconds, and their ranks then move in one
    generation."""
    agents_wait_s: float = 120.0
    """How long the coordinator waits for its agents to join."""
    agent_connect_timeout_s: float = 60.0
    """How long an agent keeps trying to reach its coordinator, at start and after being fenced."""
    backup_every: int = 100
    """With a backup directory: committed steps between persistent backups (runtime.training.backup)."""
    backup_keep: int = 3
    """With a backup directory: how many of the newest backups are kept."""
    shrink: ShrinkMode = "accumulate"
    """When no standby takes a lost rank within the standby wait, a data-parallel job continues with fewer members
    (runtime.training.elastic): keeping the global batch by accumulation (accumulate), or with a smaller batch and the
    learning rate scaled by the width (lr-linear) or its square root (lr-sqrt); off: the job stops."""

    @property
    def agent_lease_s(self) -> float:
        """An agent that hears nothing for this long kills its processes: two beats before the host times out."""
        return self.host_timeout_s - 2 * self.agent_heartbeat_s


KNOBS = Knobs()
"""The defaults: every record's field for one of these knobs is `= KNOBS.<knob>`."""


@dataclass(frozen=True, slots=True)
class Flag:
    """How a record's field appears on a command line (the field's metadata, from `flag`)."""

    name: str
    """--the-option; a name without dashes is a positional argument (its metavar)."""
    help: str
    """What it does; `%(default)s` is replaced with the field's default."""
    group: str = ""
    """Which commands take it: `add_options(parser, cls, group)` adds the fields of that group."""
    metavar: str | None = None
    required: bool = False
    """Required on this command line although the record has a default (`--agents`)."""
    remainder: bool = False
    """A positional that takes every argument left (the script's arguments)."""


def metrics_address(text: str) -> tuple[str, int]:
    """HOST:PORT of `--metrics` (runtime.control.metrics); ValueError saying what to give."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"--metrics must be HOST:PORT (for example 127.0.0.1:9464; port 0 picks a free one), got "
                         f"{text!r}")
    return host.strip("[]"), int(port)


def flag(name: str, help: str, **kw: Any) -> dict[str, Flag]:
    """The metadata of a field that is an option: `field(default=..., metadata=flag("--x", "what it does"))`."""
    return {"flag": Flag(name, help, **kw)}


FORK_SERVER = Flag("--fork-server", "fork training processes from a zygote that imported torch once (Gloo; a "
                                    "replacement standby starts in milliseconds instead of seconds); "
                                    "--no-fork-server starts them as new interpreters")
"""One flag, one polarity, in every command that has it (`trainmover run` and `trainmover agent`)."""

_Record = TypeVar("_Record")


def flags_of(cls: type) -> list[tuple[dataclasses.Field[Any], Flag]]:
    """The fields of `cls` that are options, in order."""
    return [(f, f.metadata["flag"]) for f in dataclasses.fields(cls) if "flag" in f.metadata]


def _argument_type(hint: Any) -> dict[str, Any]:
    """argparse's type, choices or action for a field annotated `hint`."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    if typing.get_origin(hint) is Literal:
        return {"choices": list(typing.get_args(hint))}
    if hint is bool:
        return {"action": argparse.BooleanOptionalAction}
    if hint in (int, float, str):
        return {"type": hint}
    raise TypeError(f"no command-line type for {hint!r}")


def add_options(parser: argparse.ArgumentParser, cls: type, group: str = "") -> None:
    """One option per field of `cls` flagged for `group`: its name, default, type, choices and help from the
    record. A field with a default factory (`job_id`) defaults to None on the command line: the record's own."""
    hints = typing.get_type_hints(cls)
    for f, fl in flags_of(cls):
        if fl.group != group:
            continue
        if fl.remainder:
            parser.add_argument(f.name, nargs=argparse.REMAINDER, metavar=fl.name, help=fl.help)
            continue
        if not fl.name.startswith("-"):
            parser.add_argument(f.name, metavar=fl.name, help=fl.help, **_argument_type(hints[f.name]))
            continue
        kw = _argument_type(hints[f.name])
        if fl.required:
            kw["required"] = True
        elif f.default is not dataclasses.MISSING:
            kw["default"] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            kw["default"] = None
        else:
            kw["required"] = True
        if fl.metavar is not None:
            kw["metavar"] = fl.metavar
        on_off = f" (default: {'on' if kw.get('default') else 'off'})" if hints[f.name] is bool else ""
        parser.add_argument(fl.name, dest=f.name, help=fl.help + on_off, **kw)


def from_namespace(cls: type[_Record], ns: argparse.Namespace, **rest: Any) -> _Record:
    """`cls` from the options `add_options` added (whichever groups this command has) and `rest`."""
    values: dict[str, Any] = {}
    for f, fl in flags_of(cls):
        if not hasattr(ns, f.name):
            continue
        value = getattr(ns, f.name)
        if value is None and f.default_factory is not dataclasses.MISSING:
            continue  # left out: the record's own default
        values[f.name] = tuple(value) if fl.remainder else value
    return cls(**values, **rest)


ENV_STORE_HOST = "TM_STORE_HOST"
ENV_STORE_PORT = "TM_STORE_PORT"
ENV_JOB_ID = "TM_JOB_ID"
ENV_JOB_TOKEN = "TM_JOB_TOKEN"  # a secret: never logged, never written to events
ENV_PROC = "TM_PROC"
ENV_ROLE = "TM_ROLE"
ENV_BACKEND = "TM_BACKEND"
ENV_THREADS = "TM_NUM_THREADS"
ENV_FAULTS = "TM_FAULTS"
ENV_HEARTBEAT_S = "TM_HEARTBEAT_S"
ENV_RECOVERY_TIMEOUT_S = "TM_RECOVERY_TIMEOUT_S"
ENV_COLLECTIVE_TIMEOUT_S = "TM_COLLECTIVE_TIMEOUT_S"
ENV_CHUNK_BYTES = "TM_CHUNK_BYTES"
ENV_HANDOFF_OVERLAP = "TM_HANDOFF_OVERLAP"
ENV_CONNECT_TIMEOUT_S = "TM_CONNECT_TIMEOUT_S"
ENV_HANDOFF_TRANSPORT = "TM_HANDOFF_TRANSPORT"
ENV_TLS_CERT = "TM_TLS_CERT"
ENV_TLS_KEY = "TM_TLS_KEY"  # a path; the key file is mode 600
ENV_TLS_CA = "TM_TLS_CA"
ENV_BIND_HOST = "TM_BIND_HOST"
ENV_BACKUP_DIR = "TM_BACKUP_DIR"
ENV_BACKUP_EVERY = "TM_BACKUP_EVERY"
ENV_BACKUP_KEEP = "TM_BACKUP_KEEP"
ENV_RESUME_FROM = "TM_RESUME_FROM"
ENV_SHRINK = "TM_SHRINK"
ENV_HOT_STANDBYS = "TM_HOT_STANDBYS"


class LaunchError(RuntimeError):
    """The process was not started the way the runtime needs; the message says how to start it."""


@dataclass(frozen=True, slots=True)
class ProcessConfig:
    """Everything one training process (worker or standby) is told by its launcher."""

    store_host: str
    """Host of the coordinator's key-value store (torch TCPStore)."""
    store_port: int
    """Port of that store."""
    job_id: str
    """Name of the job; part of every proof of membership."""
    job_token: str
    """Shared secret a process proves it holds before it receives state. Never logged."""
    proc: str
    """This process's name in the job: w0, w1, ... for workers started as such, s0, s1, ... for standbys."""
    role: Role
    """worker: holds a logical rank from the start; standby: waits, warm, until promoted."""
    backend: Backend = KNOBS.backend
    """Collective backend: gloo (CPU tensors) or nccl (CUDA tensors)."""
    num_threads: int = 1
    """torch intra-op threads. Equal in every process: a different count changes floating-point results."""
    faults: str = ""
    """Fault-injection plan (see runtime.faults); empty in production."""
    heartbeat_s: float = KNOBS.heartbeat_s
    recovery_timeout_s: float = KNOBS.recovery_timeout_s
    collective_timeout_s: float = KNOBS.collective_timeout_s
    chunk_bytes: int = KNOBS.chunk_bytes
    connect_timeout_s: float = KNOBS.connect_timeout_s
    handoff_transport: Transport = KNOBS.handoff_transport
    handoff_overlap: bool = KNOBS.handoff_overlap
    hot_standbys: int = KNOBS.hot_standbys
    """Hot slots of the job (runtime.training.hot): a standby claims one, the member at rank slot % world serves it."""
    tls_cert: str = ""
    """The job's TLS certificate (tls transport): what every member presents."""
    tls_key: str = ""
    """Its private key file."""
    tls_ca: str = ""
    """The certificate(s) a peer's certificate must chain to; default: the job's certificate itself."""
    bind_host: str = KNOBS.host
    """The address this process listens on (a TLS source's handoff socket)."""
    backup_dir: str = ""
    """Where rank 0 writes persistent backups (runtime.training.backup); empty: none."""
    backup_every: int = KNOBS.backup_every
    backup_keep: int = KNOBS.backup_keep
    resume_from: str = ""
    """A backup (a `step-*` folder, or the newest in a backup directory) the job starts from; empty: step 0."""
    shrink: ShrinkMode = KNOBS.shrink
    """How a shrunk generation trains (runtime.training.elastic)."""

    def __repr__(self) -> str:  # the token must never reach a log through a repr
        return (f"ProcessConfig(job_id={self.job_id!r}, proc={self.proc!r}, role={self.role!r}, "
                f"backend={self.backend!r})")

    def to_env(self) -> dict[str, str]:
        return {
            ENV_STORE_HOST: self.store_host,
            ENV_STORE_PORT: str(self.store_port),
            ENV_JOB_ID: self.job_id,
            ENV_JOB_TOKEN: self.job_token,
            ENV_PROC: self.proc,
            ENV_ROLE: self.role,
            ENV_BACKEND: self.backend,
            ENV_THREADS: str(self.num_threads),
            ENV_FAULTS: self.faults,
            ENV_HEARTBEAT_S: repr(self.heartbeat_s),
            ENV_RECOVERY_TIMEOUT_S: repr(self.recovery_timeout_s),
            ENV_COLLECTIVE_TIMEOUT_S: repr(self.collective_timeout_s),
            ENV_CHUNK_BYTES: str(self.chunk_bytes),
            ENV_HANDOFF_OVERLAP: "1" if self.handoff_overlap else "0",
            ENV_HOT_STANDBYS: str(self.hot_standbys),
            ENV_CONNECT_TIMEOUT_S: repr(self.connect_timeout_s),
            ENV_HANDOFF_TRANSPORT: self.handoff_transport,
            ENV_TLS_CERT: self.tls_cert,
            ENV_TLS_KEY: self.tls_key,
            ENV_TLS_CA: self.tls_ca,
            ENV_BIND_HOST: self.bind_host,
            ENV_BACKUP_DIR: self.backup_dir,
            ENV_BACKUP_EVERY: str(self.backup_every),
            ENV_BACKUP_KEEP: str(self.backup_keep),
            ENV_RESUME_FROM: self.resume_from,
            ENV_SHRINK: self.shrink,
        }

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> ProcessConfig:
        env = os.environ if env is None else env
        missing = [k for k in (ENV_STORE_HOST, ENV_STORE_PORT, ENV_JOB_ID, ENV_JOB_TOKEN, ENV_PROC) if k not in env]
        if missing:
            raise LaunchError(
                "this script uses the TrainMover runtime but was not started by its launcher "
                f"(missing {', '.join(missing)}). Start it with: trainmover run --nproc N --standby K SCRIPT [ARGS...]"
            )
        role = env.get(ENV_ROLE, "worker")
        backend = env.get(ENV_BACKEND, KNOBS.backend)
        if role not in ("worker", "standby"):
            raise LaunchError(f"{ENV_ROLE}={role!r}: expected worker or standby")
        if backend not in ("gloo", "nccl"):
            raise LaunchError(f"{ENV_BACKEND}={backend!r}: expected gloo or nccl")
        shrink = env.get(ENV_SHRINK, KNOBS.shrink)
        if shrink not in typing.get_args(ShrinkMode):
            raise LaunchError(f"{ENV_SHRINK}={shrink!r}: expected one of {', '.join(typing.get_args(ShrinkMode))}")
        transport = env.get(ENV_HANDOFF_TRANSPORT, KNOBS.handoff_transport)
        if transport not in ("gloo", "tls"):
            raise LaunchError(f"{ENV_HANDOFF_TRANSPORT}={transport!r}: expected gloo or tls")
        try:
            return cls(
                store_host=env[ENV_STORE_HOST],
                store_port=int(env[ENV_STORE_PORT]),
                job_id=env[ENV_JOB_ID],
                job_token=env[ENV_JOB_TOKEN],
                proc=env[ENV_PROC],
                role=role,  # type: ignore[arg-type]
                backend=backend,  # type: ignore[arg-type]
                num_threads=int(env.get(ENV_THREADS, "1")),
                faults=env.get(ENV_FAULTS, ""),
                heartbeat_s=float(env.get(ENV_HEARTBEAT_S, KNOBS.heartbeat_s)),
                recovery_timeout_s=float(env.get(ENV_RECOVERY_TIMEOUT_S, KNOBS.recovery_timeout_s)),
                collective_timeout_s=float(env.get(ENV_COLLECTIVE_TIMEOUT_S, KNOBS.collective_timeout_s)),
                chunk_bytes=int(env.get(ENV_CHUNK_BYTES, KNOBS.chunk_bytes)),
                handoff_overlap=env.get(ENV_HANDOFF_OVERLAP, "1" if KNOBS.handoff_overlap else "0") != "0",
                hot_standbys=int(env.get(ENV_HOT_STANDBYS, KNOBS.hot_standbys)),
                connect_timeout_s=float(env.get(ENV_CONNECT_TIMEOUT_S, KNOBS.connect_timeout_s)),
                handoff_transport=transport,  # type: ignore[arg-type]
                tls_cert=env.get(ENV_TLS_CERT, ""),
                tls_key=env.get(ENV_TLS_KEY, ""),
                tls_ca=env.get(ENV_TLS_CA, ""),
                bind_host=env.get(ENV_BIND_HOST, env[ENV_STORE_HOST]),
                backup_dir=env.get(ENV_BACKUP_DIR, ""),
                backup_every=int(env.get(ENV_BACKUP_EVERY, KNOBS.backup_every)),
                backup_keep=int(env.get(ENV_BACKUP_KEEP, KNOBS.backup_keep)),
                resume_from=env.get(ENV_RESUME_FROM, ""),
                shrink=shrink,  # type: ignore[arg-type]
            )
        except ValueError as exc:
            raise LaunchError(f"malformed TrainMover launch variable: {exc}") from None


class ConfigError(ValueError):
    """A launch setting a user got wrong; the message says what to change."""


@dataclass(frozen=True, slots=True)
class LaunchConfig:
    """Everything `trainmover run` takes (runtime.launcher runs it); its command line is made of these fields
    (group "": `run` and `coordinator`; "local": `run` alone; "hosts": `coordinator` alone)."""

    script: str = field(metadata=flag("script", "training script"))
    """The training script (run with this Python interpreter)."""
    args: tuple[str, ...] = field(default=(), metadata=flag("script_args", "arguments for the script", remainder=True))
    """Arguments passed to the script."""
    nproc: int = field(default=KNOBS.nproc, metadata=flag(
        "--nproc", "number of workers (logical data-parallel ranks; default %(default)s)"))
    standby: int = field(default=KNOBS.standby, metadata=flag(
        "--standby", "number of warm standby processes (default %(default)s)"))
    hot_standbys: int = field(default=KNOBS.hot_standbys, metadata=flag(
        "--hot-standbys", "of the standbys, how many mirror the state every step, so that their takeover moves "
                          "nothing (data-parallel jobs; at most the standbys there are; default %(default)s)"))
    backend: Backend = field(default=KNOBS.backend, metadata=flag(
        "--backend", "gloo (CPU) or nccl (one GPU per process: workers and standbys alike; default %(default)s)"))
    events_path: str | None = field(default=None, metadata=flag(
        "--events", "write membership and recovery events as JSON lines", metavar="FILE"))
    metrics: str | None = field(default=None, metadata=flag(
        "--metrics", "serve the job's Prometheus metrics at http://HOST:PORT/metrics while it runs (docs/metrics.md; "
        "needs the metrics extra)", metavar="HOST:PORT"))
    rank_logs: str | None = field(default=None, metadata=flag(
        "--rank-logs", "collect every process's output here, one file per rank that follows the rank across "
        "failovers (rank-R.log; standby-NAME.log before a promotion)", metavar="DIR"))
    hang_timeout_s: float = field(default=KNOBS.hang_timeout_s, metadata=flag(
        "--hang-timeout", "heartbeat silence after which a worker is declared hung and fenced (default %(default)s s)",
        metavar="S"))
    heartbeat_s: float = KNOBS.heartbeat_s
    standby_wait_s: float = field(default=KNOBS.standby_wait_s, metadata=flag(
        "--standby-wait", "with no standby ready, how long to wait for one before shrinking (--shrink) or stopping "
                          "(default %(default)s s)",
        metavar="S"))
    shrink: ShrinkMode = field(default=KNOBS.shrink, metadata=flag(
        "--shrink", "when no standby takes a lost rank within --standby-wait: continue with fewer members, keeping "
                    "the global batch by accumulation (accumulate), or with a smaller batch and the learning rate "
                    "scaled linearly (lr-linear) or by the square root (lr-sqrt) of the width; grow back when a "
                    "standby is ready. off: stop the job (default %(default)s; data-parallel jobs)"))
    replenish: bool = field(default=KNOBS.replenish, metadata=flag(
        "--replenish", "start a replacement standby whenever one is promoted or lost"))
    num_threads: int | None = field(default=None, metadata=flag(
        "--threads", "torch threads per process, equal everywhere for bit-exact replays (default cores / nproc)"))
    faults: str = field(default="", metadata=flag(
        "--faults", "fault-injection plan (runtime.faults), e.g. 'kill:rank=1,step=5,phase=exchange'"))
    chaos: str = field(default="", metadata=flag(
        "--chaos", "random faults the coordinator injects (runtime.control.chaos), e.g. "
                   "'seed=1,every_s=1.5,max=100,signals=kill|stop'", metavar="SPEC"))
    host: str = field(default=KNOBS.host, metadata=flag(
        "--host", "address the job's store and Gloo listen on, and only there (default %(default)s)"))
    secret: str | None = field(default=None, repr=False)
    """The job's secret, which signs every control record and proves membership. Default: the
    `TRAINMOVER_JOB_SECRET` environment variable, else the contents of `secret_file`, else a fresh one."""
    secret_file: str | None = field(default=None, metadata=flag(
        "--secret-file", "the job's secret (mode 600), which an orchestrator needs to steer the job; created with a "
                         "fresh secret if absent. Default: $TRAINMOVER_JOB_SECRET, else a secret no one else knows",
        metavar="FILE"))
    port: int = field(default=0, metadata=flag(
        "--port", "coordinator store port, where an orchestrator steers the job with runtime.wire.control.JobControl "
                  "(default: a free one, named in the job_started event)"))
    recovery_timeout_s: float = KNOBS.recovery_timeout_s
    chunk_bytes: int = KNOBS.chunk_bytes
    job_id: str = field(default_factory=lambda: uuid.uuid4().hex[:12], metadata=flag(
        "--job-id", "the job's id, which agents started with --job-id must name (default: a fresh random one)",
        group="hosts"))
    """Name of the job, in events and proofs."""
    quiet: bool = field(default=False, metadata=flag("--quiet", "log errors only"))
    wait_for_standbys: bool = field(default=KNOBS.wait_for_standbys, metadata=flag(
        "--wait-for-standbys", "start training only once every standby is warm (the first failure is then covered)"))
    handoff_transport: Transport = field(default=KNOBS.handoff_transport, metadata=flag(
        "--handoff-transport", "how the state reaches a new member: over the Gloo/NCCL group (gloo: fast, not "
                               "encrypted), or over mutual TLS (tls: encrypted; for standbys across a trust "
                               "boundary); default %(default)s"))
    handoff_overlap: bool = field(default=KNOBS.handoff_overlap, metadata=flag(
        "--handoff-overlap", "over the group, send a new member the model first and stream the optimizer's state "
                             "beside the replayed step (data-parallel jobs; default on)"))
    tls_cert: str | None = field(default=None, metadata=flag(
        "--tls-cert", "with tls: the job's certificate every member presents (default: a fresh one per job)",
        metavar="PEM"))
    tls_key: str | None = field(default=None, metadata=flag(
        "--tls-key", "with tls: its private key (mode 600)", metavar="PEM"))
    tls_ca: str | None = field(default=None, metadata=flag(
        "--tls-ca", "with tls: what peers' certificates must chain to (default: the job's certificate)",
        metavar="PEM"))
    backup_dir: str | None = field(default=None, metadata=flag(
        "--backup-dir", "write persistent backups here (rank 0, every --backup-every steps, beside training): "
                        "used only when every copy of the state is lost, and by --resume-from. Across hosts, a "
                        "directory every host mounts at this path, s3://BUCKET/PREFIX (data-parallel jobs; "
                        "boto3's credentials) or az://CONTAINER/PREFIX (data-parallel jobs; "
                        "AZURE_STORAGE_CONNECTION_STRING or AZURE_STORAGE_ACCOUNT_URL)", metavar="DIR"))
    backup_every: int = field(default=KNOBS.backup_every, metadata=flag(
        "--backup-every", "with --backup-dir: committed steps between backups (default %(default)s)", metavar="N"))
    backup_keep: int = field(default=KNOBS.backup_keep, metadata=flag(
        "--backup-keep", "with --backup-dir: how many of the newest backups to keep (default %(default)s)",
        metavar="N"))
    resume_from: str | None = field(default=None, metadata=flag(
        "--resume-from", "start from a backup: a step-* folder, or the newest in a --backup-dir directory, "
                         "s3:// or az:// prefix",
        metavar="PATH"))
    agents: int = field(default=0, metadata=flag(
        "--agents", "hosts to wait for before starting", group="hosts", metavar="N", required=True))
    """0: every process runs on this machine. N > 0: the coordinator alone; it waits for N agents
    (`trainmover agent`, one per host) and places every process in their slots, never starting one itself."""
    agent_port: int = field(default=0, metadata=flag(
        "--agent-port", "port the agents connect to (default: a free one, named in the job_started event)",
        group="hosts"))
    host_timeout_s: float = field(default=KNOBS.host_timeout_s, metadata=flag(
        "--host-timeout", "an agent silent this long loses its host and every process on it (default %(default)s s)",
        group="hosts", metavar="S"))
    host_settle_s: float = field(default=KNOBS.host_settle_s, metadata=flag(
        "--host-settle", "after a loss, wait this long for more before replacing: hosts lost within it move in one "
        "generation (default %(default)s s)", group="hosts", metavar="S"))
    agent_heartbeat_s: float = KNOBS.agent_heartbeat_s
    """With --agents: an agent's lease is host_timeout - 2 beats."""
    agents_wait_s: float = field(default=KNOBS.agents_wait_s, metadata=flag(
        "--agents-wait", "how long to wait for the agents to join (default %(default)s s)", group="hosts",
        metavar="S"))
    store: str = field(default="", metadata=flag(
        "--store", "use the job's store that `trainmover store` serves at HOST:PORT instead of one in this process: "
                   "the job then outlives this coordinator, and another can take it over (--takeover)",
        group="hosts", metavar="HOST:PORT"))
    takeover: bool = field(default=False, metadata=flag(
        "--takeover", "take over the job that runs on --store once its coordinator is gone (its lease unrenewed for "
                      "the agents' lease), adopting the processes its agents re-attach with; same script, --nproc "
                      "and --job-id as the job was started with", group="hosts"))
    fork_server: bool = field(default=KNOBS.fork_server, metadata={"flag": dataclasses.replace(FORK_SERVER,
                                                                                             group="local")})
    """For the one machine's agent (group "local": `run` alone; across hosts each agent has its own)."""

    def validate(self) -> None:
        if self.nproc < 1:
            raise ConfigError(f"--nproc must be at least 1, got {self.nproc}")
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}", self.job_id):
            raise ConfigError(f"--job-id must be 1-64 letters, digits, '.', '_' or '-', got {self.job_id!r}")
        if self.standby < 0:
            raise ConfigError(f"--standby must be 0 or more, got {self.standby}")
        if self.hot_standbys < 0:
            raise ConfigError(f"--hot-standbys must be 0 or more (of the standbys there are, how many mirror the "
                              f"state), got {self.hot_standbys}")
        if self.backend not in ("gloo", "nccl"):
            raise ConfigError(f"--backend must be gloo or nccl, got {self.backend!r}")
        if self.agents < 0:
            raise ConfigError(f"--agents must be 0 (this machine) or the number of hosts, got {self.agents}")
        if self.agents == 0 and not Path(self.script).is_file():
            raise ConfigError(f"training script {self.script!r} does not exist")
        if self.agents and self.handoff_transport == "tls" and self.tls_cert is None:
            raise ConfigError("--handoff-transport tls across hosts needs --tls-cert and --tls-key files at the same "
                              "path on every host (a per-job certificate made here would not be on the hosts)")
        if self.agents:
            try:
                self.host_timing().validate()
            except ValueError as exc:
                raise ConfigError(str(exc)) from None
        if self.metrics is not None:
            try:
                metrics_address(self.metrics)
            except ValueError as exc:
                raise ConfigError(str(exc)) from None
        if self.store and not self.agents:
            raise ConfigError("--store is for a coordinator across hosts (--agents N): on one machine the agent runs "
                              "in the coordinator's process, so nothing could outlive it")
        if self.store:
            host, sep, port = self.store.rpartition(":")
            if not sep or not host or not port.isdigit() or not 0 < int(port) <= 65535:
                raise ConfigError(f"--store must be HOST:PORT (where `trainmover store` listens), got {self.store!r}")
        if self.takeover and not self.store:
            raise ConfigError("--takeover needs --store: the job to take over lives in the store that outlived its "
                              "coordinator")
        if not 0 <= self.agent_port <= 65535:
            raise ConfigError(f"--agent-port must be a TCP port (0 picks a free one), got {self.agent_port}")
        if self.hang_timeout_s <= self.heartbeat_s * 2:
            raise ConfigError(
                f"--hang-timeout ({self.hang_timeout_s} s) must exceed two heartbeats ({2 * self.heartbeat_s} s), "
                "or healthy workers would be declared hung"
            )
        try:
            socket.getaddrinfo(self.host, None, type=socket.SOCK_STREAM)
        except OSError:
            raise ConfigError(f"--host {self.host!r} is not an address of this machine") from None
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"--port must be a TCP port (0 picks a free one), got {self.port}")
        if self.standby_wait_s < 0:
            raise ConfigError(f"--standby-wait must be 0 or more seconds, got {self.standby_wait_s}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ConfigError(f"--threads must be 1 or more torch threads per process, got {self.num_threads}; "
                              "leave it out for cores / nproc")
        if self.handoff_transport not in ("gloo", "tls"):
            raise ConfigError(f"--handoff-transport must be gloo or tls, got {self.handoff_transport!r}")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ConfigError("--tls-cert and --tls-key go together (or leave both out for a per-job certificate)")
        for opt, path in (("--tls-cert", self.tls_cert), ("--tls-key", self.tls_key), ("--tls-ca", self.tls_ca)):
            if path is not None and not Path(path).is_file():
                raise ConfigError(f"{opt} {path!r} is not a file")
        if self.handoff_transport == "gloo" and (self.tls_cert or self.tls_ca):
            raise ConfigError("--tls-cert/--tls-ca apply to --handoff-transport tls only")
        if self.backup_every < 1 or self.backup_keep < 1:
            raise ConfigError(f"--backup-every and --backup-keep must be 1 or more, got {self.backup_every} and "
                              f"{self.backup_keep}")
        if self.resume_from is not None and not self.agents and not self.resume_from.startswith(("s3://", "az://")) \
                and not Path(self.resume_from).exists():
            raise ConfigError(f"--resume-from {self.resume_from!r} does not exist: name a --backup-dir directory or "
                              "one of its step-* folders")
        from runtime.control.chaos import parse_chaos
        from runtime.faults import parse_plan

        try:
            plan = parse_plan(self.faults)
            parse_chaos(self.chaos)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        if not self.agents and any(f.action == "host" for f in plan):
            raise ConfigError("the fault action host kills a whole host (its agent and every process on it): it needs "
                              "hosts of their own (--agents with `trainmover agent`); on one machine use kill")
        if self.backend == "nccl":
            import torch

            needed = self.nproc + self.standby
            have = torch.cuda.device_count() if torch.cuda.is_available() else 0
            if have < needed:
                raise ConfigError(
                    f"--backend nccl gives each process its own GPU: {needed} processes need {needed} GPUs, "
                    f"this machine has {have}. Use --backend gloo, or fewer workers/standbys."
                )

    def job_secret(self) -> str:
        """The secret from the config, the environment or the secret file (created if absent); never logged."""
        from runtime.wire.auth import ENV_SECRET, check_secret, new_token, read_secret_file, write_secret_file

        try:
            if self.secret is not None:
                return check_secret(self.secret, "the launch config")
            if os.environ.get(ENV_SECRET):
                return check_secret(os.environ[ENV_SECRET], ENV_SECRET)
            if self.secret_file is not None:
                if Path(self.secret_file).exists():
                    return read_secret_file(self.secret_file)
                secret = new_token()
                write_secret_file(self.secret_file, secret)
                return secret
        except (ValueError, OSError) as exc:
            raise ConfigError(str(exc)) from None
        return new_token()

    def host_timing(self) -> HostTiming:
        from runtime.control.hosts import HostTiming

        beat = self.agent_heartbeat_s
        return HostTiming(heartbeat_s=beat, lease_s=self.host_timeout_s - 2 * beat, host_timeout_s=self.host_timeout_s,
                          settle_s=self.host_settle_s)

    def threads(self) -> int:
        return self.num_threads or max(1, (os.cpu_count() or 1) // self.nproc)
