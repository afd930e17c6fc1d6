"""The process groups of a sharded job, and delta reconfiguration: a failure rebuilds only the groups it touched.

A sharded job (`runtime.training.sharded`) talks over three kinds of group, none of them torch's default group:

* **The identity**: every process's default group only says its rank and the world size (torch's bookkeeping:
  `DeviceMesh`, `get_rank`) and refuses every collective (torch's `FakeProcessGroup`, `error_on_collective`). It is
  made once per process and never rebuilt, so no collective can run on it by mistake, and nothing that holds the
  job's other groups depends on it.
* **The mesh groups**: one per row of each mesh dimension (`mesh_groups`: with HSDP 2 x 8, two shard groups of 8
  and eight replicate groups of 2), connected at once when built (Gloo's full mesh, or NCCL), named after the
  generation that built them. FSDP, DTensor and the replica all-reduce run on them. A generation keeps every mesh
  group it can (`plan_rebuild`).
* **The generation's world group**, new every generation and connected lazily (Gloo connects a pair the first
  time the pair talks; NCCL always does): the commit barrier, the members' proofs, and the handoff's and buddy
  copies' point-to-point transfers. Every world-spanning operation is here, where a lost rank blocks everyone:
  keeping it out of the mesh groups leaves them clean for the next generation.

**Which groups a generation rebuilds** (`plan_rebuild`, the same answer in every member, from what each member
published when it joined): a group that a member does not hold (a standby that took a lost rank holds none), a
group cut while it drained (below), and a group whose members issued different numbers of collectives on it (one
of them entered a collective its peers never will: kept, that collective would pair with the next generation's
first), and a group whose ranks it no longer has all of (a job that shrank or grew by a replica group: its
replicate groups change size). The other mesh groups keep their communicators; nothing is exchanged on them to rebuild.

**Draining** when a newer generation forms (`GroupSet.drain`, from the heartbeat thread): the world group's
sockets and those of the mesh groups that held a lost rank are shut (NCCL: those communicators aborted), which
fails every collective waiting on them at once. A member still inside its step `DRAIN_S` later (waiting in a
collective on a surviving group whose peer gave up on the step before entering it) has all its groups cut: a cut
group is always rebuilt, so a drain can cost groups but never correctness.
"""

from __future__ import annotations

import datetime
import itertools
import logging
import math
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist
from torch._C._distributed_c10d import FakeProcessGroup
from torch.distributed import distributed_c10d as c10d
from torch.distributed.device_mesh import DeviceMesh

from runtime.training.comm import (
    CommFailure,
    Connecting,
    Sockets,
    connect_timeout,
    error_text,
    shut_sockets,
    tcp_socket_inodes,
)

log = logging.getLogger("trainmover.runtime")

IDENTITY_BACKEND = "trainmover_identity"
DRAIN_S = 0.5
"""How long after a newer generation formed a member may still be inside its step before all its groups are cut."""
DRAIN_POLL_S = 0.02


def _identity(common: Any, _options: Any) -> dist.ProcessGroup:
    # torch's stubs lag its bindings here: Options() takes no argument and has error_on_collective.
    options = FakeProcessGroup.Options()  # type: ignore[call-arg]
    options.error_on_collective = True  # type: ignore[attr-defined]
    group: dist.ProcessGroup = FakeProcessGroup._create_internal(  # type: ignore[call-arg, assignment]
        common.group_rank, common.group_size, options)
    return group


def _register_identity() -> None:
    if IDENTITY_BACKEND.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(IDENTITY_BACKEND, _identity, extended_api=True, devices=["cpu", "cuda"])


def mesh_groups(shape: tuple[int, ...], names: tuple[str, ...]) -> dict[str, tuple[int, ...]]:
    """Every mesh group: name + index (`shard0`, `replicate3`) -> its global ranks, ranks laid out row-major as
    `init_device_mesh` lays them out."""
    out: dict[str, tuple[int, ...]] = {}
    strides = [math.prod(shape[d + 1:]) for d in range(len(shape))]
    for d, name in enumerate(names):
        others = [range(n) if e != d else range(1) for e, n in enumerate(shape)]
        for index, corner in enumerate(itertools.product(*others)):
            base = sum(c * s for c, s in zip(corner, strides, strict=True))
            out[f"{name}{index}"] = tuple(base + i * strides[d] for i in range(shape[d]))
    return out


@dataclass(frozen=True, slots=True)
class Held:
    """A member's view of one mesh group it holds, as published when it joins a generation."""

    built: int
    """The generation that built it (every member of a group built it together)."""
    issued: int
    """Collectives issued on it so far; -1: cut while draining."""
    size: int = 0
    """Its number of ranks (0: not said)."""


def plan_rebuild(groups: Mapping[str, tuple[int, ...]], held: Mapping[int, Mapping[str, Held]],
                 full: bool = False) -> frozenset[str]:
    """The mesh groups the next generation rebuilds (see the module docstring); `held[rank]`: what each member
    holds. `full`: every group (the full rebuild, for comparison)."""
    out = set()
    for key, ranks in groups.items():
        views = [held.get(r, {}).get(key) for r in ranks]
        if full or any(v is None or v.issued < 0 or v.size not in (0, len(ranks)) for v in views) \
                or len(set(views)) != 1:
            out.add(key)
    return frozenset(out)


def _issued(pg: dist.ProcessGroup) -> int:
    """Collectives issued on `pg` so far (torch's per-group sequence number)."""
    return int(pg._get_sequence_number_for_group())  # type: ignore[attr-defined]


@dataclass(slots=True)
class _Group:
    pg: dist.ProcessGroup
    ranks: tuple[int, ...]
    built: int
    sockets: set[int] = field(default_factory=set)


class GroupSet:
    """This process's groups of a sharded job (see the module docstring). The main thread enters and leaves
    generations; the heartbeat thread drains (`drain`). Thread-safe."""

    def __init__(self, backend: str, store: dist.Store, timeout_s: float, *, full: bool = False,
                 backups: bool = False, newest_gen: Callable[[], int] | None = None) -> None:
        """`full`: rebuild every group every generation (the full rebuild, for comparison); `backups`: build each
        generation a world group of its own for persistent backups (`backup`); `newest_gen()`: the newest generation
        this process has seen (a building older than it is abandoned at once)."""
        self.newest_gen = newest_gen
        _register_identity()
        self.backend = backend
        self.store = dist.PrefixStore("tm-groups", store)
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.full = full
        self.mesh: dict[str, _Group] = {}
        self.world: dist.ProcessGroup | None = None
        self.host_world: dist.ProcessGroup | None = None
        """The world group in host memory (Gloo) for buddy copies: the world group itself unless it is NCCL."""
        self.backups = backups
        self.backup: dist.ProcessGroup | None = None
        """The generation's group for torch's collective checkpoint save (Gloo, lazily connected), used from the
        checkpoint's own thread only; never destroyed (a save may still be inside it when its generation ends)."""
        self.gen: int | None = None
        self.rebuilt: frozenset[str] = frozenset()
        """The mesh groups the last generation rebuilt (in the whole job), of `total`."""
        self.for_new_members = 0
        """Of those, the groups some member did not hold (a standby that took a lost rank): what the loss forces."""
        self.total = 0
        self.last_teardown_s = 0.0
        self.last_build_s = 0.0
        self._identity: tuple[int, int] | None = None
        self._baseline: set[int] = set()
        self._cut: set[str] = set()
        self._lock = threading.RLock()
        self._drain_timer: threading.Thread | None = None
        self._abandoned: list[dist.ProcessGroup] = []
        self._connecting: Connecting | None = None
        """The generation whose mesh groups are being built (Gloo), which a newer one abandons (`abandon_older`)."""

    # -- what a member publishes when it joins ---------------------------------------------------------
    def held(self) -> tuple[dict[str, int], dict[str, int], dict[str, int]]:
        """(group -> generation that built it, group -> collectives issued on it, -1 when cut, group -> its ranks)."""
        with self._lock:
            built = {k: g.built for k, g in self.mesh.items()}
            issued = {k: -1 if k in self._cut else _issued(g.pg) for k, g in self.mesh.items()}
            sizes = {k: len(g.ranks) for k, g in self.mesh.items()}
        return built, issued, sizes

    # -- entering and leaving a generation -------------------------------------------------------------
    def enter(self, g: int, rank: int, world: int, shape: tuple[int, ...], names: tuple[str, ...],
              held: Mapping[int, Mapping[str, Held]], connect_timeout_s: float) -> frozenset[str]:
        """Join generation g's groups: keep the mesh groups `plan_rebuild` keeps, build the others this rank is
        in, and a new world group. Returns the mesh groups rebuilt (in the whole job)."""
        t0 = time.perf_counter()
        # A new world size (a job that shrank or grew) remakes the identity, which destroys every group: each
        # member of the last generation rebuilds them all; a new member holds none, so it agrees.
        resized = self._identity is not None and self._identity[1] != world
        self._ensure_identity(rank, world)
        groups = mesh_groups(shape, names)
        plan = plan_rebuild(groups, held, full=self.full or resized)
        self.total = len(groups)
        self.for_new_members = sum(1 for k in plan if any(held.get(r, {}).get(k) is None for r in groups[k]))
        mine = {k: r for k, r in groups.items() if rank in r}
        with self._lock:
            for key in [k for k in self.mesh if k in plan or k not in mine]:
                self._drop(self.mesh.pop(key))
            self._cut.clear()
        self.last_teardown_s += time.perf_counter() - t0
        t1 = time.perf_counter()
        timeout = connect_timeout(self.backend, connect_timeout_s)
        failure: str | None = None
        start = Sockets.now()  # one read of the socket tables (a busy host's are long) serves both uses
        connecting = Connecting(g, world, start) if self.backend == "gloo" else None
        with self._lock:
            self._connecting = connecting
        if connecting is not None and self.newest_gen is not None and self.newest_gen() > g:
            connecting.abandon()  # a newer one formed before this process got here
        try:
            before = set(start.connections)
            for key in sorted(k for k in mine if k in plan):
                # Named after the group alone: torch's DTensor caches shardings that name a mesh's groups, and
                # must find the new incarnation under the old name. Its rendezvous keys are the generation's.
                pg = self._new_group(g, key, mine[key], rank, self.backend, timeout, connecting=connecting)
                after = tcp_socket_inodes()
                with self._lock:
                    self.mesh[key] = _Group(pg, mine[key], g, after - before)
                before = after
            self._baseline = tcp_socket_inodes() - self._mesh_sockets()
            everyone = tuple(range(world))
            # Lazily connected: its pairs connect on first use, under the collective timeout.
            self.world = self._new_group(g, f"world{g}", everyone, rank, self.backend, self.timeout, lazy=True)
            self.host_world = self.world if self.backend == "gloo" else \
                self._new_group(g, f"host{g}", everyone, rank, "gloo", self.timeout, lazy=True)
            if self.backups:
                self.backup = self._new_group(g, f"backup{g}", everyone, rank, "gloo", self.timeout, lazy=True)
        except RuntimeError as exc:  # a peer died while connecting (DistError/DistStoreError are RuntimeErrors)
            failure = error_text(exc)
        finally:
            with self._lock:
                self._connecting = None
        if connecting is not None and connecting.abandoned:  # the cause, whatever Gloo said of it
            failure = f"generation {g} was superseded while its groups connected"
        if failure is not None:
            self.leave()
            raise CommFailure(f"could not build the groups of generation {g}: {failure}")
        for group in self.mesh.values():  # connecting was bounded; collectives get the long timeout
            c10d._set_pg_timeout(self.timeout, group.pg)
        with self._lock:
            self.gen = g
        self.rebuilt = plan
        self.last_build_s = time.perf_counter() - t1
        return plan

    def leave(self, abandoned: bool = False) -> None:
        """Leave the current generation: its world groups go; the mesh groups stay until the next plan.

        `abandoned`: work on the world group was given up while it waited (`Communicator.wait`), perhaps on a pair
        that never connected (a lazily connected group waits for the peer's address in the store, where no socket
        can be shut): the group is dropped without being destroyed, since destroying it would wait for that work."""
        t0 = time.perf_counter()
        with self._lock:
            if self.world is None and self.host_world is None:
                self.gen = None
                return  # not in a generation: nothing of one to leave (and no baseline to tell its sockets by)
            self.gen = None
            self._drain_timer = None  # its thread sees `gen` change and ends
            worlds = {id(pg): pg for pg in (self.world, self.host_world) if pg is not None}
            if self.backup is not None:
                self._abandoned.append(self.backup)  # its sockets are shut below with the world group's
            self.world = self.host_world = self.backup = None
            sockets = tcp_socket_inodes() - self._baseline - self._mesh_sockets()
        if self.backend == "gloo":
            shut_sockets(sockets)
        for pg in worlds.values():
            if abandoned:
                self._abandoned.append(pg)  # kept alive for good: its stuck thread ends at its own timeout
            else:
                self._destroy(pg)
        self.last_teardown_s = time.perf_counter() - t0

    def close(self) -> None:
        """Leave every group, the identity too (the job is over for this process)."""
        self.leave()
        with self._lock:
            for key in list(self.mesh):
                self._drop(self.mesh.pop(key))
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception as exc:
                log.debug("destroy_process_group: %s", exc)
        self._identity = None

    def device_mesh(self, device_type: str, rank: int, shape: tuple[int, ...], names: tuple[str, ...]) -> DeviceMesh:
        """The generation's `DeviceMesh`, on the mesh groups this rank is in."""
        import torch

        groups = mesh_groups(shape, names)
        mine = []
        for name in names:
            (key,) = [k for k, r in groups.items() if k.rstrip("0123456789") == name and rank in r]
            mine.append(self.mesh[key].pg)
        grid = torch.arange(math.prod(shape), dtype=torch.int).reshape(shape)
        return DeviceMesh.from_group(mine, device_type, mesh=grid, mesh_dim_names=names)

    # -- draining (heartbeat thread) -------------------------------------------------------------------
    def abandon_older(self, newer: int) -> None:
        """Generation `newer` formed: end the building of an older generation's groups (`Connecting.abandon`)."""
        with self._lock:
            if self._connecting is not None and self._connecting.gen < newer:
                self._connecting.abandon()

    def drain(self, newer: int, lost: Iterable[int], peers: Callable[[], Mapping[int, Mapping[str, Held]]]) -> None:
        """Generation `newer` formed and `lost` ranks left (a no-op unless this member is in an older one): fail
        every collective that waits on them (the world group's, and the mesh groups holding a lost rank), at once.

        Then, until this member leaves the old generation: `peers()` says what the members that already joined
        the new one hold (`Held`, as they published it); a group on which a peer that left issued fewer
        collectives than this member is cut (this member waits, or will, in one the peer never enters). A member
        still in the old generation `DRAIN_S` later has every group cut."""
        lost = set(lost)
        with self._lock:
            if self.gen is None or self.gen >= newer or self._drain_timer is not None:
                return
            gen = self.gen
            self._cut_world()
            for key, group in self.mesh.items():
                if lost & set(group.ranks):
                    self._cut_group(key)
            thread = threading.Thread(target=self._drain, args=(gen, peers), name="tm-drain", daemon=True)
            self._drain_timer = thread
        thread.start()

    def _drain(self, gen: int, peers: Callable[[], Mapping[int, Mapping[str, Held]]]) -> None:
        deadline = time.monotonic() + DRAIN_S
        while time.monotonic() < deadline:
            try:
                views = peers()
            except Exception as exc:  # the store is unreachable: the deadline decides
                log.debug("drain: %s", exc)
                views = {}
            with self._lock:
                if self.gen != gen:
                    return
                for key, group in self.mesh.items():
                    if key in self._cut:
                        continue
                    mine = _issued(group.pg)
                    for r in group.ranks:
                        held = views.get(r, {}).get(key)
                        if held is not None and held.built == group.built and held.issued < mine:
                            self._cut_group(key)
                            break
            time.sleep(DRAIN_POLL_S)
        with self._lock:
            if self.gen == gen:
                log.info("still inside generation %s %.1f s after a newer one formed: every group cut", gen, DRAIN_S)
                for key in list(self.mesh):
                    self._cut_group(key)

    # -- internals ---------------------------------------------------------------------------------------
    def _ensure_identity(self, rank: int, world: int) -> None:
        if self._identity == (rank, world) and dist.is_initialized():
            return
        if dist.is_initialized():  # a new rank or world size: nothing held is valid any more
            with self._lock:
                for key in list(self.mesh):
                    self._drop(self.mesh.pop(key))
            dist.destroy_process_group()
        dist.init_process_group(IDENTITY_BACKEND, store=dist.HashStore(), rank=rank, world_size=world)
        self._identity = (rank, world)

    def _new_group(self, g: int, name: str, ranks: tuple[int, ...], rank: int, backend: str,
                   timeout: datetime.timedelta, lazy: bool = False,
                   connecting: Connecting | None = None) -> dist.ProcessGroup:
        """`connecting`: the building that a newer generation may abandon (a group connected now, on Gloo)."""
        import os

        previous = os.environ.get("TORCH_GLOO_LAZY_INIT")
        if lazy and backend == "gloo":
            os.environ["TORCH_GLOO_LAZY_INIT"] = "1"  # read once, as the group is built
        try:
            store: dist.Store = dist.PrefixStore(f"g{g}", self.store)
            if connecting is not None:
                store = connecting.store(store)
            pg, _ = c10d._new_process_group_helper(
                len(ranks), ranks.index(rank), list(ranks), backend, store,
                group_name=c10d.GroupName(f"tm.{name}"), timeout=timeout, pg_tag=f"tm:{name}", group_desc=name)
        finally:
            if lazy and backend == "gloo":
                if previous is None:
                    os.environ.pop("TORCH_GLOO_LAZY_INIT", None)
                else:
                    os.environ["TORCH_GLOO_LAZY_INIT"] = previous
        c10d._world.pg_group_ranks[pg] = {r: i for i, r in enumerate(ranks)}
        return pg

    def _mesh_sockets(self) -> set[int]:
        return set().union(*(g.sockets for g in self.mesh.values())) if self.mesh else set()

    def _cut_world(self) -> None:
        if self.backend == "gloo":
            shut_sockets(tcp_socket_inodes() - self._baseline - self._mesh_sockets())
        else:
            for pg in (self.world, self.host_world):
                if pg is not None:
                    self._abort(pg)

    def _cut_group(self, key: str) -> None:
        if key in self._cut:
            return
        self._cut.add(key)
        group = self.mesh[key]
        if self.backend == "gloo":
            shut_sockets(group.sockets)
        else:
            self._abort(group.pg)

    @staticmethod
    def _abort(pg: dist.ProcessGroup) -> None:
        try:
            c10d._abort_process_group(pg)
        except Exception as exc:  # an aborted communicator may complain; it is gone either way
            log.debug("NCCL abort: %s", exc)

    def _drop(self, group: _Group) -> None:
        """Fail whatever still waits on a group (a collective its peers never entered), then destroy it."""
        if self.backend == "gloo":
            shut_sockets(group.sockets)
        else:
            self._abort(group.pg)
        self._destroy(group.pg)

    @staticmethod
    def _destroy(pg: dist.ProcessGroup) -> None:
        try:
            dist.destroy_process_group(pg)
        except Exception as exc:
            log.debug("destroying a group after a failure: %s", exc)


__all__ = ["DRAIN_S", "GroupSet", "Held", "mesh_groups", "plan_rebuild"]
