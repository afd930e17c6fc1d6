"""The process group of the current generation, and the gradient exchange over it.

One `Communicator` per process. It builds the group of a generation from a `PrefixStore` named after it,
tears it down without leaving the process when a peer is lost, and all-reduces gradients held in flat
buckets (the parameters' `.grad` are views into them, so backward writes where the exchange reads).
Gloo on CPU; NCCL on GPU with non-blocking communicators that can be aborted.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import logging
import time
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist

log = logging.getLogger("trainmover.runtime")


class CommFailure(RuntimeError):
    """A collective or point-to-point operation failed: a peer is gone or the group was broken."""


def error_text(exc: BaseException) -> str:
    """The first line of a backend error, which is all a survivor keeps: holding the exception itself would
    keep its traceback, and through it the broken group's `Work` objects and sockets, alive."""
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]


class Communicator:
    """Owns this process's membership in one generation's process group."""

    def __init__(self, backend: str, store: dist.Store, timeout_s: float, device: torch.device) -> None:
        self.backend = backend
        self.store = store
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.device = device
        self.gen: int | None = None
        self.last_teardown_s = 0.0

    def build(self, gen: int, rank: int, world_size: int, connect_timeout_s: float = 30.0) -> None:
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
        try:
            dist.init_process_group(
                self.backend,
                store=dist.PrefixStore(f"g{gen}", self.store),
                rank=rank,
                world_size=world_size,
                timeout=datetime.timedelta(seconds=connect_timeout_s),
                **kwargs,  # type: ignore[arg-type]
            )
        except RuntimeError as exc:  # a peer died while connecting (DistError/DistStoreError are RuntimeErrors)
            failure = error_text(exc)
        if failure is not None:
            if dist.is_initialized():
                dist.destroy_process_group()
            raise CommFailure(f"could not build the group of generation {gen}: {failure}")
        self.gen = gen
        dist.distributed_c10d._set_pg_timeout(self.timeout)

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


    def broadcast_from_rank0(self, tensors: list[torch.Tensor]) -> None:
        """Make `tensors` equal to rank 0's on every rank (one broadcast per dtype and device)."""
        groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for t in tensors:
            groups.setdefault((t.device, t.dtype), []).append(t)
        failure: str | None = None
        try:
            for members in groups.values():
                flat = torch.cat([t.detach().reshape(-1) for t in members])
                dist.broadcast(flat, src=0)
                offset = 0
                for t in members:
                    t.detach().copy_(flat[offset : offset + t.numel()].view_as(t))
                    offset += t.numel()
        except RuntimeError as exc:
            failure = error_text(exc)
        if failure is not None:  # raised outside the except block: no traceback may pin the broken group
            raise CommFailure(f"buffer broadcast failed: {failure}")

    def all_gather_bytes(self, data: bytes, world_size: int) -> list[bytes]:
        """Every rank's `data` (all the same length), in rank order."""
        mine = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self.device)
        out = [torch.zeros_like(mine) for _ in range(world_size)]
        failure: str | None = None
        try:
            dist.all_gather(out, mine)
        except RuntimeError as exc:
            failure = error_text(exc)
        if failure is not None:
            raise CommFailure(f"all-gather failed: {failure}")
        return [t.cpu().numpy().tobytes() for t in out]

    def mean_scalar(self, value: float, world_size: int) -> float:
        """The mean of one float over the group, computed in float64: the same value on every rank."""
        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        failure: str | None = None
        try:
            dist.all_reduce(t)
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

    def all_reduce_mean(self, world_size: int, on_issued: Callable[[], object] | None = None) -> None:
        """Sum every bucket over the group, then divide: the same bits on every rank, every time."""
        self.attach()  # backward may have produced a fresh tensor if user code dropped our view
        failure: str | None = None
        try:
            works = [dist.all_reduce(flat, async_op=True) for flat in self.flats]
            if on_issued is not None:
                on_issued()
            for work in works:
                work.wait()
            del works
        except RuntimeError as exc:  # Gloo/NCCL report a lost peer as a plain RuntimeError/DistBackendError
            failure = error_text(exc)
        if failure is not None:
            # Raised outside the except block so that no traceback keeps the broken group's Work alive.
            raise CommFailure(failure)
        for flat in self.flats:
            flat.div_(world_size)

