"""Sharded training (FSDP2, HSDP, DTensor tensor parallelism) that survives the loss of workers.

`ShardedTrainer` is the `Trainer` for models that no single process holds whole. Parallelism comes from torch
itself: the script's `build(mesh)` applies `fully_shard` and/or `parallelize_module` to a model on the
`DeviceMesh` the runtime hands it, and returns the model and its optimizer. The runtime keeps owning what it
owns for data parallelism: the step, the data position (by data-parallel rank), the RNG, and exact replay.

The mesh (`MeshSpec`) has up to three named dimensions, outermost first, laid out as `init_device_mesh` lays
ranks out (row-major): `replicate` (whole copies of the state: HSDP's replica groups, or DP in DP x TP),
`shard` (FSDP's shards) and `tp` (tensor parallelism). A rank's state is defined by its coordinates other than
`replicate`: its *state class*. Every rank of a class holds the same bits, so a lost rank's state comes from a
peer of its class, from memory, like a data-parallel replica's.

Each generation builds its mesh on the generation's group and calls `build(mesh)` again: survivors copy their
own state into the new model (a local copy, no transfer), receivers get theirs from a class peer. Old groups are
released first (FSDP holds its process groups; Gloo closes a group's sockets only when its last reference goes).

The commit point of a sharded step: a rank's gradients are complete once its backward's collectives (and the
gradient clipping's norm) are done; it then enters one small all-reduce over every rank (the commit barrier,
which also averages the loss) and applies the optimizer only after it. If any rank commits step s, every rank
entered that barrier, so every survivor holds complete gradients of s: one whose barrier failed reports them
as *pending* and commits s while the next generation forms. If no rank committed s, every rank replays it.
Either way, every state class ends at the same step before anyone trains on.
"""

from __future__ import annotations

import functools
import gc
import hashlib
import json
import logging
import math
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import _clear_sharding_prop_cache  # both caches, Python's and C++'s

from runtime.training.backup import BackupSettings, BackupWriter, Shards, has_backup, is_remote
from runtime.training.buddy import BuddyCopies, BuddyStatus, Snapshot, default_offset, plan_restore
from runtime.training.comm import CommFailure, error_text
from runtime.training.data import StepData, as_step_data, derive_seed
from runtime.training.elastic import CURSOR_STATE, DataCursor, Layout
from runtime.training.groups import GroupSet, Held
from runtime.training.handoff import (
    GlooLinks,
    HandoffPlan,
    HandoffSession,
    HandoffStats,
    MemberStatus,
    StateLost,
    run_handoff,
)
from runtime.training.job import Job, init
from runtime.training.state import Stateful, TrainingState, local_shard
from runtime.training.trainer import (
    GenerationChanged,
    Joining,
    StepResult,
    Trainer,
    check_group,
    check_step_options,
    scaled_lr,
)
from runtime.wire import store as keys
from runtime.wire.protocol import Generation, HoldsState, Joined, StandbyReady, StateHomes

log = logging.getLogger("trainmover.runtime")

DIMS = ("replicate", "shard", "tp")
DEFAULT_BUDDY_EVERY = 10
"""Steps between buddy-copy refreshes when a shard has no replica (docs/benchmarks.md: its cost at 1, 10, 100)."""
BUILD_SEED = 0x5EED
"""Offset of the seed under which `build(mesh)` runs: every process builds the same initial model."""

Built = tuple[nn.Module, torch.optim.Optimizer] | tuple[nn.Module, torch.optim.Optimizer, Any]
"""What `build(mesh)` returns: the parallelised model and its optimizer, and optionally an LR scheduler."""


@dataclass(frozen=True, slots=True)
class MeshSpec:
    """The job's device mesh: how many ranks along each named dimension (the product is the job's world size).

    Dimensions of size 1 are left out of the `DeviceMesh` the runtime builds; `names` lists the ones kept.
    """

    replicate: int = 1
    """Whole copies of the state (HSDP's replica groups, or the data-parallel degree of DP x TP)."""
    shard: int = 1
    """FSDP's shard group size."""
    tp: int = 1
    """Tensor-parallel degree (ranks of one tensor-parallel group share a batch)."""

    def __post_init__(self) -> None:
        for name in DIMS:
            size = getattr(self, name)
            if not isinstance(size, int) or size < 1:
                raise ValueError(f"MeshSpec.{name} must be a positive integer, got {size!r}")

    @property
    def names(self) -> tuple[str, ...]:
        kept = tuple(n for n in DIMS if getattr(self, n) > 1)
        return kept or ("replicate",)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(getattr(self, n) for n in self.names)

    @property
    def world_size(self) -> int:
        return self.replicate * self.shard * self.tp

    @property
    def dp_world(self) -> int:
        """Ranks that read different batches (every rank of a tensor-parallel group reads the same one)."""
        return self.replicate * self.shard

    @property
    def group_size(self) -> int:
        """Ranks of one replica group (shard x tp): the unit a job shrinks and grows by."""
        return self.shard * self.tp

    def with_replicas(self, replicate: int) -> MeshSpec:
        """The same mesh with `replicate` replica groups (a job shrunk, or grown back)."""
        return MeshSpec(replicate=replicate, shard=self.shard, tp=self.tp)

    def coords(self, rank: int) -> dict[str, int]:
        """Rank's coordinate along every dimension (size-1 dimensions at 0), row-major as `init_device_mesh`."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside a mesh of {self.world_size} ranks")
        out = {}
        rest = rank
        for name in reversed(DIMS):
            out[name] = rest % getattr(self, name)
            rest //= getattr(self, name)
        return {n: out[n] for n in DIMS}

    def dp_rank(self, rank: int) -> int:
        c = self.coords(rank)
        return c["replicate"] * self.shard + c["shard"]

    def state_class(self, rank: int) -> tuple[int, int]:
        """What defines a rank's state: (shard, tp). Ranks of one class differ only along `replicate`."""
        c = self.coords(rank)
        return c["shard"], c["tp"]

    def describe(self, rank: int) -> str:
        c = self.coords(rank)
        parts = [f"shard {c['shard']} of {self.shard}"] if self.shard > 1 else []
        parts += [f"tensor-parallel slice {c['tp']} of {self.tp}"] if self.tp > 1 else []
        return ", ".join(parts) or "the whole state"


def plan_sharded_handoff(mesh: MeshSpec,
                         statuses: list[MemberStatus]) -> tuple[int, dict[tuple[int, int], HandoffPlan]]:
    """The step every member ends at, and per state class who sends its state to whom.

    A member whose gradients of `target` were pending counts as holding `target` (it commits that step first).
    Raises `StateLost`, naming the shard, when a class has receivers and no member holding the target step.
    """
    if len(statuses) != mesh.world_size:
        raise ValueError(f"{len(statuses)} members for a mesh of {mesh.world_size} ranks")
    holders = [s for s in statuses if s.has_state]
    if not holders:
        raise StateLost("every copy of the training state was lost at once (no surviving rank holds any); restart "
                        "the job from its last backup (trainmover run --resume-from DIR)")
    target = max(s.step for s in holders)

    def at_target(s: MemberStatus) -> bool:
        return s.has_state and (s.step == target or (s.pending and s.step + 1 == target))

    plans: dict[tuple[int, int], HandoffPlan] = {}
    for cls in sorted({mesh.state_class(s.rank) for s in statuses}):
        members = [s for s in statuses if mesh.state_class(s.rank) == cls]
        sources = tuple(s.rank for s in members if at_target(s))
        receivers = tuple(s.rank for s in members if not at_target(s))
        if receivers and not sources:
            lost = ", ".join(str(s.rank) for s in members)
            raise StateLost(
                f"{mesh.describe(members[0].rank)} (held by rank(s) {lost}) was lost with every copy of it: no "
                f"surviving rank holds it at step {target}; restart the job from its last backup (--resume-from), or "
                "run with --backup-dir, or with replica groups (MeshSpec.replicate > 1) so that every shard has a "
                "second home")
        plans[cls] = HandoffPlan(target, sources, receivers)
    return target, plans


def state_homes(mesh: MeshSpec, buddy_offset: int | None) -> list[list[int]]:
    """For each rank, the other ranks that hold its state: its class peers (other replica groups) and, with buddy
    copies every `buddy_offset` ranks, its copy's keeper. The coordinator places replacements away from them."""
    n = mesh.world_size
    homes = [[p for p in range(n) if p != r and mesh.state_class(p) == mesh.state_class(r)] for r in range(n)]
    if buddy_offset is not None:
        homes = [sorted({*h, (r + buddy_offset) % n}) for r, h in enumerate(homes)]
    return homes


def _is_comm_error(message: str) -> bool:
    """Whether an error raised inside forward/backward came from a collective (a lost peer), not the script."""
    lowered = message.lower()
    return any(word in lowered for word in ("gloo", "nccl", "connection", "peer", "timed out", "socket",
                                            "process group", "broken pipe"))


def release_groups(model: nn.Module | None, mesh: DeviceMesh | None) -> None:
    """Drop the references a parallelised model and its mesh keep to their process groups.

    FSDP2 keeps its shard and replicate groups in each parameter group's mesh info, and a `DeviceMesh` keeps a
    registry of its groups. Gloo closes a group's sockets only when the last reference to it goes, and peers
    still blocked on this member wait until then: a member leaving a broken generation drops them all first.
    """
    if mesh is not None:
        registry = getattr(mesh, "_pg_registry", None)
        if isinstance(registry, dict):
            registry.clear()
    if model is None:
        return
    infos: list[Any] = []
    for module in model.modules():
        get_state = getattr(module, "_get_fsdp_state", None)
        if not callable(get_state):
            continue
        state = get_state()
        for group in getattr(state, "_fsdp_param_groups", None) or []:
            infos += [getattr(group, "mesh_info", None), getattr(group, "post_forward_mesh_info", None)]
            for param in getattr(group, "fsdp_params", []):
                infos += [getattr(param, "mesh_info", None), getattr(param, "post_forward_mesh_info", None)]
    for info in infos:
        if info is None:
            continue
        for name, value in list(vars(info).items()):
            if isinstance(value, dist.ProcessGroup):
                setattr(info, name, None)


class ShardedTrainer(Trainer):
    """Training of a model sharded by torch (FSDP2 / HSDP / DTensor TP) on a `MeshSpec`, surviving lost workers."""

    def __init__(
        self,
        build: Callable[[DeviceMesh], Built],
        mesh: MeshSpec,
        loss_fn: Callable[[nn.Module, Any], torch.Tensor],
        data: StepData | Callable[[int, int, int], Any],
        *,
        seed: int = 0,
        job: Job | None = None,
        clip_grad_norm: float | None = None,
        clip_grad_value: float | None = None,
        accumulation_steps: int = 1,
        amp: Literal["bf16"] | None = None,
        buddy_every: int | None = None,
        buddy_offset: int | None = None,
        reconfigure: Literal["delta", "full"] = "delta",
    ) -> None:
        """
        Args:
            build: `build(mesh) -> (model, optimizer[, scheduler])`: builds the model, parallelises it on `mesh`
                (`fully_shard`, `parallelize_module`) and makes its optimizer. Called once per generation of the
                job, under the same seed every time: it must build the same model from nothing (no I/O that
                differs between calls); the runtime copies the trained state into what it returns.
            mesh: the job's mesh; its world size must equal the job's number of workers.
            loss_fn: `loss_fn(model, batch) -> scalar loss`.
            data: the batches, addressed by step and data-parallel rank: `batch_at(step, dp_rank, dp_world)`;
                every rank of one tensor-parallel group reads the same batch.
            seed: base of the per-step seeds (micro-batch m of step s on data-parallel rank r: (seed, s, r, m)).
            job: the joined job; defaults to `runtime.init()`.
            clip_grad_norm: clip the gradients to this total 2-norm (over every shard) before the optimizer step.
            clip_grad_value: clip each gradient element to [-value, value] (after norm clipping).
            accumulation_steps: micro-batches per step (FSDP synchronises gradients on the last one only).
            amp: "bf16" runs the forward pass under bf16 autocast. fp16 with a GradScaler is refused: its
                overflow check would need an all-reduce over the shards that torch's GradScaler does not do.
            buddy_every: refresh every rank's buddy copy (`runtime.training.buddy`) every this many steps; 0 turns them
                off. Default: `DEFAULT_BUDDY_EVERY` when the mesh has no replica groups (FSDP over every rank, no
                other home for a shard), off otherwise.
            buddy_offset: a rank's copy is kept by the rank this many places after it (default: half the world,
                on another host when hosts hold consecutive ranks).
            reconfigure: "delta" (default): a recovery rebuilds only the mesh groups the loss touched
                (`runtime.training.groups`); "full": every group, every generation (for comparison).
        """
        if amp not in (None, "bf16"):
            raise ValueError(f"a sharded job takes amp=None or 'bf16', got {amp!r}: fp16 needs a GradScaler whose "
                             "overflow check spans every shard; use bf16")
        if not isinstance(mesh, MeshSpec):
            raise TypeError(f"mesh must be a runtime.MeshSpec, got {type(mesh).__name__}")
        check_step_options(clip_grad_norm, clip_grad_value, accumulation_steps)
        if reconfigure not in ("delta", "full"):
            raise ValueError(f"reconfigure must be 'delta' or 'full', got {reconfigure!r}")
        self.job = job or init()
        if is_remote(self.job.cfg.backup_dir) or is_remote(self.job.cfg.resume_from):
            raise ValueError("a sharded job's backups go to a directory every host mounts (--backup-dir DIR); "
                             "s3:// and az:// backups cover data-parallel jobs in this version")
        workers = self.job.num_workers()
        if mesh.world_size != workers:
            raise ValueError(f"the mesh {mesh} has {mesh.world_size} ranks but the job has {workers} workers: make "
                             "replicate x shard x tp equal the job's number of workers (--nproc)")
        if buddy_every is None:
            buddy_every = DEFAULT_BUDDY_EVERY if mesh.replicate == 1 and mesh.world_size > 1 else 0
        if buddy_every < 0:
            raise ValueError(f"buddy_every must be 0 (off) or a positive number of steps, got {buddy_every}")
        if buddy_offset is not None and not 0 < buddy_offset < mesh.world_size:
            raise ValueError(f"buddy_offset must be between 1 and {mesh.world_size - 1}, got {buddy_offset}")
        self.buddies = BuddyCopies(buddy_every, buddy_offset) if buddy_every else None
        self._buddy_group: dist.ProcessGroup | None = None
        self.build = build
        self.full_mesh = mesh
        """The job's mesh at its full width (`--nproc`)."""
        self.mesh_spec = mesh
        """The generation's mesh: the full one, or fewer replica groups while the job runs shrunk."""
        self.device_mesh: DeviceMesh | None = None
        self.loss_fn = loss_fn
        self.data = as_step_data(data)
        self.seed = seed
        self.clip_grad_norm = clip_grad_norm
        self.clip_grad_value = clip_grad_value
        self.accumulation_steps = accumulation_steps
        self.broadcast_buffers = True
        self._plateau = False
        self._autocast_dtype = torch.bfloat16 if amp == "bf16" else None
        self.scaler = None
        self._extras: dict[str, Stateful] = {}
        self.model: nn.Module | None = None  # type: ignore[assignment]
        self.optimizer: torch.optim.Optimizer | None = None  # type: ignore[assignment]
        self.scheduler: Any = None
        self.state: TrainingState | None = None  # type: ignore[assignment]
        self._buffers: list[torch.Tensor] = []
        self._buffer_snapshot: list[torch.Tensor] = []
        self._snapshot_step = 0
        self._fsdp: list[Any] = []
        self._sync_replicas = False
        self._pending: int | None = None
        self._pending_loss: float | None = None
        """The step whose gradients are complete but not yet applied (see the module's docstring)."""
        self._place: tuple[int, int] | None = None
        """(rank, world size) of the last model built: the coordinates its DTensor shardings were cached under."""
        self._lr_factor = 1.0
        self._units_per_step = 0
        """The learning rate's scale and the units of data of the step computed last (applied with it)."""
        self._spec_checked = False
        self._device_type = "cuda" if self.job.cfg.backend == "nccl" else "cpu"
        cfg = self.job.cfg
        self.groups = GroupSet(cfg.backend, self.job.store, cfg.collective_timeout_s, full=reconfigure == "full",
                               backups=bool(cfg.backup_dir or cfg.resume_from),
                               newest_gen=lambda: self.job.heartbeat.latest_gen)
        self._backup_proven: int | None = None
        """The generation whose backup group's peers proved they belong to the job."""
        self._record: Generation | None = None
        self._init_membership(torch.device(self._device_type, torch.cuda.current_device())
                              if self._device_type == "cuda" else torch.device("cpu"))
        if cfg.shrink in ("lr-linear", "lr-sqrt"):
            # How far into the data the job is depends on the widths it ran at: part of the state (elastic.py).
            cursor = DataCursor()
            self._extras[CURSOR_STATE] = cursor
            self.cursor = cursor

    # -- public --------------------------------------------------------------------------------------
    def register_state(self, name: str, obj: Stateful) -> None:
        """Hand `obj` (anything with `state_dict`/`load_state_dict`, not tied to the model) over with the state."""
        if self.gen is not None or self.digest is not None:
            raise RuntimeError("register_state() must be called before fit()")
        if not name or "." in name or name in self._extras:
            raise ValueError(f"a registered state's name must be new, non-empty and without dots, got {name!r}")
        self._extras[name] = obj

    @property
    def dp_rank(self) -> int:
        assert self.rank is not None
        return self.mesh_spec.dp_rank(self.rank)

    # -- building a generation's model ---------------------------------------------------------------
    def _build(self) -> TrainingState:
        """Build this generation's mesh and a fresh model on it (under the build seed: the same in every process)."""
        assert self.rank is not None
        place = (self.rank, self.world_size)
        if self._place is not None and place != self._place:
            # DTensor caches its sharding decisions by mesh, and a mesh is equal to another of the same shape
            # whatever groups it names: a member whose coordinates changed (a shrink renumbered it, or the world
            # changed size) would find its old groups' names there.
            _clear_sharding_prop_cache()
        self._place = place
        device_mesh = self.groups.device_mesh(self._device_type, self.rank, *self._dims())
        if self.buddies is not None:
            # Buddy copies travel in host memory, over the generation's (lazily connected) Gloo world group.
            self._buddy_group = self.groups.host_world
        torch.manual_seed(derive_seed(self.seed, BUILD_SEED))
        built = self.build(device_mesh)
        if not isinstance(built, tuple) or len(built) not in (2, 3):
            raise TypeError("build(mesh) must return (model, optimizer) or (model, optimizer, scheduler)")
        model, optimizer = built[0], built[1]
        scheduler = built[2] if len(built) == 3 else None
        state = TrainingState(model, optimizer, scheduler)
        for name, obj in self._extras.items():
            state.register(name, obj)
        if self.job.faults:
            optimizer.register_step_post_hook(self._optimizer_fault)
        self.device_mesh = device_mesh
        return state

    def _adopt(self, state: TrainingState) -> None:
        self.state = state
        self.model, self.optimizer, self.scheduler = state.model, state.optimizer, state.scheduler
        self._plateau = isinstance(self.scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)
        self._buffers = list(state.model.buffers())
        self._buffer_snapshot = [torch.empty_like(b) for b in self._buffers]
        self._fsdp = [m for m in state.model.modules() if isinstance(m, FSDPModule)]
        # Without FSDP over the replicate dimension (DP x TP), the runtime averages the gradients over it.
        self._sync_replicas = not self._fsdp and self.mesh_spec.replicate > 1

    @staticmethod
    def _copy_state(old: TrainingState, new: TrainingState, step: int) -> None:
        """Move this member's own state into the new generation's model: a local copy of its shards."""
        meta = old.meta(step).copy()  # the form a peer would have sent
        into = new.prepare_receive(meta)
        source = dict(old.tensors())
        with torch.no_grad():
            for key, t in into:
                t.copy_(source[key])
        new.apply_meta(meta)

    def _dims(self) -> tuple[tuple[int, ...], tuple[str, ...]]:
        """The generation's mesh shape, under the job's dimension names: a shrunk job keeps its `replicate`
        dimension (of fewer groups, one even), so that `build(mesh)` sees the same names in every generation."""
        names = self.full_mesh.names
        return tuple(getattr(self.mesh_spec, n) for n in names), names

    def _replica_size(self) -> int:
        """`StateHomes.replica_size`: the ranks of one replica group when the job can run with fewer of them
        (replica groups to spare, every rank's state in them: no buddy copies), else 0."""
        full = self.full_mesh
        if full.replicate < 2 or self.buddies is not None or self.job.cfg.shrink == "off":
            return 0
        return full.group_size

    # -- the generation's groups: delta reconfiguration (runtime.training.groups) ---------------------
    def _joined_record(self) -> Joined:
        built, issued, sizes = self.groups.held()
        return Joined(built, issued, sizes)

    def _form_groups(self, g: int, rank: int, record: Generation, joined: dict[int, Joined]) -> float:
        """Keep the mesh groups no loss touched, build the others and a new world group; every new group's
        peers prove they belong to the job before anything else is exchanged on it."""
        cfg = self.job.cfg
        unit = self.full_mesh.group_size
        if record.world_size % unit:
            raise CommFailure(f"generation {g} has {record.world_size} members, not whole replica groups of {unit}")
        self.mesh_spec = self.full_mesh.with_replicas(record.world_size // unit)
        held = {r: {k: Held(j.built[k], j.issued.get(k, -1), j.sizes.get(k, 0)) for k in j.built}
                for r, j in joined.items()}
        self.groups.enter(g, rank, record.world_size, *self._dims(), held, cfg.connect_timeout_s)
        self.comm.gen = g
        self._record = record
        check_group(self.comm, cfg.job_token, cfg.job_id, record, rank, group=self.groups.world)
        for group in list(self.groups.mesh.values()):
            if group.built == g and len(group.ranks) > 1:
                check_group(self.comm, cfg.job_token, cfg.job_id, record, rank, group=group.pg, ranks=group.ranks)
        return self.groups.last_build_s

    def _leave_groups(self) -> None:
        self.comm.gen = None
        self.groups.leave(abandoned=bool(self.comm.take_stuck()))

    def _close_groups(self) -> None:
        # A refresh started at the last step may still be sending: it ends (bounded) before its group is destroyed,
        # so no thread is left inside a Gloo transfer while the process exits.
        self._end_refresh("with the job")
        self._leave_groups()
        self.groups.close()

    def _end_refresh(self, when: str) -> None:
        """Wait (bounded) for a buddy refresh still running; say so if it outlives the wait."""
        if self.buddies is not None and not self.buddies.cancel():
            sys.stderr.write(f"[trainmover] a buddy-copy refresh did not end {when}; left behind\n")

    def _hot_capable(self) -> bool:
        """Hot standbys mirror a replica that holds the whole state: not a shard (docs/sharded.md)."""
        return False

    def _reconfigure_figures(self) -> tuple[float, int, int, int]:
        return self.groups.last_teardown_s, len(self.groups.rebuilt), self.groups.total, self.groups.for_new_members

    def _on_newer_generation(self, latest_gen: int, records: keys.Records) -> None:
        """Drain: fail the collectives that wait on a lost rank, keep the groups that no loss touched."""
        self.groups.abandon_older(latest_gen)
        current = self._record
        if current is None or current.gen >= latest_gen:
            return
        newer = records.get_record(keys.k_gen(latest_gen), Generation)
        if newer is None:
            lost = set(range(current.world_size))
        else:  # a rank whose process is gone from it, or holds another rank in it (a shrink renumbers)
            lost = {r for r, p in enumerate(current.members) if r >= newer.world_size or newer.members[r] != p}
        peers = sorted({r for group in self.groups.mesh.values() for r in group.ranks} - lost - {self.rank})

        def joined() -> dict[int, dict[str, Held]]:
            out = {}
            for r in peers:
                j = records.get_record(keys.k_joined(latest_gen, r), Joined)
                if j is not None:
                    out[r] = {k: Held(b, j.issued.get(k, -1), j.sizes.get(k, 0)) for k, b in j.built.items()}
            return out

        self.groups.drain(latest_gen, lost, joined)

    # -- membership ----------------------------------------------------------------------------------
    def _check_spec(self) -> None:
        if self.state is not None and not self._spec_checked:
            super()._check_spec()
            self._spec_checked = True

    def _warm_up(self) -> None:
        """A sharded standby cannot build its real model before it knows its rank (the mesh needs the
        generation's group). It warms what it can: one shadow build of the script's model on a private one-process
        mesh with the same dimension names, on the meta device (no memory, no kernel run), which pays the
        first-use costs of the mesh, FSDP and DTensor (about 0.5 s here) before a failure instead of after it."""
        t0 = time.perf_counter()
        self.job.faults.at("warmup")
        self._warming_up = True
        try:
            self._shadow_build()
        except Exception as exc:  # best effort: the real build at promotion is what counts
            log.warning("%s: the shadow build of the standby's warm-up failed (%s); it builds at promotion",
                        self.job.proc, error_text(exc))
        finally:
            self._warming_up = False
        self.job.records.put(keys.k_ready(self.job.proc), StandbyReady(time.perf_counter() - t0))

    def _shadow_build(self) -> None:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        try:
            names = self.mesh_spec.names
            mesh = init_device_mesh("cpu", (1,) * len(names), mesh_dim_names=names)
            with torch.device("meta"):
                built = self.build(mesh)
            del built, mesh
        finally:
            dist.destroy_process_group()

    def _enter(self, g: int, failure_seen: float | None) -> None:
        records, cfg = self.job.records, self.job.cfg
        buddies = self.buddies
        own, copies = buddies.steps() if buddies else ((), ())
        joining = self._join(g, pending=self._pending is not None and self._pending == self.committed + 1,
                             own=own, copies=copies)
        rank, statuses = joining.rank, joining.statuses
        try:
            target, plans = plan_sharded_handoff(self.mesh_spec, statuses)
        except StateLost:
            if g == 0:
                raise
            if buddies is not None:
                try:
                    self._enter_from_copies(g, joining, failure_seen)
                    return
                except StateLost:
                    if not self._has_backup():
                        raise
            elif not self._has_backup():
                raise
            self._enter_from_backup(g, joining, failure_seen)
            return
        mine = statuses[rank]
        old = self.state
        if old is not None and mine.has_state and mine.pending and mine.step + 1 == target:
            self._apply_step(self._pending_loss)  # every rank entered the commit barrier of this step: commit it too
            self.committed = target
        self._pending = None
        holds = old is not None and self.has_state and self.committed == target
        new = self._build()
        if holds:
            assert old is not None
            self._copy_state(old, new, target)
        old = None
        self._adopt(new)
        self._check_spec()
        if g == 0:
            self._enter_generation_0(rank)
            if rank == 0:
                records.put(keys.k_state_homes(), StateHomes(self._state_homes(), self._replica_size()))
            self._refresh_copies(self.committed)
            return
        plan = plans[self.mesh_spec.state_class(rank)]
        if rank in plan.receivers:
            self.has_state = False
        session = self._session(g, joining)
        if not plan.receivers:
            stats = HandoffStats("none")  # this shard's holders all survived: nothing moves in its class
        elif cfg.handoff_transport == "tls":
            stats = self._handoff_over_tls(plan, session, rank, g, joining.interrupt)
        else:
            assert self.state is not None
            stats, _ = run_handoff(plan, session, rank, self.state,
                                   links=GlooLinks(cfg.recovery_timeout_s, self.groups.world))
        self.committed = target
        self.has_state = True
        records.put(keys.k_holds(g, rank), HoldsState(self.committed))
        self._start_report(joining, stats, target, failure_seen)
        self._refresh_copies(self.committed)

    # -- persistent backups (runtime.training.backup) ------------------------------------------------------
    def _has_backup(self) -> bool:
        return bool(self.job.cfg.backup_dir) and has_backup(self.job.cfg.backup_dir)

    def _enter_from_backup(self, g: int, joining: Joining, failure_seen: float | None) -> None:
        """Some shard has no live copy left (no replica, no buddy copy): every rank goes back to the newest backup
        (the same one everywhere) and the steps since are trained again."""
        rank = joining.rank
        self._pending = None
        new = self._build()
        self._adopt(new)
        self._check_spec()
        self.has_state = False
        step, stats = self._restore_from_backup(self.job.cfg.backup_dir, rank)
        self.committed = step
        self.has_state = True
        self.job.records.put(keys.k_holds(g, rank), HoldsState(self.committed))
        if rank == 0:
            sys.stderr.write(f"[trainmover] a shard was lost with every copy of it: restored step {step} from the "
                             "newest backup\n")
        self._start_report(joining, stats, step, failure_seen)
        self._refresh_copies(self.committed)

    def _world(self) -> dist.ProcessGroup | None:
        return self.groups.world

    def _backup_shards(self) -> Shards:
        assert self.rank is not None and self.gen is not None and self._record is not None
        group = self.groups.backup
        assert group is not None
        if self._backup_proven != self.gen:  # the group is new: its peers prove they belong before any byte
            cfg = self.job.cfg
            check_group(self.comm, cfg.job_token, cfg.job_id, self._record, self.rank, group=group)
            self._backup_proven = self.gen
        shape, names = self._dims()
        return Shards(self.rank, group, f"g{self.gen}", {"shape": list(shape), "names": list(names)})

    def _backup(self, step: int) -> None:
        """Every rank, every `--backup-every` steps: its shards of step `step` to the backup, through torch's
        collective save (all ranks start it at the same step, so each first waits for its previous one)."""
        cfg = self.job.cfg
        if not cfg.backup_dir:
            return
        assert self.state is not None and self.gen is not None
        if self.backups is None:
            self.backups = BackupWriter(BackupSettings(cfg.backup_dir, cfg.backup_every, cfg.backup_keep),
                                        cfg.job_id, self.state.spec())
        self._report_backups()
        if not self.backups.due(step):
            return
        while self.backups.busy:
            if self.job.heartbeat.latest_gen > self.gen:
                raise GenerationChanged(f"generation {self.job.heartbeat.latest_gen} formed while a backup was "
                                        "still being written")
            self.backups.wait(0.25)
        self.backups.after_commit(step, self.state, self._backup_shards())

    def _finish_backups(self) -> None:
        """Every rank's part of the last backup completes (bounded); a sharded backup is never skipped."""
        if self.backups is not None:
            self.backups.wait(self.job.cfg.recovery_timeout_s)
            self._report_backups()

    def _state_homes(self) -> list[list[int]]:
        offset = None
        if self.buddies is not None:
            offset = self.buddies.offset or default_offset(self.mesh_spec.world_size)
        return state_homes(self.mesh_spec, offset)

    def _session(self, g: int, joining: Joining) -> HandoffSession:
        cfg, rank = self.job.cfg, joining.rank
        return HandoffSession(g, joining.record.members, cfg.job_id, cfg.job_token, cfg.chunk_bytes,
                              fault=lambda phase, **kw: self.job.faults.at(phase, rank=rank, gen=g, **kw))

    def _enter_from_copies(self, g: int, joining: Joining, failure_seen: float | None) -> None:
        """A shard with no live holder: every rank goes back to the newest step all buddy copies cover, a lost
        rank's state sent by its keeper, and the steps since are replayed."""
        assert self.buddies is not None
        records, cfg, rank = self.job.records, self.job.cfg, joining.rank
        target = max(s.step for s in joining.statuses if s.has_state)
        offset = self.buddies.offset or default_offset(joining.world_size)
        restore_step, plans = plan_restore(
            [BuddyStatus(s.rank, s.has_state, s.own, s.copies) for s in joining.statuses], offset, target,
            max_replay=2 * self.buddies.every, describe=self.mesh_spec.describe)
        self._pending = None
        new = self._build()
        own = self.buddies.own.get(restore_step)
        if rank not in plans and restore_step > 0:
            assert own is not None
            self._copy_state(own, new, restore_step)  # type: ignore[arg-type]
        self._adopt(new)
        self._check_spec()
        self.has_state = False
        session = self._session(g, joining)
        serving = [r for r, p in plans.items() if rank in p.sources]
        served: list[HandoffStats] = []
        stats = HandoffStats("none")
        if serving:
            copy = self.buddies.copies[restore_step]
            source_plan = plans[serving[0]]
            # A rank may serve its buddy and receive its own state at once: serve beside the receive.
            worker = threading.Thread(target=lambda: served.append(self._serve_copy(source_plan, session, copy)),
                                      name="tm-buddy-serve", daemon=True)
            worker.start()
        if rank in plans:
            assert self.state is not None
            stats, _ = run_handoff(plans[rank], session, rank, self.state,
                                   links=GlooLinks(cfg.recovery_timeout_s, self.groups.world))
        if serving:
            worker.join(cfg.recovery_timeout_s)
            if worker.is_alive() or not served:
                raise CommFailure(f"serving the buddy copy of rank {serving[0]} did not complete")
            stats = served[0] if rank not in plans else stats
        self.committed = restore_step
        self.has_state = True
        self.job.heartbeat.committed_step = restore_step
        records.put(keys.k_holds(g, rank), HoldsState(self.committed))
        if rank == 0:
            sys.stderr.write(f"[trainmover] restored step {restore_step} from buddy copies; replaying "
                             f"{target - restore_step} step(s)\n")
        self._start_report(joining, stats, target, failure_seen)  # its replay ends when step target + 1 commits
        self._refresh_copies(self.committed)

    def _serve_copy(self, plan: HandoffPlan, session: HandoffSession, copy: Snapshot) -> HandoffStats:
        assert self.rank is not None
        if self._device_type == "cuda":  # the handoff runs over the NCCL group: stage the copy on the GPU
            copy = Snapshot(copy.step, copy.meta(), [(k, t.to("cuda")) for k, t in copy.tensors()])
        stats, _ = run_handoff(plan, session, self.rank, copy,  # type: ignore[arg-type]
                               links=GlooLinks(self.job.cfg.recovery_timeout_s, self.groups.world))
        return stats

    def _refresh_copies(self, step: int) -> None:
        """Start a buddy refresh at `step` (every rank does at the same step), once the previous one has ended."""
        if self.buddies is None:
            return
        assert self.state is not None and self._buddy_group is not None and self.rank is not None
        assert self.gen is not None
        while not self.buddies.settle(0.25):
            if self.job.heartbeat.latest_gen > self.gen:
                raise GenerationChanged(f"generation {self.job.heartbeat.latest_gen} formed while a buddy copy "
                                        "was still being sent")
        if (failure := self.buddies.take_failure()) is not None:
            # The previous refresh did not complete: the copies kept are older than the schedule says.
            log.warning("%s: a buddy-copy refresh failed (%s); the previous copies stay the newest", self.job.proc,
                        failure)
        self.buddies.refresh(self.state, step, self.rank, self.world_size, self._buddy_group)

    def _broadcast_initial_model(self) -> None:
        """Generation 0: every replica group starts from replica 0's shards, as DDP starts from rank 0's."""
        if self.mesh_spec.replicate < 2:
            return
        assert self.state is not None and self.device_mesh is not None
        group = self.device_mesh.get_group("replicate")
        failure: str | None = None
        try:
            for _, t in self.state._model_tensors():
                dist.broadcast(t, group=group, group_src=0)
        except RuntimeError as exc:
            failure = error_text(exc)
        del group
        if failure is not None:
            raise CommFailure(f"initial broadcast failed: {failure}")

    def _recover(self, g: int, message: str, untrusted: int | None = None,
                 kind: Literal["comm", "state_lost"] = "comm") -> int:
        self._end_refresh("when its generation did")
        release_groups(self.model, self.device_mesh)
        self.device_mesh = None
        self._buddy_group = None
        gc.collect(0)
        return super()._recover(g, message, untrusted, kind)

    def _final_digest(self) -> str:
        """SHA-256 over the whole (gathered) state: the same value on every rank, equal to an uninterrupted
        run's on the same mesh exactly when every shard is."""
        assert self.state is not None
        h = hashlib.sha256()
        failure: str | None = None
        try:
            for key, t in self.state.tensors(local=False):
                whole = t.full_tensor() if isinstance(t, DTensor) else t
                h.update(key.encode())
                h.update(whole.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy().tobytes())
        except RuntimeError as exc:
            failure = error_text(exc)
        if failure is not None:
            raise CommFailure(f"gathering the final state failed: {failure}")
        meta = self.state.meta(0)
        h.update(json.dumps([meta.optim_values, meta.param_groups, meta.scheduler, meta.extras],
                            sort_keys=True).encode())
        return h.hexdigest()

    # -- one step ------------------------------------------------------------------------------------
    def _step(self, step: int) -> StepResult:
        assert self.gen is not None and self.rank is not None and self.optimizer is not None
        t0 = time.perf_counter()
        self._step_in_flight = step
        self._snapshot_buffers(step)
        self._pending = None
        faults = self.job.faults
        self.optimizer.zero_grad(set_to_none=True)
        # This member's units of data (runtime.training.elastic): one, its own data-parallel rank's batch, at full
        # width; several when the job runs with fewer replica groups and accumulates.
        width = self.full_mesh.dp_world
        layout = Layout(width, self.mesh_spec.dp_world, self.dp_rank, self.job.cfg.shrink)
        units = layout.units(step, self.cursor)
        unit_losses = []
        for i, (data_step, logical) in enumerate(units):
            losses = []
            for micro in range(self.accumulation_steps):
                last = i == len(units) - 1 and micro == self.accumulation_steps - 1
                for module in self._fsdp:  # the gradients are exchanged once, in the last backward
                    module.set_requires_gradient_sync(last, recurse=False)
                losses.append(self._collective(
                    lambda s=data_step, m=micro, r=logical: self._forward_backward(  # type: ignore[misc]
                        s, m, r, width, seed_rank=r),
                    "forward/backward"))
            unit_losses.append(torch.stack(losses).mean() if len(losses) > 1 else losses[0])
        loss = torch.stack(unit_losses).mean() if len(unit_losses) > 1 else unit_losses[0]
        faults.at("before_exchange", step=step, rank=self.rank, gen=self.gen)
        if self.job.heartbeat.latest_gen > self.gen:
            raise GenerationChanged(f"generation {self.job.heartbeat.latest_gen} formed during step {step}")
        if self._sync_replicas:
            self._all_reduce_replicas()
        n_units = layout.units_per_step()
        if n_units != layout.world_size:
            # The exchange averaged over the members: the gradient of the step is the sum over its units / W.
            with torch.no_grad():
                for g in self._grads():
                    local_shard(g).mul_(layout.world_size / n_units)
        faults.at("exchange", step=step, rank=self.rank, gen=self.gen)
        self._clip()
        world = self.groups.world
        # The mean over every unit of the step (each tensor-parallel rank of a unit holds its loss).
        units_loss = float(torch.stack(unit_losses).sum()) if len(unit_losses) > 1 else float(loss)
        n = n_units * (self.world_size // layout.world_size)
        global_loss = self.comm.mean_scalar(units_loss, n, world) if self._plateau else None
        self._pending, self._pending_loss = step, global_loss
        self._lr_factor, self._units_per_step = layout.lr_factor(), n_units
        barrier = self.comm.mean_scalar(units_loss, n, world)  # the commit barrier
        global_loss = barrier if global_loss is None else global_loss
        faults.at("after_exchange", step=step, rank=self.rank, gen=self.gen)
        if self.buddies is not None:
            self.buddies.before_update()
        self._apply_step(global_loss)
        self._pending = None
        self.committed = step
        self.job.heartbeat.committed_step = step
        if self.buddies is not None and self.buddies.due(step):
            self._refresh_copies(step)
        step_s = time.perf_counter() - t0
        self._after_commit(step_s)
        return StepResult(step, float(loss), self.rank, self.world_size, self.gen, step_s, global_loss)

    def _collective(self, fn: Callable[[], torch.Tensor], what: str) -> torch.Tensor:
        """Run `fn`, whose collectives belong to the generation's groups: a lost peer becomes a `CommFailure`."""
        failure: str | None = None
        try:
            return fn()
        except RuntimeError as exc:
            text = error_text(exc)
            if not _is_comm_error(text) and not self.job.heartbeat.latest_gen > (self.gen or 0):
                raise
            failure = text
        raise CommFailure(f"{what} failed: {failure}")

    def _grads(self) -> list[torch.Tensor]:
        assert self.model is not None
        return [p.grad for p in self.model.parameters() if p.grad is not None]

    def _all_reduce_replicas(self) -> None:
        """DP x TP without FSDP: average every gradient's local part over the replicate dimension."""
        assert self.device_mesh is not None
        group = self.device_mesh.get_group("replicate")
        failure = self.comm.flat_collective(
            [local_shard(g) for g in self._grads()],
            functools.partial(dist.all_reduce, group=group, async_op=True),
            lambda flat: flat.div_(self.mesh_spec.replicate),
        )
        del group
        if failure is not None:
            raise CommFailure(f"gradient exchange over the replicas failed: {failure}")

    def _clip(self) -> None:
        """Clip by the total norm over every shard (one small collective per sharded gradient), then by value."""
        grads = self._grads()
        if self.clip_grad_norm is not None and grads:
            def total_norm() -> torch.Tensor:
                norms = []
                for g in grads:
                    n = torch.linalg.vector_norm(g, 2, dtype=torch.float32)
                    norms.append(n.full_tensor() if isinstance(n, DTensor) else n)
                return torch.linalg.vector_norm(torch.stack(norms), 2)

            total = float(self._collective(total_norm, "gradient norm"))
            coef = min(1.0, self.clip_grad_norm / (total + 1e-6)) if math.isfinite(total) else 1.0
            if coef < 1.0:
                with torch.no_grad():
                    for g in grads:
                        local_shard(g).mul_(coef)
        if self.clip_grad_value is not None:
            with torch.no_grad():
                for g in grads:
                    local_shard(g).clamp_(-self.clip_grad_value, self.clip_grad_value)

    def _apply_step(self, global_loss: float | None) -> None:
        """The optimizer's and the scheduler's step (at the commit, or while the next generation forms for a
        pending step), the learning rate scaled for the step's width in an lr-* shrink mode."""
        assert self.optimizer is not None
        with scaled_lr(self.optimizer, self._lr_factor):
            self.optimizer.step()
        if self.cursor is not None:
            self.cursor.units += self._units_per_step
        if self.scheduler is not None:
            if self._plateau:
                self.scheduler.step(global_loss)
            else:
                self.scheduler.step()
