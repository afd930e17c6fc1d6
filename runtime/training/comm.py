"""The process group of the current generation, and the gradient exchange over it.

One `Communicator` per process. It builds the group of a generation from a `PrefixStore` named after it,
tears it down without leaving the process when a peer is lost, and all-reduces gradients held in flat
buckets (the parameters' `.grad` are views into them, so backward writes where the exchange reads).
Gloo on CPU; NCCL on GPU with non-blocking communicators that can be aborted.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import gc
import logging
import os
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from runtime.config import KNOBS

log = logging.getLogger("trainmover.runtime")

STALE_GRACE_S = 1.0
"""How long a Gloo collective may go on after a newer generation formed before it is abandoned (`Communicator.wait`)."""
WAIT_SLICE = datetime.timedelta(seconds=0.25)


GLOO_LISTENER_WAIT_FACTOR = 5
"""While a Gloo group is built, the side of each new connection that waits for its peer to connect (the peer with the
lower address) waits five times the group's timeout (`Pair::waitUntil` in gloo/transport/tcp/pair.h), the side that
connects and the rendezvous reads one timeout. A member lost after publishing its address, before connecting, would
hold the others five times the connect timeout (150 s for 30 s; seen in tests): see `connect_timeout`."""


# Two switches of Gloo's, read by every member alike (so every process of a job sets them, here, before its first
# group): pairs are matched by the peer's rank rather than by a number drawn per pair, so that this process can answer
# its own listener on a lost peer's behalf (`Connecting.abandon`); and a refused connection fails at once instead of
# being retried until the group's timeout (a Gloo listener exists before its address is published, so a refusal
# means the peer is gone).
os.environ["GLOO_ENABLE_RANK_AS_SEQUENCE_NUMBER"] = "1"
os.environ["GLOO_DISABLE_CONNECTION_RETRIES"] = "1"


def connect_timeout(backend: str, connect_timeout_s: float) -> datetime.timedelta:
    """The timeout to build a group with, so that no member waits longer than `connect_timeout_s` to connect:
    a fifth of it for Gloo (`GLOO_LISTENER_WAIT_FACTOR`), all of it for NCCL."""
    factor = GLOO_LISTENER_WAIT_FACTOR if backend == "gloo" else 1
    return datetime.timedelta(seconds=connect_timeout_s / factor)


class CommFailure(RuntimeError):
    """A collective or point-to-point operation failed: a peer is gone or the group was broken."""


def error_text(exc: BaseException) -> str:
    """The first line of a backend error, which is all a survivor keeps: holding the exception itself would
    keep its traceback, and through it the broken group's `Work` objects and sockets, alive."""
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]


TCP_LISTEN = "0A"  # the state column of /proc/net/tcp


@dataclass(frozen=True, slots=True)
class Sockets:
    """This process's TCP sockets at one moment, from one read of the network namespace's tables (which list every
    socket of the namespace: thousands on a busy host, so read once per use)."""

    connections: frozenset[int]
    """The inodes of its open TCP connections (IPv4 and IPv6), listening sockets left out: Gloo's listener must
    never be shut (its accept thread aborts the process on an error)."""
    listeners: dict[int, tuple[int, str, int]]
    """Its listening TCP sockets: inode -> (address family, address, port)."""

    @classmethod
    def now(cls) -> Sockets:
        connections: set[int] = set()
        listeners: dict[int, tuple[int, str, int]] = {}
        for table, family in (("/proc/self/net/tcp", socket.AF_INET), ("/proc/self/net/tcp6", socket.AF_INET6)):
            with contextlib.suppress(OSError), open(table) as f:
                next(f, None)
                for line in f:
                    fields = line.split()
                    if len(fields) <= 9 or not fields[9].isdigit():
                        continue
                    if fields[3] != TCP_LISTEN:
                        connections.add(int(fields[9]))
                        continue
                    address, port = fields[1].split(":")
                    raw = bytes.fromhex(address)
                    # The kernel prints each 32-bit word of the address in host order (little-endian here).
                    packed = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
                    listeners[int(fields[9])] = (family, socket.inet_ntop(family, packed), int(port, 16))
        owned = _socket_fds().keys()
        return cls(frozenset(connections & owned), {i: w for i, w in listeners.items() if i in owned})


def tcp_socket_inodes() -> set[int]:
    """The inodes of this process's open TCP connections (`Sockets.connections`)."""
    return set(Sockets.now().connections)


def _socket_fds() -> dict[int, int]:
    """Socket inode -> one of this process's file descriptors for it."""
    out: dict[int, int] = {}
    with contextlib.suppress(OSError):
        for name in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):
                target = os.readlink(f"/proc/self/fd/{name}")
                if target.startswith("socket:["):
                    out.setdefault(int(target[8:-1]), int(name))
    return out


def shut_sockets(inodes: set[int]) -> int:
    """Shut down (not close: the fds stay Gloo's) the open sockets among `inodes`; how many were shut.

    A shut-down socket fails every read and write on it at once, so an operation waiting on a peer that is
    cut off (whose socket would otherwise stay open until TCP gives up) fails now."""
    shut = 0
    for inode, fd in _socket_fds().items():
        if inode not in inodes:
            continue
        with contextlib.suppress(OSError):
            dup = socket.fromfd(fd, socket.AF_INET, socket.SOCK_STREAM)  # a dup: closing it leaves fd open
            try:
                # The descriptor may have been closed and reused since it was listed (Gloo tearing the group
                # down, a new group connecting): shut only the socket that was listed.
                if os.fstat(dup.fileno()).st_ino == inode:
                    dup.shutdown(socket.SHUT_RDWR)
                    shut += 1
            finally:
                dup.close()
    return shut


SEQUENCE = struct.Struct("=q")
"""What the connecting side of a Gloo pair writes first: the listening side's number for the pair (the connecting
peer's rank, with `GLOO_ENABLE_RANK_AS_SEQUENCE_NUMBER`)."""


class Connecting:
    """One generation's Gloo groups while they connect, so that a newer generation ends the building at once.

    A member lost while its peers build a group holds each of them in one of three waits: for its address in the
    store (it never published it), on a connection to it (refused, which fails at once; or unanswered, when its host
    is cut off), or for its connection (it published and died: Gloo waits five times the group's timeout there).
    `abandon`, from the heartbeat thread once a newer generation formed, ends all three: the rendezvous store
    (`store`) raises on its next call and in its waits, every listener this process opened since the building
    began is handed one connection per peer rank (each closed at once, so the pair that took it fails), and every
    connection opened since then is shut."""

    def __init__(self, gen: int, ranks: int, before: Sockets | None = None) -> None:
        """`before`: this process's sockets as the building begins (read now if not given)."""
        self.gen = gen
        self.ranks = ranks
        self.abandoned = False
        self._before = before or Sockets.now()
        self._lock = threading.Lock()

    def store(self, inner: dist.Store) -> dist.Store:
        """`inner` for one group's rendezvous: the same keys, and waits that end when the building is abandoned."""
        return RendezvousStore(inner, self)

    def abandon(self) -> int:
        """End the building (see the class); how many connections were made to this process's own listeners."""
        with self._lock:
            if self.abandoned:
                return 0
            self.abandoned = True
            made = []
            for inode, (family, host, port) in Sockets.now().listeners.items():
                if inode in self._before.listeners:
                    continue
                for peer in range(self.ranks):
                    with contextlib.suppress(OSError):
                        s = socket.socket(family, socket.SOCK_STREAM)
                        made.append(s)
                        s.settimeout(0.5)
                        s.connect((host, port))
                        s.sendall(SEQUENCE.pack(peer))
            for s in made:
                s.close()
            shut_sockets(set(Sockets.now().connections - self._before.connections))
            return len(made)


class RendezvousStore(dist.Store):
    """A group's rendezvous store (Gloo publishes and reads its peers' addresses there) that fails as soon as the
    building is abandoned: its waits poll (a TCPStore wait cannot be interrupted, and one that times out leaves its
    answer on the connection)."""

    POLL_S = (0.0005, 0.005)
    """The first and the longest pause between two looks at the keys waited for."""

    def __init__(self, inner: dist.Store, connecting: Connecting) -> None:
        super().__init__()
        self._inner = inner
        self._connecting = connecting

    def _live(self) -> None:
        if self._connecting.abandoned:
            raise RuntimeError(f"generation {self._connecting.gen} was superseded while its groups connected")

    def set(self, key: str, value: str) -> None:
        self._live()
        self._inner.set(key, value)

    def get(self, key: str) -> bytes:
        self.wait([key])
        return self._inner.get(key)

    def add(self, key: str, amount: int) -> int:
        self._live()
        return self._inner.add(key, amount)

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        self._live()
        return self._inner.compare_set(key, expected, desired)

    def check(self, keys: list[str]) -> bool:
        self._live()
        return self._inner.check(keys)

    def delete_key(self, key: str) -> bool:
        return self._inner.delete_key(key)

    def num_keys(self) -> int:
        return self._inner.num_keys()

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        self._inner.set_timeout(timeout)

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        limit = (timeout or datetime.timedelta(seconds=KNOBS.connect_timeout_s)).total_seconds()
        deadline = time.monotonic() + limit
        pause, longest = self.POLL_S
        while not self.check(keys):
            if time.monotonic() > deadline:
                raise RuntimeError(f"wait timeout after {limit * 1000:.0f}ms, keys: {', '.join(keys)}")
            time.sleep(pause)  # polling the store, bounded by the deadline and ended by `abandon`
            pause = min(pause * 2, longest)


class Communicator:
    """Owns this process's membership in one generation's process group."""

    def __init__(self, backend: str, store: dist.Store, timeout_s: float, device: torch.device,
                 newest_gen: Callable[[], int] | None = None, stopping: Callable[[], bool] | None = None) -> None:
        """`newest_gen()`: the newest generation this process has seen (its heartbeat's), read while a Gloo
        collective waits (`wait`); `stopping()`: whether the coordinator stopped the job, read there too."""
        self.backend = backend
        self.store = store
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.device = device
        self.newest_gen = newest_gen
        self.stopping = stopping
        self.gen: int | None = None
        self.last_teardown_s = 0.0
        self._stuck: list[object] = []
        """Work abandoned in the current group (`wait`): the group must not be destroyed while it runs."""
        self.abandoned = 0
        """Collectives abandoned so far (each one a group left to its stuck thread)."""
        self._baseline: set[int] = set()
        self._sockets: set[int] = set()
        """The TCP sockets this generation's groups opened (`track_sockets`), shut when a newer one forms."""
        self.sockets_shut = 0
        self._connecting: Connecting | None = None
        """The group being built (Gloo), which a newer generation abandons (`cut_if_older`)."""
        self._connecting_lock = threading.Lock()

    def build(self, gen: int, rank: int, world_size: int,
              connect_timeout_s: float = KNOBS.connect_timeout_s) -> None:
        """Join generation `gen`'s group. Connecting is bounded by `connect_timeout_s` (a member that dies
        between the store barrier and this call leaves the others waiting that long at most); collectives
        then get the long collective timeout, since hangs are caught by heartbeats instead."""
        self.teardown()
        if not dist.is_initialized():
            # torch names each new group after a per-process counter that only destroy_process_group() resets. A
            # build that failed while connecting leaves the counter raised, and this process's next group would
            # wait on store keys that no peer writes (a member that joined later counts from 0): start every
            # generation's group from the same name in every member.
            dist.distributed_c10d._world.group_count = 0
        kwargs: dict[str, object] = {}
        if self.backend == "nccl":
            # Non-blocking communicators let abort() interrupt a collective stuck on a lost peer.
            options = dist.ProcessGroupNCCL.Options()
            options.config.blocking = 0
            kwargs["pg_options"] = options
            kwargs["device_id"] = self.device
        failure: str | None = None
        before = Sockets.now()
        self._baseline, self._sockets = set(before.connections), set()
        store: dist.Store = dist.PrefixStore(f"g{gen}", self.store)
        connecting = None
        if self.backend == "gloo":
            connecting = Connecting(gen, world_size, before)
            store = connecting.store(store)
            with self._connecting_lock:
                self._connecting = connecting
            if self.newest_gen is not None and self.newest_gen() > gen:
                connecting.abandon()  # a newer one formed before this process got here
        try:
            dist.init_process_group(
                self.backend,
                store=store,
                rank=rank,
                world_size=world_size,
                timeout=connect_timeout(self.backend, connect_timeout_s),
                **kwargs,  # type: ignore[arg-type]
            )
        except RuntimeError as exc:  # a peer died while connecting (DistError/DistStoreError are RuntimeErrors)
            failure = error_text(exc)
        finally:
            with self._connecting_lock:
                self._connecting = None
        if connecting is not None and connecting.abandoned:  # the cause, whatever Gloo said of it
            failure = f"generation {gen} was superseded while its group connected"
        if failure is not None:
            if dist.is_initialized():
                dist.destroy_process_group()
            raise CommFailure(f"could not build the group of generation {gen}: {failure}")
        self.gen = gen
        dist.distributed_c10d._set_pg_timeout(self.timeout)
        self.track_sockets()

    def track_sockets(self) -> None:
        """Count the TCP sockets opened since `build` began as this generation's (call again after building
        more groups of the same generation). Sharded jobs track theirs per group (`runtime.training.groups`)."""
        self._sockets |= tcp_socket_inodes() - self._baseline

    def cut_if_older(self, latest_gen: int) -> None:
        """From the heartbeat thread: a newer generation formed, so this generation's groups are over. Shut their
        sockets, so that a collective still waiting on a peer fails now instead of when TCP gives up on a cut-off
        host (which can be many minutes) or at the collective timeout; and end an older generation's group that is
        still connecting (`Connecting.abandon`). Gloo only (NCCL is aborted instead)."""
        with self._connecting_lock:
            if self._connecting is not None and self._connecting.gen < latest_gen:
                self._connecting.abandon()
        if self.backend != "gloo" or self.gen is None or self.gen >= latest_gen or not self._sockets:
            return
        sockets, self._sockets = self._sockets, set()
        self.sockets_shut += shut_sockets(sockets)

    def abort_if_older(self, latest_gen: int) -> None:
        """NCCL only, from the heartbeat thread: abort a group that a newer generation replaced.

        A non-blocking NCCL communicator can be aborted from another thread, which makes a collective stuck on
        a lost peer return an error at once. Gloo has no such abort (its `abort()` neither closes sockets nor
        unblocks a stuck operation in torch 2.13): there, survivors see the peer's closed sockets, and a hung
        peer is fenced by the coordinator.
        """
        if self.backend != "nccl" or self.gen is None or self.gen >= latest_gen:
            return
        abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
        if abort is not None:
            with contextlib.suppress(Exception):
                abort()

    def wait(self, works: list[dist.Work]) -> str | None:
        """Wait for `works`; None when done. A lost peer's error is raised as usual.

        Gloo, only: a collective can stay blocked after its peer died (a receive posted after the peer's
        connection failed waits for the whole collective timeout, ten minutes, with no socket left to fail on),
        and the survivor, still heartbeating, would hold the next generation up all that time. So Gloo work is
        waited for in slices, and abandoned once a newer generation has been seen for `STALE_GRACE_S`: the
        message returned says so, the step was not committed, and the member recovers into the new generation
        from its last committed state, as after any lost peer. The abandoned work's group is never destroyed
        (`teardown`), since destroying it would wait for the stuck thread. Work is abandoned at once when the
        job is stopped (`stopping`): the member then leaves through its recovery path, which obeys the stop."""
        if self.backend != "gloo" or self.newest_gen is None:
            for work in works:
                work.wait()
            return None
        newer_since: float | None = None
        for work in works:
            while True:
                try:
                    work.wait(WAIT_SLICE)
                    break
                except RuntimeError:
                    if work.is_completed():
                        raise  # it failed: the usual lost peer
                assert self.gen is not None
                if self.stopping is not None and self.stopping():
                    # The job was stopped: a peer that left at its step boundary never enters this collective.
                    self._stuck = list(works)
                    self.abandoned += 1
                    return f"the job was stopped while a collective of generation {self.gen} waited: abandoned"
                if self.newest_gen() <= self.gen:
                    newer_since = None
                    continue  # a slow step, nothing newer: keep waiting (the collective timeout still holds)
                newer_since = time.monotonic() if newer_since is None else newer_since
                if time.monotonic() - newer_since >= STALE_GRACE_S:
                    self._stuck = list(works)
                    self.abandoned += 1
                    message = (f"a collective of generation {self.gen} was still waiting {STALE_GRACE_S:.0f} s after "
                               f"generation {self.newest_gen()} formed: abandoned")
                    sys.stderr.write(f"[trainmover] {message}\n")
                    return message
        return None

    def keep_stuck(self, objs: list[object]) -> None:
        """Work of the current group that a thread of this process is still blocked in (a handoff's rest): the group
        is then kept alive for good at `teardown` rather than destroyed under that thread."""
        self._stuck.extend(objs)

    def take_stuck(self) -> list[object]:
        """The work abandoned in the current group (`wait`), forgotten here: for a caller that fails it itself."""
        stuck, self._stuck = self._stuck, []
        return stuck

    def teardown(self) -> None:
        """Leave the current group. Safe to call when a peer is gone or when there is no group.

        Gloo closes its sockets only when the last reference to the group is gone, and peers that have not
        seen the error yet stay blocked until then: so drop references first, then destroy. The exchange keeps
        no exception, traceback or `Work` past its except block, so a young-generation collection suffices;
        a full `gc.collect()` costs 150-170 ms with torch loaded, most of a recovery here.
        """
        if self.gen is None or not dist.is_initialized():
            self.gen = None
            return
        t0 = time.perf_counter()
        if self._stuck:
            # A thread of this group is blocked in abandoned work (`wait`): destroying the group would join it
            # (minutes). Keep the group and its work alive for good instead; the thread ends at its own timeout.
            for obj in (dist.distributed_c10d._get_default_group(), *self._stuck):
                ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))
            self._stuck = []
        gc.collect(0)
        if self.backend == "nccl":
            abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
            if abort is not None:
                try:
                    abort()
                except Exception as exc:  # an aborted communicator may complain; the group is gone either way
                    log.debug("NCCL abort: %s", exc)
        try:
            dist.destroy_process_group()
        except Exception as exc:
            log.debug("destroy_process_group after failure: %s", exc)
        self.gen = None
        self.last_teardown_s = time.perf_counter() - t0


    def flat_collective(self, tensors: list[torch.Tensor], start: Callable[[torch.Tensor], dist.Work],
                        then: Callable[[torch.Tensor], object] | None = None) -> str | None:
        """Run one collective (`start(flat)`) per device and dtype, on `tensors` copied into one flat buffer, then
        `then(flat)`, and copy the result back into each tensor. Why it failed, or None: the caller raises, outside
        any except block, so that no traceback pins the broken group."""
        groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for t in tensors:
            groups.setdefault((t.device, t.dtype), []).append(t)
        failure: str | None = None
        try:
            for members in groups.values():
                flat = torch.cat([t.detach().reshape(-1) for t in members])
                failure = self.wait([start(flat)])
                if failure is not None:
                    break
                if then is not None:
                    then(flat)
                offset = 0
                for t in members:
                    t.detach().copy_(flat[offset : offset + t.numel()].view_as(t))
                    offset += t.numel()
        except RuntimeError as exc:
            failure = error_text(exc)
        return failure

    def broadcast_from_rank0(self, tensors: list[torch.Tensor]) -> None:
        """Make `tensors` equal to rank 0's on every rank (one broadcast per dtype and device)."""
        failure = self.flat_collective(tensors, lambda flat: dist.broadcast(flat, src=0, async_op=True))
        if failure is not None:
            raise CommFailure(f"buffer broadcast failed: {failure}")

    def all_gather_bytes(self, data: bytes, world_size: int, group: dist.ProcessGroup | None = None) -> list[bytes]:
        """Every rank's `data` (all the same length), in rank order (of `group`, default: the whole group)."""
        mine = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self.device)
        out = [torch.zeros_like(mine) for _ in range(world_size)]
        failure: str | None = None
        try:
            failure = self.wait([dist.all_gather(out, mine, group=group, async_op=True)])
        except RuntimeError as exc:
            failure = error_text(exc)
        if failure is not None:
            raise CommFailure(f"all-gather failed: {failure}")
        return [t.cpu().numpy().tobytes() for t in out]

    def mean_scalar(self, value: float, world_size: int, group: dist.ProcessGroup | None = None) -> float:
        """The mean of one float over the group, computed in float64: the same value on every rank."""
        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        failure: str | None = None
        try:
            failure = self.wait([dist.all_reduce(t, group=group, async_op=True)])
        except RuntimeError as exc:
            failure = error_text(exc)
        if failure is not None:
            raise CommFailure(f"loss reduction failed: {failure}")
        return float(t.item()) / world_size


class GradientBuckets:
    """Flat gradient buffers, one or more per (device, dtype), with every `.grad` a view into them."""

    def __init__(self, params: Iterable[torch.nn.Parameter], bucket_bytes: int = 64 << 20) -> None:
        self.params = [p for p in params if p.requires_grad]
        self.flats: list[torch.Tensor] = []
        self.views: list[tuple[torch.nn.Parameter, torch.Tensor]] = []
        groups: dict[tuple[torch.device, torch.dtype], list[torch.nn.Parameter]] = {}
        for p in self.params:
            groups.setdefault((p.device, p.dtype), []).append(p)
        for (device, dtype), members in groups.items():
            bucket: list[torch.nn.Parameter] = []
            size = 0
            for param in members:
                if bucket and (size + param.numel()) * param.element_size() > bucket_bytes:
                    self._allocate(bucket, device, dtype)
                    bucket, size = [], 0
                bucket.append(param)
                size += param.numel()
            if bucket:
                self._allocate(bucket, device, dtype)
        self.attach()

    def _allocate(self, bucket: list[torch.nn.Parameter], device: torch.device, dtype: torch.dtype) -> None:
        flat = torch.zeros(sum(p.numel() for p in bucket), device=device, dtype=dtype)
        offset = 0
        for p in bucket:
            view = flat[offset : offset + p.numel()].view_as(p)
            self.views.append((p, view))
            offset += p.numel()
        self.flats.append(flat)

    def attach(self) -> None:
        """Make every `.grad` our view again (user code may have set it to None or replaced it)."""
        for p, view in self.views:
            if p.grad is None or p.grad.data_ptr() != view.data_ptr():
                if p.grad is not None:
                    view.copy_(p.grad)
                p.grad = view

    def zero(self) -> None:
        for flat in self.flats:
            flat.zero_()

    def divide(self, divisor: int) -> None:
        """Divide every bucket (a member alone in a shrunk job: its sum over the units of a step)."""
        self.attach()
        for flat in self.flats:
            flat.div_(divisor)

    def all_reduce_mean(self, world_size: int, wait: Callable[[list[dist.Work]], str | None],
                        on_issued: Callable[[], object] | None = None) -> None:
        """Sum every bucket over the group, then divide by `world_size` (the units of data the step consumed: the
        group's size, or the logical width of a shrunk job): the same bits on every rank, every time.

        `wait(works)` (the group's `Communicator.wait`) waits for the exchange; a message it returns fails it."""
        self.attach()  # backward may have produced a fresh tensor if user code dropped our view
        failure: str | None = None
        try:
            works = [dist.all_reduce(flat, async_op=True) for flat in self.flats]
            if on_issued is not None:
                on_issued()
            failure = wait(works)
            del works
        except RuntimeError as exc:  # Gloo/NCCL report a lost peer as a plain RuntimeError/DistBackendError
            failure = error_text(exc)
        if failure is not None:
            # Raised outside the except block so that no traceback keeps the broken group's Work alive.
            raise CommFailure(failure)
        for flat in self.flats:
            flat.div_(world_size)

