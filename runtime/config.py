"""What a training process learns from its launcher: the job's address, its own name and role, the knobs.

The launcher (`trainmover run`) passes these in environment variables, the way torchrun passes RANK and
MASTER_ADDR. `ProcessConfig.from_env` validates them once, with a message that says what to do.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

Role = Literal["worker", "standby"]
Backend = Literal["gloo", "nccl"]

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
ENV_CONNECT_TIMEOUT_S = "TM_CONNECT_TIMEOUT_S"
ENV_HANDOFF_TRANSPORT = "TM_HANDOFF_TRANSPORT"
ENV_TLS_CERT = "TM_TLS_CERT"
ENV_TLS_KEY = "TM_TLS_KEY"  # a path; the key file is mode 600
ENV_TLS_CA = "TM_TLS_CA"
ENV_BIND_HOST = "TM_BIND_HOST"


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
    backend: Backend = "gloo"
    """Collective backend: gloo (CPU tensors) or nccl (CUDA tensors)."""
    num_threads: int = 1
    """torch intra-op threads. Equal in every process: a different count changes floating-point results."""
    faults: str = ""
    """Fault-injection plan (see runtime.faults); empty in production."""
    heartbeat_s: float = 0.25
    """Interval of the heartbeat the coordinator watches to detect hangs."""
    recovery_timeout_s: float = 120.0
    """How long a member waits for the coordinator to form the next generation before giving up."""
    collective_timeout_s: float = 600.0
    """Gloo/NCCL timeout of a collective. Long on purpose: hangs are caught by heartbeats and fenced,
    so a short timeout would only add false alarms when ranks drift apart (evaluation, checkpoint writes)."""
    chunk_bytes: int = 64 << 20
    """Largest message of a state handoff; bigger tensors are streamed in slices of this size."""
    connect_timeout_s: float = 30.0
    """Longest wait to connect a generation's group (a member lost while connecting costs at most this)."""
    handoff_transport: Literal["gloo", "tls"] = "gloo"
    """How the state travels in a handoff: over the generation's group, or over mutual-TLS connections."""
    tls_cert: str = ""
    """The job's TLS certificate (tls transport): what every member presents."""
    tls_key: str = ""
    """Its private key file."""
    tls_ca: str = ""
    """The certificate(s) a peer's certificate must chain to; default: the job's certificate itself."""
    bind_host: str = "127.0.0.1"
    """The address this process listens on (a TLS source's handoff socket)."""

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
            ENV_CONNECT_TIMEOUT_S: repr(self.connect_timeout_s),
            ENV_HANDOFF_TRANSPORT: self.handoff_transport,
            ENV_TLS_CERT: self.tls_cert,
            ENV_TLS_KEY: self.tls_key,
            ENV_TLS_CA: self.tls_ca,
            ENV_BIND_HOST: self.bind_host,
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
        backend = env.get(ENV_BACKEND, "gloo")
        if role not in ("worker", "standby"):
            raise LaunchError(f"{ENV_ROLE}={role!r}: expected worker or standby")
        if backend not in ("gloo", "nccl"):
            raise LaunchError(f"{ENV_BACKEND}={backend!r}: expected gloo or nccl")
        transport = env.get(ENV_HANDOFF_TRANSPORT, "gloo")
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
                heartbeat_s=float(env.get(ENV_HEARTBEAT_S, "0.25")),
                recovery_timeout_s=float(env.get(ENV_RECOVERY_TIMEOUT_S, "120")),
                collective_timeout_s=float(env.get(ENV_COLLECTIVE_TIMEOUT_S, "600")),
                chunk_bytes=int(env.get(ENV_CHUNK_BYTES, str(64 << 20))),
                connect_timeout_s=float(env.get(ENV_CONNECT_TIMEOUT_S, "30")),
                handoff_transport=transport,  # type: ignore[arg-type]
                tls_cert=env.get(ENV_TLS_CERT, ""),
                tls_key=env.get(ENV_TLS_KEY, ""),
                tls_ca=env.get(ENV_TLS_CA, ""),
                bind_host=env.get(ENV_BIND_HOST, env[ENV_STORE_HOST]),
            )
        except ValueError as exc:
            raise LaunchError(f"malformed TrainMover launch variable: {exc}") from None
