"""The job's metrics for Prometheus (`trainmover run --metrics HOST:PORT`): what the events file says, as counters,
summaries and gauges, served at `http://HOST:PORT/metrics` while the coordinator runs (docs/metrics.md).

Every figure comes from an event as the coordinator writes it (`JobMetrics.observe`, an `EventLog` listener), so a
scrape agrees with the events file: a recovery's `recovery_s` and its parts are added to summaries exactly, each
count is one event. The one live figure the events do not carry, the step the members committed last, is read by
the coordinator at its health tick (`JobMetrics.committed`). Names follow Prometheus's conventions: a `trainmover_`
prefix, base units (`_seconds`, `_bytes`), `_total` for counters, few label values.

The official client (`prometheus_client`, the `metrics` extra) is imported only when metrics are asked for.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from runtime.wire.event_records import (
    AgentRefused,
    ControlRejected,
    Coverage,
    Event,
    GenerationStarted,
    Grew,
    HostJoined,
    HostLost,
    JobFailed,
    JobFinished,
    MemberFailed,
    Moved,
    Recovered,
    Shrunk,
    StandbyLost,
    StandbySpawned,
    StandbyTargetChanged,
    StandbyWarm,
    UntrustedValue,
)

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

PHASES = ("detect", "reconfigure", "handoff", "replay", "warmup_penalty")
"""The parts of a recovery (DESIGN.md's metric names), the `phase` label of `trainmover_recovery_phase_seconds`."""
CAUSES = ("exit", "hang", "host", "notice", "move", "other")
"""The `cause` label of `trainmover_recoveries_total`: the first cause of a recovery, in one of these words."""


class MetricsUnavailable(RuntimeError):
    """`prometheus_client` is not installed."""


def cause_label(cause: str) -> str:
    """One of `CAUSES` for a recovery's cause as the events write it (a bounded label)."""
    text = cause.lower()
    for word, label in (("hung", "hang"), ("hang", "hang"), ("host", "host"), ("notice", "notice"),
                        ("planned_move", "move"), ("move", "move"), ("exit", "exit"), ("signal", "exit"),
                        ("killed", "exit")):
        if word in text:
            return label
    return "other"


class JobMetrics:
    """The metrics of one job, kept in their own registry; `observe` every event, `committed` the live step."""

    def __init__(self, job_id: str) -> None:
        try:
            from prometheus_client import CollectorRegistry, Counter, Gauge, Summary, disable_created_metrics
        except ImportError as exc:
            raise MetricsUnavailable(
                "--metrics needs the Prometheus client: pip install 'trainmover[metrics]' (prometheus_client)"
            ) from exc
        disable_created_metrics()  # no `_created` series beside each counter and summary (this process's client)
        self.registry: CollectorRegistry = CollectorRegistry()
        r, job = self.registry, {"job_id": job_id}
        self.info = Gauge("trainmover_job_info", "The job this coordinator runs (always 1)", ["job_id"], registry=r)
        self.info.labels(**job).set(1)
        self.up = Gauge("trainmover_job_running", "1 while the job trains, 0 once it finished or failed", registry=r)
        self.generation = Gauge("trainmover_generation", "The current generation's number", registry=r)
        self.workers = Gauge("trainmover_workers", "Members (ranks) of the current generation", registry=r)
        self.step = Gauge("trainmover_committed_step", "The step the members committed last, as their heartbeats "
                          "publish it (a beat behind); its deriv() is the steps per second", registry=r)
        self.recoveries = Counter("trainmover_recoveries", "Recoveries, by their first cause", ["cause"], registry=r)
        self.recovery = Summary("trainmover_recovery_seconds", "Each recovery's recovery_s: from its first failure "
                                "to the commit of the replayed step", registry=r)
        self.phases = Summary("trainmover_recovery_phase_seconds", "The parts of each recovery (detect_s, "
                              "reconfigure_s, handoff_s, replay_s, warmup_penalty_s)", ["phase"], registry=r)
        self.handoff = Counter("trainmover_handoff_bytes", "State moved to the processes that took lost ranks",
                               registry=r)
        self.failures = Counter("trainmover_member_failures", "Workers declared dead", registry=r)
        self.moves = Counter("trainmover_moves", "Planned moves done (ranks handed over between two steps)",
                             registry=r)
        self.resizes = Counter("trainmover_resizes", "Elastic width changes", ["direction"], registry=r)
        self.standbys = Gauge("trainmover_standbys", "Standbys by state (warm: ready to take a rank; warming)",
                              ["state"], registry=r)
        self.standby_target = Gauge("trainmover_standby_target", "The standbys the job keeps", registry=r)
        self.covered = Gauge("trainmover_covered", "1 while a warm standby is there to take a lost rank",
                             registry=r)
        self.standby_events = Counter("trainmover_standby_events", "Standbys started, warm, lost", ["event"],
                                      registry=r)
        self.hosts = Gauge("trainmover_hosts", "Hosts whose agents are in the job", registry=r)
        self.host_events = Counter("trainmover_host_events", "Hosts joined and lost", ["event"], registry=r)
        self.refused = Counter("trainmover_refused", "Values and requests refused: control values and host notices "
                               "(control), untrusted store records (untrusted), agents (agent)", ["kind"], registry=r)
        for phase in PHASES:  # every series exists from the start, at 0
            self.phases.labels(phase=phase)
        for cause in CAUSES:
            self.recoveries.labels(cause=cause)
        for state in ("warm", "warming"):
            self.standbys.labels(state=state)
        for name in ("spawned", "warm", "lost"):
            self.standby_events.labels(event=name)
        for name in ("joined", "lost"):
            self.host_events.labels(event=name)
        for kind in ("control", "untrusted", "agent"):
            self.refused.labels(kind=kind)
        for direction in ("shrink", "grow"):
            self.resizes.labels(direction=direction)
        self.up.set(1)
        self._hosts: set[str] = set()
        self._server: Any = None

    # -- the events ------------------------------------------------------------------------------------------------
    def observe(self, e: Event) -> None:
        """Count one event (called by the event log, one event at a time; scrapes read the registry concurrently, as
        the client allows)."""
        if isinstance(e, GenerationStarted):
            self.generation.set(e.generation)
            self.workers.set(e.world_size)
        elif isinstance(e, Recovered):
            self.recoveries.labels(cause=cause_label(e.causes[0] if e.causes else "")).inc()
            self.recovery.observe(e.recovery_s)
            for phase in PHASES:
                self.phases.labels(phase=phase).observe(float(getattr(e, f"{phase}_s")))
            self.handoff.inc(e.handoff_bytes)
        elif isinstance(e, MemberFailed):
            self.failures.inc()
        elif isinstance(e, Moved):
            self.moves.inc()
            self.handoff.inc(e.handoff_bytes)
        elif isinstance(e, Shrunk | Grew):
            self.resizes.labels(direction="shrink" if isinstance(e, Shrunk) else "grow").inc()
            self.workers.set(e.width_to)
            self.generation.set(e.generation)
        elif isinstance(e, Coverage):
            self.standbys.labels(state="warm").set(e.warm)
            self.standbys.labels(state="warming").set(e.warming)
            self.standby_target.set(e.target)
            self.covered.set(1 if e.covered else 0)
        elif isinstance(e, StandbyTargetChanged):
            self.standby_target.set(e.new)
        elif isinstance(e, StandbySpawned | StandbyWarm | StandbyLost):
            name = {StandbySpawned: "spawned", StandbyWarm: "warm", StandbyLost: "lost"}[type(e)]
            self.standby_events.labels(event=name).inc()
        elif isinstance(e, HostJoined | HostLost):
            (self._hosts.add if isinstance(e, HostJoined) else self._hosts.discard)(e.host)
            self.hosts.set(len(self._hosts))
            self.host_events.labels(event="joined" if isinstance(e, HostJoined) else "lost").inc()
        elif isinstance(e, ControlRejected | UntrustedValue | AgentRefused):
            kind = {ControlRejected: "control", UntrustedValue: "untrusted", AgentRefused: "agent"}[type(e)]
            self.refused.labels(kind=kind).inc()
        elif isinstance(e, JobFinished | JobFailed):
            self.up.set(0)
            if isinstance(e, JobFinished):
                self.step.set(e.step)

    def committed(self, step: int) -> None:
        """The step the members' heartbeats published (the coordinator's health tick)."""
        self.step.set(step)

    # -- the endpoint ----------------------------------------------------------------------------------------------
    def serve(self, host: str, port: int) -> int:
        """Serve `/metrics` on host:port (0: a free port) in a thread of this process; the port it listens on."""
        from prometheus_client import start_http_server

        server, _ = start_http_server(port, addr=host, registry=self.registry)
        self._server = server
        return int(server.server_address[1])

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


__all__ = ["CAUSES", "PHASES", "JobMetrics", "MetricsUnavailable", "cause_label"]
