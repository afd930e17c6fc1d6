"""The supervisor of a resilient training run: where runtime, policy and cloud meet (plain Python, no Prefect).

A `Supervisor` owns one job's life, in the order the flow calls it:

1. `provision`: launch one instance per `slots` workers (one per accelerator of the type, `flows.hosts`; 1 when
   the instances are bookkeeping) and the standby instances the limits ask for (tagged by job and role, through
   any `cloud.base.Provider`).
2. `start`: start the job through the runtime's client (`runtime.client.RuntimeJob`): its coordinator owns
   membership and recovery; the supervisor reads its events and steers it through that client only.
3. `tick`, until `done`: read the coordinator's new events (failures, promotions), feed telemetry to the policy
   (`policy.online.OnlineScorer` -> `policy.decide_standby`), turn the plan into cloud actions
   (`flows.actions.pool_change`, a pure function) and carry them out, turn provider notices into planned moves,
   and order replacement instances. Each tick returns `Happening`s, which the flow turns into Prefect events and
   log lines.
4. `report`: the interruptions table and the cost report (`policy.costs.bill_run`: standby hours and dollars,
   downtime, ETTR, and the same failures priced under checkpoint-restart).
5. `release`: stop the job and terminate every instance it launched; the flow calls it in `finally`.

Every launch and wake-up is first checked against the run's caps (`max_instances`, `max_spend_usd`: the pure
`flows.actions.cap_refusal`, the spend metered by the same clock as the standby hours): one a cap refuses is not
made, and is announced once as `trainmover.job.cap_reached`; the run goes on with what it holds, except that workers
refused at provisioning fail it (`CapReached`) before anything is launched.

All along it keeps the job's holdings record (`flows.holdings`) in its work directory up to date: what it holds now
(the launcher's pid and port, the instances), so that whoever finds the flow run dead without its `finally`
(Prefect's crash and cancellation hooks, `flows.endings`) can say what was left running. A release removes it.

Logic lives here, not in the flow body, so it is tested without a Prefect server.
"""

from __future__ import annotations

import dataclasses
import logging
import socket
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal, Protocol

from cloud.base import CapacityError, CloudError, Instance, LaunchRequest, Provider
from cloud.capacity import launch_with_fallback, wake_or_replace
from flows.actions import CapRefusal, Caps, Held, Pool, PoolChange, cap_refusal, notice_moves, pool_change
from flows.holdings import HOLDINGS_FILE, Holdings, write_holdings
from flows.hosts import JobHosts, free_port, hosts_for
from flows.jobrecord import JobRecord, write_secret
from flows.models import TrainingRun
from flows.timeline import Timeline
from policy.costs import RunBill, TierName, bill_run
from policy.decision import FleetState, decide_standby
from policy.online import NodeScore, OnlineScorer
from policy.telemetry import TelemetrySample
from runtime.client import JobSpec, Placement, RuntimeJob
from runtime.wire.event_records import (
    Coverage,
    Event,
    GenerationStarted,
    HostLost,
    JobFailed,
    JobFinished,
    MemberFailed,
    Moved,
    Placed,
    Recovered,
    StandbyWarm,
)

log = logging.getLogger("trainmover.flows")

EVENT_PREFIX = "trainmover"


class TelemetryFeed(Protocol):
    """Where node telemetry comes from: DCGM/node exporters in production, a scripted feed in the demo."""

    def read(self, now_h: float, nodes: dict[int, str]) -> list[TelemetrySample]:
        """Samples up to `now_h` (hours since the job started) for the nodes holding each rank."""
        ...


@dataclass(frozen=True, slots=True)
class Happening:
    """Something the flow should announce: a Prefect event `trainmover.<resource>.<action>` and a log line."""

    event: str
    resource: str
    message: str
    payload: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Interruption:
    """One recovery, for the interruptions table."""

    cause: str
    rank: int
    old_process: str
    new_process: str
    step: int | None
    detect_s: float
    reconfigure_s: float
    handoff_s: float
    replay_s: float
    lost_time_s: float
    tier: str
    predicted: bool


@dataclass(frozen=True, slots=True)
class RunReport(RunBill):
    """A run's end: its bill (policy.costs.RunBill: standbys, downtime, ETTR, beside checkpoint-restart) and what
    the job did."""

    job_id: str
    exit_code: int
    message: str
    wall_s: float
    steps: int
    interruptions: list[Interruption]
    final_digest: str | None


class CapReached(ValueError):
    """A cap refused launching the workers a run needs (`TrainingRun.max_instances`, `.max_spend_usd`): the run
    fails before anything is launched. `happening` announces it."""

    def __init__(self, refusal: CapRefusal, happening: Happening) -> None:
        super().__init__(refusal.message)
        self.refusal = refusal
        self.happening = happening


HeldKind = Literal["worker", "warm", "stopped"]
"""What an instance held is billed as: a worker (the node price), a running standby or a parked one (its tier's)."""


class Supervisor:
    """One resilient training job from provisioning to release (see the module docstring)."""

    def __init__(
        self,
        run: TrainingRun,
        provider: Provider,
        workdir: Path,
        *,
        feed: TelemetryFeed | None = None,
        scorer: OnlineScorer | None = None,
        policy_every_s: float = 60.0,
        time_scale: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
        owner: str | None = None,
        hosts: JobHosts | None = None,
        owner_lease: str | None = None,
    ) -> None:
        self.run = run
        self.hosts = hosts
        """Set when the job runs on its instances (`TrainingRun.on_instances`, `flows.hosts`): the coordinator runs
        here alone and each instance boots an agent; which instance holds which rank is then read from the
        coordinator's events (`placed`, `generation`), and a lost host's instance is terminated and replaced."""
        self._where: dict[str, str] = {}  # process -> instance (hosts mode)
        self._members: dict[int, str] = {}  # rank -> process of the current generation (hosts mode)
        self._secret: str | None = None
        self.secret_file: Path | None = None
        self._replaying = False  # reading a job's past events on re-attaching: rebuild state, act on nothing
        self._roles: dict[str, str] = {}  # instance -> its role tag
        self.timeline = Timeline()
        """Throughput and standbys over time, for the run's plot (flows.timeline)."""
        self._fallback_notes: list[str] = []  # launches that needed a capacity fallback, announced at the next tick
        self.owner = owner
        self.owner_lease = owner_lease
        """The lease by which the owner holds the job (flows.ownership), kept in the job's record."""
        self.provider = provider
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.events_path = self.workdir / "events.jsonl"
        self.feed = feed
        self.nodes = hosts_for(run.workers, self.slots)
        """The job's worker instances: what its downtime is priced at (unless `run.job_nodes` says otherwise)."""
        self.costs = run.costs(self.nodes)
        # A failure counts as predicted when its node alone made a running standby worth its price.
        offered: list[TierName] = list(self.costs.tiers)
        self._predicted_bar = min(self.costs.threshold(t) for t in ([t for t in offered if t != "stopped"] or offered))
        self.policy_every_s = policy_every_s
        self.time_scale = time_scale
        self.clock = clock
        self._launched: set[str] = set()  # every instance launched and not terminated: what a crash would leave
        self.workers: dict[int, str] = {}  # rank -> instance id
        self.warm: list[str] = []  # running standby instances (warm processes)
        self.parked: list[str] = []  # stopped standby instances
        self.scorer = scorer
        self.fleet = FleetState()
        self.warm_target = 0
        self.job: RuntimeJob | None = None
        """The job, through the runtime's client: its launcher, events and control store."""
        self.events: list[Event] = []
        """Every event of the job read so far, as records (runtime.wire.event_records)."""
        self.interruptions: list[Interruption] = []
        self._started_at: float | None = None
        self._next_policy = 0.0
        self._hot_nodes: set[str] = set()
        self._predicted: dict[str, bool] = {}  # failed process -> whether its node was hot when it failed
        # Ranks waiting for a parked standby woken from the stopped tier -> the instance woken (or launched) for
        # them: held out of the policy's releases until the rank is recovered (releasing it strands the rank).
        self._woken: dict[int, str] = {}
        # Instance-seconds held, per kind, on the monotonic clock: the standby hours of the bill, and (with the
        # workers') the spend that max_spend_usd is checked against.
        self._held_seconds: dict[HeldKind, float] = {"worker": 0.0, "warm": 0.0, "stopped": 0.0}
        self.caps = Caps(run.max_instances, run.max_spend_usd)
        self._capped: set[tuple[str, str]] = set()  # (cap, kind of launch) announced since the last launch went
        self.refusals = 0
        """Launches and wake-ups a cap refused so far."""
        self._last_accrual: float | None = None
        self.steps_done = 0
        self._exit: int | None = None
        self.holdings_path = self.workdir / HOLDINGS_FILE
        self._recorded: Holdings | None = None
        self._remember()

    # -- provisioning --------------------------------------------------------------------------------
    @property
    def slots(self) -> int:
        """Training processes per instance: the hosts' `--slots` when the instances run the job (one per accelerator
        of the type, flows.hosts), else 1 (an instance per process, bookkeeping). `run.workers` ranks take
        `hosts_for(workers, slots)` worker instances. Standbys count whole instances (the limits, the policy's
        plans, `warm_target`), since a host fails whole: the coordinator's standby target is `slots` times that."""
        return self.hosts.slots if self.hosts is not None else 1

    def provision(self, script: Path | None = None) -> list[Happening]:
        """Launch the workers' and the warm standbys' instances. On instances (`hosts`), the job's secret is stored
        for them first and every instance boots `script`'s job agent."""
        run = self.run
        out: list[Happening] = []
        slots = self.slots
        worker_hosts = hosts_for(run.workers, slots)
        # Before anything is made (the job's secret included): workers a cap refuses fail the run here.
        if (refusal := self._cap_refusal(f"launching {worker_hosts} worker instance(s) for {run.workers} rank(s)",
                                         "worker", worker_hosts, also="lower run.workers")) is not None:
            raise CapReached(refusal, self._cap_happening(refusal))
        if self.hosts is not None:
            from runtime.wire.auth import new_token

            if script is None:
                raise ValueError("a job that runs on its instances needs its script at provisioning")
            self._secret = new_token()  # the job's and this supervisor's only: the job obeys no other writer
            self.hosts.prepare(run, self._secret, script)
        workers = self._launch("worker", worker_hosts)
        # Rank r on worker instance r // slots until the coordinator's placements say where it runs (hosts mode).
        self.workers = {rank: workers[rank // slots].instance_id for rank in range(run.workers)}
        try:
            self.warm = [i.instance_id for i in self._launch("standby", run.standby.min_warm)]
        except CapReached as exc:  # not fatal: the job starts without them
            self.warm = []
            out += self._announce_refusal(exc.refusal, "standby")
        self.warm_target = len(self.warm)
        self._key_scorer()
        out.append(
            Happening(
                f"{EVENT_PREFIX}.fleet.provisioned",
                f"{EVENT_PREFIX}.job.{run.job_id}",
                f"{run.provider}: {len(workers)} worker instance(s) for {run.workers} rank(s), {slots} per instance, "
                f"and {len(self.warm)} warm standby instance(s) of {run.instance_type} for job {run.job_id}",
                {"workers": [i.instance_id for i in workers], "standbys": list(self.warm), "slots": slots},
            )
        )
        self._remember()
        return out

    def _launch(self, role: str, count: int, *, kind: HeldKind | None = None, what: str | None = None
                ) -> list[Instance]:
        """Launch `count` instances of `role` (with the capacity fallbacks), held as `kind` (default: "worker" for
        workers, "warm" for standbys); `CapReached` when a cap refuses them, and nothing is launched."""
        if count <= 0:
            return []
        kind = kind or ("worker" if role == "worker" else "warm")
        what = what or f"launching {count} {'parked ' if kind == 'stopped' else ''}{role} instance(s)"
        also = "lower run.workers" if role == "worker" else "lower run.standby's limits (max_warm, max_stopped)"
        if (refusal := self._cap_refusal(what, kind, count, also=also)) is not None:
            raise CapReached(refusal, self._cap_happening(refusal))
        self._accrue(self.clock())  # what was held until now; the first launch starts the meter (it bills from here)
        outcome = launch_with_fallback(self.provider, self._request(role, count), self.run.fallbacks())
        if not outcome.succeeded:
            raise CapacityError(f"no capacity for {count} {role} instance(s): {outcome.summary()}",
                                provider=self.provider.name, code="InsufficientInstanceCapacity")
        if outcome.step != "request":
            self._fallback_notes.append(f"{role} launch fell back: {outcome.summary()}")
        launched = list(outcome.instances)
        self._capped.clear()  # the fleet changed: a later refusal is news again
        # Recorded before anyone keeps the ids: a crash between here and the next record still names them.
        self._launched.update(i.instance_id for i in launched)
        self._roles.update((i.instance_id, role) for i in launched)
        self._remember()
        return launched

    # -- the caps ------------------------------------------------------------------------------------------
    def _prices(self) -> dict[HeldKind, float]:
        """USD per hour of one instance of each kind: workers at the node price, standbys at their tier's."""
        tiers = self.run.tier_prices()
        return {"worker": self.run.node_price_usd_per_h, "warm": tiers["warm"], "stopped": tiers["stopped"]}

    def _held_now(self) -> dict[HeldKind, int]:
        """Instances held now by kind: parked standbys, running standbys, and every other instance (workers)."""
        parked = set(self.parked)
        warm = set(self.warm) - parked
        return {"worker": len(self._launched - warm - parked), "warm": len(warm), "stopped": len(parked)}

    def _meter(self) -> None:
        """Accrue what was held until now, before what is held changes (once the first launch started the meter)."""
        if self._last_accrual is not None:
            self._accrue(self.clock())

    def spent_usd(self) -> float:
        """What the run's instances cost so far (on the run's clock, as the bill), released ones included."""
        self._meter()
        prices = self._prices()
        return sum(s * self.time_scale / 3600.0 * prices[k] for k, s in self._held_seconds.items())

    def held(self) -> Held:
        """What the run holds and has spent, as the caps see it."""
        prices = self._prices()
        now = self._held_now()
        return Held(instances=len(self._launched), usd_per_h=sum(n * prices[k] for k, n in now.items()),
                    spent_usd=self.spent_usd())

    def _cap_refusal(self, what: str, kind: HeldKind, instances: int, *, also: str = "",
                     usd_per_h: float | None = None) -> CapRefusal | None:
        """Whether the caps refuse `what`: `instances` more instances held as `kind` (or `usd_per_h` more)."""
        if self.caps == Caps():
            return None
        cost = usd_per_h if usd_per_h is not None else instances * self._prices()[kind]
        return cap_refusal(self.caps, self.held(), instances=instances, usd_per_h=cost, what=what, also=also)

    def _cap_happening(self, refusal: CapRefusal) -> Happening:
        return Happening(f"{EVENT_PREFIX}.job.cap_reached", f"{EVENT_PREFIX}.job.{self.run.job_id}", refusal.message,
                         refusal.payload())

    def _announce_refusal(self, refusal: CapRefusal, launch: str) -> list[Happening]:
        """The event for a refused launch: once per cap and kind of `launch` until the fleet changes (the policy
        asks again at every decision), a log line otherwise."""
        self.refusals += 1
        key = (refusal.cap, launch)
        if key in self._capped:
            log.info("%s", refusal.message)
            return []
        self._capped.add(key)
        return [self._cap_happening(refusal)]

    def _key_scorer(self) -> None:
        """Score the nodes that hold the ranks now (a scorer made before they existed, e.g. with a trained model,
        is re-keyed by them)."""
        nodes = list(dict.fromkeys(self.workers.values()))  # a host of several slots holds several ranks
        if self.scorer is None:
            self.scorer = OnlineScorer(nodes)
        else:
            self.scorer = OnlineScorer(
                nodes, model=self.scorer.model, horizon_h=self.scorer.horizon_h,
                base_p_horizon=self.scorer.base_p_horizon, window_h=self.scorer.window_h,
            )

    def _request(self, role: str, count: int) -> LaunchRequest:
        return LaunchRequest(
            job_id=self.run.job_id,
            role=role,  # type: ignore[arg-type]
            instance_type=self.run.instance_type,
            count=count,
            market=self.run.market,
            capacity_reservation=self.run.capacity_reservation,
            capacity_block=self.run.capacity_block,
            **(self.hosts.launch_options() if self.hosts is not None else {}),
        )

    # -- the holdings record -------------------------------------------------------------------------
    def holdings(self) -> Holdings:
        """What this supervisor holds now: its launcher (while it runs) and every instance it launched and did
        not terminate."""
        job = self.job
        return Holdings(
            job_id=self.run.job_id,
            owner=self.owner,
            host=socket.gethostname(),
            workdir=str(self.workdir),
            launcher_pid=job.pid if job is not None and job.running() else None,
            port=job.port if job is not None else 0,
            instances=tuple(sorted(self._launched)),
        )

    def _remember(self) -> None:
        """Rewrite the holdings record when what is held changed (atomically: a reader never sees half)."""
        now = self.holdings()
        if now == self._recorded:
            return
        try:
            write_holdings(self.holdings_path, now)
        except OSError as exc:  # the record is for a post-mortem; the job goes on without it
            log.warning("could not write %s: %s", self.holdings_path, exc)
            return
        self._recorded = now

    # -- the job -------------------------------------------------------------------------------------
    def spec(self, script: Path) -> JobSpec:
        """The job as the runtime runs it."""
        run = self.run
        # The policy's hot tier: up to max_hot of the standby processes mirror the state (hot slots are fixed when the
        # job starts); the policy's hot and warm standbys are both standby processes of the pool.
        return JobSpec(script=script, workers=run.workers, standby=self.warm_target * self.slots,
                       script_args=tuple(run.script_args), backend=run.backend, faults=run.faults, steps=run.steps,
                       hot_standbys=run.standby.max_hot * self.slots)

    def start(self, script: Path) -> None:
        """Start the job: on this machine the runtime's launcher hosts the coordinator and every process; on
        instances the coordinator runs here alone and waits for the instances' agents."""
        from runtime.wire.auth import new_token

        placement: Placement | None = None
        if self.hosts is not None:
            assert self._secret is not None, "provision() first"
            secret = self._secret
            placement = self.hosts.placement(self.run, agents=len(self._launched))
        else:
            secret = new_token()  # the job's and this supervisor's only: the job obeys no other writer of its store
        # For a run that re-attaches after this one's process died (flows.jobrecord): root-only, on this host.
        self.secret_file = write_secret(self.workdir, secret)
        port = 0 if placement is not None else free_port("127.0.0.1")  # placed: the coordinator's own port
        self.job = RuntimeJob.start(self.spec(script), self.events_path, secret=secret, port=port,
                                    log=self.workdir / "job.log", placement=placement)
        self._remember()
        self._started_at = self.clock()
        self._accrue(self._started_at)  # metered since the first launch
        # On instances the job starts once every host joined (up to hosts_wait_s): `tick` connects then.

    def _set_standby_target(self, n: int) -> None:
        """Keep `n` standby instances' worth of standby processes (`slots` each) in the coordinator."""
        if self.job is not None:
            self.job.set_standby_target(n * self.slots)

    def committed_step(self) -> int | None:
        """The last step the job committed, as the runtime publishes it; None before the first or when unknown."""
        step = self.job.committed_step() if self.job is not None else None
        if step is not None:
            self.steps_done = max(self.steps_done, int(step))
            self.timeline.record(time.time(), int(step), len(self.warm), len(self.parked))
        return step

    def done(self) -> bool:
        return self.job is not None and self.job.poll() is not None and self._exit is not None

    # -- a job found again ---------------------------------------------------------------------------
    def job_record(self, credentials_block: str | None = None) -> JobRecord | None:
        """Where this job can be found again (flows.jobrecord), once its launcher runs."""
        job = self.job
        if job is None or self.secret_file is None:
            return None
        run = self.run
        return JobRecord(
            job_id=run.job_id, flow_run_id=self.owner, host=socket.gethostname(), workdir=str(self.workdir),
            launcher_pid=job.pid, store_host=job.host, store_port=job.port,
            secret_file=str(self.secret_file), events=str(self.events_path), provider=run.provider, region=run.region,
            azure_subscription_id=run.azure_subscription_id, azure_resource_group=run.azure_resource_group,
            credentials_block=credentials_block, key_vault_url=run.key_vault_url,
            key_vault_resource_id=run.key_vault_resource_id, on_instances=run.on_instances,
            owner_lease=self.owner_lease, supervised_at=time.time(),
        )

    def attach(self, record: JobRecord) -> list[Happening]:
        """Supervise a job whose supervising run died, from its record: its launcher, its store, its events (read
        from the start to rebuild the interruptions and who holds which rank, acting on none of them), and its
        instances (found by the job's tag)."""
        self.workdir = Path(record.workdir)
        self.events_path = Path(record.events)
        self.holdings_path = self.workdir / HOLDINGS_FILE
        self.secret_file = Path(record.secret_file)
        self.job = RuntimeJob.attach(record.launcher_pid, self.events_path, record.store_host, record.store_port,
                                     record.read_secret())
        instances: list[Instance] = []
        try:
            instances = self.provider.describe(job_id=self.run.job_id)
        except CloudError as exc:
            log.warning("could not list the instances of job %s: %s", self.run.job_id, exc)
        self._launched = {i.instance_id for i in instances}
        self._roles = {i.instance_id: i.role for i in instances}
        # Which instance holds which rank: from the placements in the events on instances; otherwise the worker
        # instances in launch order (as `provision` assigned them), or the ranks' own names for bookkeeping.
        workers = sorted(i.instance_id for i in instances if i.role == "worker")
        slots = self.slots
        self.workers = {r: workers[r // slots] if r // slots < len(workers) else f"rank-{r}"
                        for r in range(self.run.workers)}
        self.warm = sorted(i.instance_id for i in instances if i.role == "standby" and i.state != "stopped")
        self.parked = sorted(i.instance_id for i in instances if i.role == "standby" and i.state == "stopped")
        self.warm_target = len(self.warm)
        self._replaying = True
        try:
            self._read_events()
        finally:
            self._replaying = False
        self._key_scorer()
        self._started_at = self._last_accrual = self.clock()
        self.job.connect()
        self._remember()
        return [Happening(
            f"{EVENT_PREFIX}.job.reattached", f"{EVENT_PREFIX}.job.{self.run.job_id}",
            f"re-attached to job {self.run.job_id} (launcher pid {record.launcher_pid}, store port {record.store_port},"
            f" left by flow run {record.flow_run_id}): {len(self.interruptions)} interruption(s) so far, "
            f"{len(self._launched)} instance(s)",
            {"previous_flow_run": record.flow_run_id, "launcher_pid": record.launcher_pid},
        )]

    # -- one supervision step ------------------------------------------------------------------------
    def tick(self) -> list[Happening]:
        out: list[Happening] = []
        now = self.clock()
        self._accrue(now)
        out += self._read_events()
        if self.job is not None and self.job.poll() is not None and self._exit is None:
            out += self._read_events()  # the last lines, written before the launcher exited
            self._exit = self.job.returncode
            self._remember()
            return out
        out += self._notices()
        while self._fallback_notes:
            note = self._fallback_notes.pop(0)
            out.append(Happening(f"{EVENT_PREFIX}.fleet.fallback", f"{EVENT_PREFIX}.job.{self.run.job_id}", note,
                                 {"attempts": note}))
        if now >= self._next_policy and self._started_at is not None and self.job is not None and self.job.control:
            self._next_policy = now + self.policy_every_s
            out += self._decide(now)
        self._remember()  # a replaced or released instance; written only when something changed
        return out

    def elapsed_h(self, now: float | None = None) -> float:
        start = self._started_at if self._started_at is not None else self.clock()
        return ((now if now is not None else self.clock()) - start) * self.time_scale / 3600.0

    def _accrue(self, now: float) -> None:
        if self._last_accrual is not None:
            dt = now - self._last_accrual
            for kind, n in self._held_now().items():
                self._held_seconds[kind] += dt * n
        self._last_accrual = now

    def _read_events(self) -> list[Happening]:
        if self.job is None:
            return []
        out: list[Happening] = []
        for ev in self.job.read_events():
            self.events.append(ev)
            out += self._on_event(ev)
        return out

    def _on_event(self, ev: Event) -> list[Happening]:
        job = f"{EVENT_PREFIX}.job.{self.run.job_id}"
        if self._replaying:
            # What failures and lost hosts caused (a release, a replacement order) happened under the run that saw
            # them first: only the bookkeeping is rebuilt.
            match ev:
                case MemberFailed():
                    self._failure(ev)
                    return []
                case Moved():
                    self._on_moved(ev)
                    return []
                case HostLost():
                    return []
        if self.hosts is not None:
            match ev:
                case Recovered():
                    # Recovery first: the table row names the rank's instance before the new holder replaces it.
                    return self._on_recovered(ev) + self._on_host_event(ev)
                case Moved():
                    return self._on_moved(ev) + self._on_host_event(ev)
                case Placed() | GenerationStarted() | HostLost():
                    return self._on_host_event(ev)
                case MemberFailed(rank=rank):
                    return [self._failure(ev)] + (self._wake_parked(rank) if not self.warm else [])
        match ev:
            case MemberFailed(rank=rank):
                return [self._failure(ev), *self._replace_instance(rank)]
            case Recovered():
                return self._on_recovered(ev)
            case Moved(ranks=ranks):
                return self._on_moved(ev) + [h for r in ranks for h in self._replace_instance(int(r["rank"]))]
            case StandbyWarm(proc=proc):
                return [Happening(f"{EVENT_PREFIX}.standby.ready", f"{EVENT_PREFIX}.process.{proc}",
                                  f"standby {proc} is warm", {"process": proc})]
            case Coverage(covered=covered, warm=warm, warming=warming, target=target):
                how = (f"{warm} warm standby(s) cover the job" if covered else
                       f"the job runs uncovered: no warm standby ({warming} warming up, target {target})")
                return [Happening(f"{EVENT_PREFIX}.job.{'covered' if covered else 'uncovered'}", job, how,
                                  {"warm": warm, "warming": warming, "target": target})]
            case JobFinished(step=step, final_digest=digest):
                self.steps_done = max(self.steps_done, step or 0)
                return [Happening(f"{EVENT_PREFIX}.job.finished", job, "training finished", {"final_digest": digest})]
            case JobFailed(reason=reason):
                return [Happening(f"{EVENT_PREFIX}.job.failed", job, f"training failed: {reason}", {"reason": reason})]
        return []

    def _failure(self, ev: MemberFailed) -> Happening:
        rank = ev.rank
        node = self.workers.get(rank, f"rank-{rank}")
        self._predicted[ev.proc] = node in self._hot_nodes
        cause = ev.cause
        planned = cause.startswith("planned_move")
        return Happening(
            f"{EVENT_PREFIX}.node.{'moved' if planned else 'failed'}",
            f"{EVENT_PREFIX}.node.{node}",
            f"worker {ev.proc} (rank {rank}, node {node}) {cause}",
            {"rank": rank, "process": ev.proc, "cause": cause, "node": node},
        )

    def _on_recovered(self, ev: Recovered) -> list[Happening]:
        out = []
        lost = ev.recovery_s + ev.warmup_penalty_s
        for r in ev.ranks:
            rank, old, new = int(r["rank"]), str(r["old"]), str(r["new"])
            self.interruptions.append(
                Interruption(
                    cause=", ".join(ev.causes),
                    rank=rank,
                    old_process=old,
                    new_process=new,
                    step=ev.step,
                    detect_s=ev.detect_s,
                    reconfigure_s=ev.reconfigure_s,
                    handoff_s=ev.handoff_s,
                    replay_s=ev.replay_s,
                    lost_time_s=lost,
                    tier="stopped" if rank in self._woken else ev.tier,
                    predicted=self._predicted.get(old, False),
                )
            )
            out.append(
                Happening(
                    f"{EVENT_PREFIX}.standby.promoted",
                    f"{EVENT_PREFIX}.rank.{rank}",
                    f"standby {new} took rank {rank} from {old} at step {ev.step}: "
                    f"{lost:.2f} s lost, no checkpoint reloaded",
                    {"rank": rank, "old": old, "new": new, "lost_time_s": lost, "step": ev.step},
                )
            )
            woken = self._woken.pop(rank, None)
            if woken is not None and self.hosts is not None and woken not in self._woken.values():
                # The woken host's standbys were the one host more the target counted for its ranks, all recovered
                # now: back to the policy's target (simulated instances keep theirs until the policy's next decision
                # releases the spare).
                self.warm_target = max(0, self.warm_target - 1)
                self._set_standby_target(self.warm_target)
        return out

    def _on_moved(self, ev: Moved) -> list[Happening]:
        """A planned move done at a step boundary (a data-parallel job): no failure, nothing replayed; its stall is
        the interruption's whole cost."""
        out = []
        for r in ev.ranks:
            rank, old, new = int(r["rank"]), str(r["old"]), str(r["new"])
            node = self.workers.get(rank, f"rank-{rank}")
            self.interruptions.append(Interruption(
                cause=f"planned_move:{ev.reason}", rank=rank, old_process=old, new_process=new, step=None,
                detect_s=0.0, reconfigure_s=ev.group_s or 0.0, handoff_s=ev.handoff_s or 0.0, replay_s=0.0,
                lost_time_s=ev.stall_s, tier="warm", predicted=node in self._hot_nodes))
            out.append(Happening(
                f"{EVENT_PREFIX}.node.moved", f"{EVENT_PREFIX}.node.{node}",
                f"rank {rank} moved from {old} (node {node}) to standby {new} at a step boundary ({ev.reason}): "
                f"{ev.stall_s:.2f} s of stall, nothing replayed",
                {"rank": rank, "process": old, "new": new, "cause": f"planned_move:{ev.reason}", "node": node,
                 "lost_time_s": ev.stall_s}))
        return out

    def _replace_instance(self, rank: int) -> list[Happening]:
        """The failed rank's node is gone: release it; the standby's instance now holds the rank; order another."""
        out: list[Happening] = []
        old = self.workers.get(rank)
        if old is not None:
            self._terminate([old])
        if self.warm:
            self.workers[rank] = self.warm.pop(0)
        elif self.parked:
            out += self._wake_parked(rank)
        if self.scorer is not None and old is not None and rank in self.workers:
            self.scorer.replace_node(old, self.workers[rank])
        self._hot_nodes.discard(old or "")
        # Keep the warm count the plan asks for: order a replacement standby instance.
        return out + self._order_standbys()

    def _wake_parked(self, rank: int) -> list[Happening]:
        """No warm standby is left for `rank`: wake a parked one (its process starts cold on the woken node)."""
        spare = next((i for i, n in Counter(self._woken.values()).items() if n < self.slots), None)
        if spare is not None:  # a host woken for other ranks of the same loss has a slot for this one too
            self._woken[rank] = spare
            return []
        if not self.parked:
            return []
        parked = self.parked[0]
        prices = self._prices()
        also = "lower run.standby's limits (max_warm, max_stopped)"
        # A wake-up holds no more instances, but bills the node price instead of the parked disk's.
        if (refusal := self._cap_refusal(f"waking parked standby {parked} for rank {rank}", "warm", 0, also=also,
                                         usd_per_h=prices["warm"] - prices["stopped"])) is not None:
            return self._announce_refusal(refusal, "wake")
        self._meter()
        self.parked.pop(0)
        # No capacity to wake it: another zone, another type of the same accelerator, then on-demand (cloud.capacity).
        # A replacement is one instance more until the parked one is released: a cap may allow the wake-up alone.
        fallbacks = self.run.fallbacks()
        no_replacement = self._cap_refusal(f"launching a replacement for parked standby {parked} (rank {rank})",
                                           "warm", 1, also=also)
        if no_replacement is not None:
            fallbacks = dataclasses.replace(fallbacks, zones=(), instance_types=(), on_demand=False)
        error = ""
        try:
            outcome = wake_or_replace(self.provider, parked, self._request("standby", 1), fallbacks)
        except CloudError as exc:
            outcome, error = None, str(exc)
        if outcome is None or not outcome.succeeded:
            self.parked.insert(0, parked)
            why = error if outcome is None else outcome.summary()
            capped = self._announce_refusal(no_replacement, "wake") if no_replacement is not None else []
            return [*capped, Happening(f"{EVENT_PREFIX}.standby.unavailable", f"{EVENT_PREFIX}.node.{parked}",
                                       f"could not wake {parked} nor replace it: {why}", {"rank": rank})]
        self._capped.clear()
        woken = outcome.instances[0].instance_id
        if woken != parked:  # a replacement was launched; the parked one was released
            self._launched.add(woken)
            self._roles[woken] = "standby"
            self._launched.difference_update(outcome.released)
            if outcome.release_error is not None:  # still parked (and billing its disk): kept for a later wake-up
                self.parked.insert(0, parked)
        if self.hosts is None:
            self.workers[rank] = woken
        self._woken[rank] = woken
        # The coordinator is waiting for a standby: one more process starts cold on the woken node. The policy's
        # decisions leave that one alone until the rank is recovered, then lower the target if the risk does not pay.
        self.warm_target += 1
        self._set_standby_target(self.warm_target)
        how = (f"woke parked standby {woken}" if woken == parked
               else f"no capacity to wake {parked} ({outcome.summary()}): launched {woken} instead")
        return [Happening(f"{EVENT_PREFIX}.standby.woken", f"{EVENT_PREFIX}.node.{woken}",
                          f"{how} for rank {rank} (cold start)",
                          {"rank": rank, "parked": parked, "step": outcome.step, "attempts": outcome.summary()})]

    def _order_standbys(self) -> list[Happening]:
        """Launch the standby instances the warm target misses (replacements of lost or promoted ones)."""
        missing = self.warm_target - len(self.warm)
        if missing <= 0:
            return []
        try:
            new = [i.instance_id for i in self._launch("standby", missing,
                                                       what=f"ordering {missing} replacement standby instance(s)")]
        except CapReached as exc:
            # The job goes on with the standbys it holds: the coordinator stops waiting for the ones refused.
            self.warm_target -= missing
            self._set_standby_target(self.warm_target)
            return self._announce_refusal(exc.refusal, "standby")
        except CloudError as exc:
            return [Happening(f"{EVENT_PREFIX}.standby.unavailable", f"{EVENT_PREFIX}.job.{self.run.job_id}",
                              f"could not order a replacement standby: {exc}", {})]
        self.warm += new
        return [Happening(f"{EVENT_PREFIX}.standby.ordered", f"{EVENT_PREFIX}.job.{self.run.job_id}",
                          f"ordered {missing} replacement standby instance(s): {', '.join(new)}", {"instances": new})]

    # -- hosts mode: the instances run the job -------------------------------------------------------
    def _on_host_event(self, ev: Placed | GenerationStarted | HostLost | Recovered | Moved) -> list[Happening]:
        out: list[Happening] = []
        match ev:
            case Placed(proc=proc, host=host):
                self._where[proc] = host
            case GenerationStarted(members=members):
                self._members = {int(m["rank"]): str(m["proc"]) for m in members}
                if self.job is not None and not self._replaying:
                    self.job.connect()  # the job runs: its store answers
            case HostLost(host=lost, cause=cause, procs=procs):
                if lost in self.parked or lost not in self._launched:
                    return out  # a parked instance powered off, or one released already
                self._terminate([lost])
                out.append(Happening(f"{EVENT_PREFIX}.node.lost", f"{EVENT_PREFIX}.node.{lost}",
                                     f"instance {lost} lost ({cause}): terminated, its ranks move to standbys",
                                     {"node": lost, "cause": cause, "processes": procs}))
        self._sync_hosts()
        if isinstance(ev, HostLost | Recovered | Moved):
            out += self._order_standbys()
        return out

    def _sync_hosts(self) -> None:
        """Which instance holds which rank, from the coordinator's placements; every other running instance of the
        job is a standby host. Role tags follow (a promoted standby's instance becomes a worker)."""
        workers = {rank: self._where[p] for rank, p in self._members.items() if p in self._where}
        if workers and workers != self.workers:
            for rank, node in workers.items():
                old = self.workers.get(rank)
                if old != node:
                    self._retag(node, "worker")
                    if self.scorer is not None and old is not None and node not in self.scorer.node_ids:
                        self.scorer.replace_node(old, node)
            self.workers = workers
        busy = set(self.workers.values())
        warm = [i for i in sorted(self._launched) if i not in busy and i not in self.parked]
        for node in set(warm) - set(self.warm):
            if node in self._roles and self._roles[node] == "worker":
                self._retag(node, "standby")
        self.warm = warm

    def _retag(self, node: str, role: str) -> None:
        if self._roles.get(node) == role or node not in self._launched:
            return
        try:
            self.provider.set_role(node, role)  # type: ignore[arg-type]
            self._roles[node] = role
        except CloudError as exc:
            log.warning("could not retag %s as %s: %s", node, role, exc)

    def _notices(self) -> list[Happening]:
        out: list[Happening] = []
        try:
            notices = self.provider.poll_notices(0.0)
        except CloudError as exc:
            log.warning("notices: %s", exc)
            return out
        for ranks, n in notice_moves(notices, self.workers):
            if self.job is not None:
                self.job.move(ranks, n.kind)
            out.append(
                Happening(
                    f"{EVENT_PREFIX}.node.notice",
                    f"{EVENT_PREFIX}.node.{n.instance_id}",
                    f"{n.kind} for {n.instance_id} (rank(s) {', '.join(map(str, ranks))}, {n.lead_s or 0:.0f} s "
                    "ahead): moving them to standbys",
                    {"ranks": ranks, "kind": n.kind, "lead_s": n.lead_s},
                )
            )
        return out

    def _decide(self, now: float) -> list[Happening]:
        assert self.scorer is not None
        now_h = self.elapsed_h(now)
        if self.feed is not None:  # without telemetry every node scores the fleet's base rate
            self.scorer.observe(self.feed.read(now_h, dict(self.workers)))
        hazards, scores = self.scorer.hazards(now_h, self.costs.lead_time_h, self.run.hazard_multiplier)
        plan = decide_standby(hazards, self.costs, self.fleet, now_s=now_h * 3600.0)
        held = set(self._woken.values())  # woken for a rank that waits for it: not the policy's to release
        pool = Pool(tuple(i for i in self.warm if i not in held), tuple(self.parked),
                    max(0, self.warm_target - len(held)))  # one woken host may hold several waiting ranks
        change = pool_change(plan, self.run.standby, pool)
        bar = self._predicted_bar
        self._hot_nodes = {n for n, p in zip(hazards.node_ids, hazards.p_fail, strict=True) if p > bar}
        if (change.warm_target, change.stopped_target) != (self.fleet.warm, self.fleet.stopped):
            self.fleet = FleetState(stopped=change.stopped_target, warm=change.warm_target,
                                    last_change_s=now_h * 3600.0)
        refused = self.refusals
        out = self._apply(change, plan.reasons, max(scores, key=lambda s: s.p_horizon), held=len(held))
        if self.refusals != refused:  # a cap kept some of the plan from being made: the policy sees what is held
            self.fleet = FleetState(stopped=len(self.parked), warm=max(0, self.warm_target - len(held)),
                                    last_change_s=self.fleet.last_change_s)
        return out

    def _apply(self, change: PoolChange, reasons: tuple[str, ...], worst: NodeScore, held: int = 0) -> list[Happening]:
        """Carry out a pool change (flows.actions.pool_change) and say what was done and why. `held` standbys, woken
        for ranks that wait for them, count in the coordinator's target on top of the change's."""
        out: list[Happening] = []
        job = f"{EVENT_PREFIX}.job.{self.run.job_id}"
        warm = change.warm_target + held
        raised = change.retarget and warm > self.warm_target
        if change.launch_warm:
            try:
                self.warm += [i.instance_id for i in self._launch(
                    "standby", change.launch_warm, what=f"pre-warming {change.launch_warm} standby instance(s) for "
                    f"{worst.node_id} ({worst.why})")]
            except CapReached as exc:  # the target stays where the instances are
                out += self._announce_refusal(exc.refusal, "standby")
                change, raised = dataclasses.replace(change, retarget=False), False
        if change.retarget:
            self.warm_target = warm
            self._set_standby_target(warm)
        if raised:
            assert self.scorer is not None
            out.append(Happening(
                f"{EVENT_PREFIX}.standby.prewarmed", job,
                f"pre-warming to {warm} warm standby(s): node {worst.node_id} {worst.why} "
                f"(P(fault in {self.scorer.horizon_h:g} h) = {worst.p_horizon:.2f}); {reasons[0] if reasons else ''}",
                {"warm": warm, "node": worst.node_id, "p_fault": worst.p_horizon, "reasons": list(reasons)},
            ))
        elif change.retarget:
            self.warm = [i for i in self.warm if i not in change.release_warm]
            out.append(self._release("warm", change.release_warm, {"warm": warm}))
        if change.park:
            try:
                new = [i.instance_id for i in self._launch("standby", change.park, kind="stopped")]
                self.provider.stop(new)
                self.parked += new
                out.append(Happening(f"{EVENT_PREFIX}.standby.parked", job,
                                     f"parked {len(new)} stopped standby(s) for cheap cover", {"instances": new}))
            except CapReached as exc:
                out += self._announce_refusal(exc.refusal, "parked")
            except CloudError as exc:
                log.warning("could not park a standby: %s", exc)
        if change.release_parked:
            self.parked = [i for i in self.parked if i not in change.release_parked]
            out.append(self._release("parked", change.release_parked, {"stopped": change.stopped_target}))
        return out

    def _release(self, kind: str, instances: tuple[str, ...], payload: dict[str, Any]) -> Happening:
        self._terminate(instances)
        return Happening(f"{EVENT_PREFIX}.standby.released", f"{EVENT_PREFIX}.job.{self.run.job_id}",
                         f"released {len(instances)} {kind} standby(s): the risk no longer pays for them",
                         {**payload, "instances": list(instances)})

    def _terminate(self, instances: tuple[str, ...] | list[str]) -> None:
        self._meter()
        try:
            self.provider.terminate(list(instances))
            self._launched.difference_update(instances)
        except CloudError as exc:
            log.warning("could not release %s: %s", ", ".join(instances), exc)

    # -- the end ---------------------------------------------------------------------------------------
    def wait(self, timeout_s: float) -> int:
        assert self.job is not None
        code = self.job.wait(timeout_s)
        return -1 if code is None else code

    def report(self) -> RunReport:
        ev = self.events
        start = next((e.time for e in ev if isinstance(e, GenerationStarted)), None)
        end = next((e.time for e in ev if isinstance(e, JobFinished | JobFailed)), None)
        if start is not None and end is None:
            end = time.time()  # a report of a run stopped midway: what ran until now (event times are epoch)
        wall_s = float(end - start) if start is not None and end is not None else 0.0
        fin = next((e for e in ev if isinstance(e, JobFinished)), None)
        failed = next((e for e in ev if isinstance(e, JobFailed)), None)
        hours = {k: self._held_seconds[k] * self.time_scale / 3600.0 for k in ("warm", "stopped")}
        # Downtimes are the wall seconds measured; the run's length and the standby hours are on its clock.
        bill = bill_run(self.costs, self.run.tier_prices(), hours, [i.lost_time_s for i in self.interruptions],
                        wall_s * self.time_scale)
        exit_code = self.job.returncode if self.job is not None and self.job.returncode is not None else -1
        if failed:
            message = failed.reason
        elif exit_code > 0:  # the launcher or coordinator stopped before the job ran: its own last word says why
            message = self._last_log_line() or f"the job's coordinator exited with code {exit_code}"
        else:
            message = "finished"
        return RunReport(
            **{f.name: getattr(bill, f.name) for f in fields(RunBill)},
            job_id=self.run.job_id,
            exit_code=exit_code,
            message=message,
            wall_s=wall_s,
            steps=self.steps_done,
            interruptions=list(self.interruptions),
            final_digest=fin.final_digest if fin else None,
        )

    def _last_log_line(self) -> str:
        try:
            lines = (self.workdir / "job.log").read_text(errors="replace").strip().splitlines()
        except OSError:
            return ""
        last = lines[-1].strip() if lines else ""
        if last and self.hosts is not None and "agents joined" in last:
            last += (" (the instances' agents never reached the coordinator: check each instance's console output, "
                     "`journalctl -u trainmover-agent`, and that it reaches coordinator_address)")
        return last

    def release(self) -> list[str]:
        """Stop the job if it still runs, then terminate every instance of the job. Safe to call twice."""
        if self.job is not None:
            self.job.stop()
        try:
            released = self.provider.release_job(self.run.job_id)
        finally:
            if self.hosts is not None:
                self.hosts.close()  # the job's secret and staged files deleted, local hosts removed
        self.warm, self.parked = [], []
        self._launched.clear()
        # Nothing is held any more: no record, so a hook that runs after this finds nothing left running.
        self.holdings_path.unlink(missing_ok=True)
        self._recorded = None
        return released
