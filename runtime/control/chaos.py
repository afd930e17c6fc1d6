"""Seeded random faults from outside the processes: the coordinator's chaos monkey.

`runtime.faults` fires a fault at a named protocol phase from inside a process; chaos is the other half:
real signals sent by the coordinator to any process at random moments (workers mid-step, standbys warming up
or parked, promoted standbys receiving the state, replicas sending it), one or several at once. A spec is a
comma-separated list of `key=value`::

    seed=7,every_s=1.5,max=100,signals=kill|stop,targets=worker|standby,burst=2

- `every_s`: mean time between injections (exponentially distributed, so moments are random, not periodic);
- `max`: stop after this many faults (0: no limit); `burst`: up to this many processes hit at the same moment;
- `signals`: `kill` (SIGKILL: a crash) and `stop` (SIGSTOP: a hang, caught by the heartbeat and fenced);
- `targets`: `worker` (members, senders and receivers included) and `standby` (unpromoted, warm or warming);
- `covered=1`: hit workers only while enough warm standbys wait to take their ranks.

The monkey never takes down the last holder of the training state (that would end the job by design, not
test it), and records what it did (`chaos_injected` events, with the moment of the signal), so every fault
can be matched to the job's reaction and detection is measured from the true moment of failure.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

SIGNALS = ("kill", "stop")
TARGETS = ("worker", "standby")


class ChaosSpecError(ValueError):
    """A chaos spec that cannot be parsed; the message shows the expected form."""


@dataclass(frozen=True, slots=True)
class ChaosSpec:
    seed: int = 0
    every_s: float = 2.0
    max_faults: int = 0
    signals: tuple[str, ...] = ("kill",)
    targets: tuple[str, ...] = TARGETS
    burst: int = 1
    warmup_s: float = 0.0
    """No injection before this many seconds after training started."""
    covered: bool = False
    """Hit workers only while a warm standby can take each lost rank: every interruption is then a recovery to
    measure, not a wait for a standby to start (soaks and benchmarks); standbys are hit at any time."""


EXAMPLE = "seed=7,every_s=1.5,max=100,signals=kill|stop,targets=worker|standby,burst=2"


def parse_chaos(spec: str) -> ChaosSpec | None:
    """The spec, or None for an empty string. Raises ChaosSpecError with the expected form."""
    if not spec.strip():
        return None
    fields: dict[str, str] = {}
    for pair in filter(None, (p.strip() for p in spec.split(","))):
        key, sep, value = pair.partition("=")
        if not sep:
            raise ChaosSpecError(f"chaos {spec!r}: expected key=value, got {pair!r} (e.g. {EXAMPLE})")
        fields[key.strip()] = value.strip()
    known = {"seed", "every_s", "max", "signals", "targets", "burst", "warmup_s", "covered"}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise ChaosSpecError(f"chaos {spec!r}: unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    try:
        out = ChaosSpec(
            seed=int(fields.get("seed", 0)),
            every_s=float(fields.get("every_s", 2.0)),
            max_faults=int(fields.get("max", 0)),
            signals=tuple(fields.get("signals", "kill").split("|")),
            targets=tuple(fields.get("targets", "|".join(TARGETS)).split("|")),
            burst=int(fields.get("burst", 1)),
            warmup_s=float(fields.get("warmup_s", 0.0)),
            covered=fields.get("covered", "0") not in ("0", "false", "no"),
        )
    except ValueError:
        raise ChaosSpecError(f"chaos {spec!r}: seed, max and burst are integers, every_s and warmup_s seconds "
                             f"(e.g. {EXAMPLE})") from None
    if not out.every_s > 0 or out.max_faults < 0 or out.burst < 1 or out.warmup_s < 0:
        raise ChaosSpecError(f"chaos {spec!r}: every_s must be positive, max 0 or more, burst 1 or more")
    for name, allowed, got in (("signals", SIGNALS, out.signals), ("targets", TARGETS, out.targets)):
        if not got or any(g not in allowed for g in got):
            raise ChaosSpecError(f"chaos {spec!r}: {name} must be |-separated values of {', '.join(allowed)}")
    return out


@dataclass(frozen=True, slots=True)
class Candidate:
    """A live process the monkey may hit."""

    proc: str
    role: str
    """worker (a member of the current generation) or standby (unpromoted)."""
    state: str
    """What it is doing: training, receiving (promoted, no state yet), standby_warming, standby_warm."""
    holds_state: bool


@dataclass(frozen=True, slots=True)
class Shot:
    proc: str
    signal: str


class ChaosMonkey:
    """Decides when to strike and whom; the coordinator sends the signals. Pure logic: a clock is passed in."""

    def __init__(self, spec: ChaosSpec) -> None:
        self.spec = spec
        self.rng = random.Random(spec.seed)
        self.injected = 0
        self.next_at: float | None = None

    @property
    def exhausted(self) -> bool:
        return self.spec.max_faults > 0 and self.injected >= self.spec.max_faults

    def start(self, now: float) -> None:
        self.next_at = now + self.spec.warmup_s + self.rng.expovariate(1.0 / self.spec.every_s)

    def due(self, now: float) -> bool:
        return self.next_at is not None and now >= self.next_at and not self.exhausted

    def strike(self, now: float, candidates: list[Candidate]) -> list[Shot]:
        """Whom to hit now (possibly nobody): at most `burst` processes, never every holder of the state, and in
        covered mode no more workers than warm standbys left unhit."""
        self.next_at = now + self.rng.expovariate(1.0 / self.spec.every_s)
        # Each target kind is equally likely to be hit first, however many processes it has: a pool of standbys
        # still warming up must not soak up the faults meant for the workers.
        by_role = {role: [c for c in candidates if c.role == role] for role in self.spec.targets}
        for group in by_role.values():
            self.rng.shuffle(group)
        pool: list[Candidate] = []
        while any(by_role.values()):
            role = self.rng.choice([r for r, group in by_role.items() if group])
            pool.append(by_role[role].pop())
        want = self.rng.randint(1, self.spec.burst)
        if self.spec.max_faults:
            want = min(want, self.spec.max_faults - self.injected)
        holders_left = sum(c.holds_state for c in candidates)
        warm_left = sum(c.state == "standby_warm" for c in candidates)
        workers_hit = 0
        shots: list[Shot] = []
        for c in pool:
            if len(shots) >= want:
                break
            if self.spec.covered and c.role == "worker" and workers_hit >= warm_left:
                continue
            if self.spec.covered and c.state == "standby_warm" and warm_left - 1 < workers_hit:
                continue
            if c.holds_state:
                if holders_left <= 1:
                    continue
                holders_left -= 1
            shots.append(Shot(c.proc, self.rng.choice(self.spec.signals)))
            workers_hit += c.role == "worker"
            warm_left -= c.state == "standby_warm"
        self.injected += len(shots)
        return shots
