"""The coordinator's lease: exactly one coordinator acts for a job at a time, and a new one can take over.

The lease is one sealed record in the job's store (`CoordinatorLease` at `k_lease`), only ever written with
`compare_set`, so that the store itself decides every race:

- the first coordinator of a job creates it (epoch 1) where no record exists;
- the holder renews it on every health tick (its `count` + 1), by swapping the exact bytes it wrote last for the
  next ones: when someone else wrote in between (a coordinator that took over), the swap fails and the holder
  learns it was **deposed** (`Deposed`), so it stops acting and leaves the processes alone;
- a coordinator started with `--takeover` waits until the count has not moved for `stale_s` (the holder is dead or
  frozen), then swaps the stale bytes for epoch + 1 with its own agent address. Two contenders read the same stale
  bytes; one swap wins.

Sealed values are deterministic (an HMAC over the key and the JSON), so the bytes a holder wrote are the bytes it
compares against. A value the seal refuses (a forgery on a loopback store, the only store an outsider can reach) is
never taken for a lease: it cannot depose the holder (whose swap then fails only if the forgery replaced its
bytes, which needs write access to the store), and a contender waits for a genuine one.

The agents read the same record (runtime.host.agent): when their link to the coordinator goes silent and the count
stops moving too, the coordinator is gone rather than cut off from them, so they keep their processes training and
re-attach to whoever takes the next epoch.
"""

from __future__ import annotations

import os
import secrets
import socket
from collections.abc import Callable
from dataclasses import replace

import torch.distributed as dist

from runtime.wire import store as keys
from runtime.wire.auth import Sealer
from runtime.wire.protocol import CoordinatorLease
from runtime.wire.store import read_lease


class Deposed(RuntimeError):
    """Another coordinator holds the job now; this one must stop acting (and must not stop the job)."""


class LeaseError(RuntimeError):
    """The lease cannot be had: a job runs there already, or there is no job to take over; the message says what to
    do."""


class Lease:
    """This coordinator's hold on the job (see the module's docstring)."""

    def __init__(self, store: dist.Store, sealer: Sealer, agents: str, *,
                 clock: Callable[[], float], sleep: Callable[[float], None], wall: Callable[[], float]) -> None:
        self.store = store
        self.wall = wall
        self.sealer = sealer
        self.agents = agents
        self.clock = clock
        self.sleep = sleep
        self.holder = f"{socket.gethostname()}/{os.getpid()}/{secrets.token_hex(3)}"
        self.record: CoordinatorLease | None = None
        self._raw = b""
        self.previous: CoordinatorLease | None = None
        """The lease this coordinator took over (None: it started the job)."""
        self.stale_for = 0.0
        """How long the lease taken over had gone unrenewed when this coordinator took it."""

    @property
    def epoch(self) -> int:
        return self.record.epoch if self.record is not None else 0

    def _swap(self, expected: bytes, record: CoordinatorLease) -> bool:
        raw = self.sealer.seal(keys.k_lease(), record.to_json()).encode()
        got = self.store.compare_set(keys.k_lease(), expected.decode(), raw.decode())  # ASCII: JSON and hex
        if got != raw:
            return False
        self.record, self._raw = record, raw
        return True

    def create(self) -> None:
        """Hold a new job's lease (epoch 1); LeaseError when the store holds one already."""
        if not self._swap(b"", CoordinatorLease(1, self.holder, 0, self.agents, self.wall())):
            raise LeaseError("a coordinator already runs a job on this store (its lease is there): start this one "
                             "with --takeover to take that job over once its coordinator is gone, or give a new "
                             "store (--store) for a new job")

    def take_over(self, stale_s: float, timeout_s: float, poll_s: float = 0.05) -> CoordinatorLease:
        """Wait until the lease has not been renewed for `stale_s` (watched here, or by its own renewal time), then
        take the next epoch; the lease taken over. LeaseError when there is no job, or the holder keeps renewing for
        `timeout_s`."""
        deadline = self.clock() + timeout_s
        seen: bytes | None = None
        since = self.clock()
        while True:
            now = self.clock()
            current = read_lease(self.store, self.sealer)
            if current is None:
                raise LeaseError("there is no job to take over on this store (no coordinator's lease): start the job "
                                 "without --takeover")
            raw, record = current
            if raw != seen:
                seen, since = raw, now
            stale_for = max(now - since, self.wall() - record.renewed_at)
            if stale_for >= stale_s:
                self.stale_for = stale_for
                mine = CoordinatorLease(record.epoch + 1, self.holder, 0, self.agents, self.wall())
                if self._swap(raw, mine):
                    self.previous = record
                    return record
                seen, since = None, now  # another contender won this epoch: watch its lease in turn
            if now > deadline:
                raise LeaseError(f"coordinator {record.holder} (epoch {record.epoch}) kept renewing its lease for "
                                 f"{timeout_s:.0f} s: it is alive, so there is nothing to take over")
            self.sleep(poll_s)  # a bounded poll of another process's renewals

    def renew(self) -> None:
        """Count one more renewal; Deposed when another coordinator wrote the lease since this one's last write."""
        assert self.record is not None, "renew() before create() or take_over()"
        if not self._swap(self._raw, replace(self.record, count=self.record.count + 1, renewed_at=self.wall())):
            now = read_lease(self.store, self.sealer)
            who = f"coordinator {now[1].holder} holds epoch {now[1].epoch}" if now else "its lease was replaced"
            raise Deposed(f"this coordinator (epoch {self.epoch}) lost the job's lease: {who}; it stops here and "
                          "leaves the job's processes to that coordinator")

    def claim(self, key: str, value: object) -> None:
        """Write `value` sealed at `key` only where nothing is yet (a generation record): two coordinators can never
        both publish one generation; Deposed for the one that finds it written."""
        raw = self.sealer.seal(key, value)
        if self.store.compare_set(key, "", raw) != raw.encode():
            raise Deposed(f"another coordinator published {key} first; this one (epoch {self.epoch}) stops here")
