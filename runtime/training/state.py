"""The training state a handoff moves, and nothing else.

`TrainingState` owns the canonical, ordered view of one replica's state: the tensors (parameters, buffers,
optimizer state, and the tensors of registered extra state such as EMA weights or a GradScaler) that are
streamed in place, and the JSON-able rest (step, optimizer hyper-parameters, LR scheduler, RNG states of torch,
Python and NumPy, the non-tensor values of extra state) that travels as one small metadata record. JSON, never
pickle: a receiver never executes what a peer sent.

It also owns the model's *spec* (every model tensor's name, shape and dtype, and the optimizer's parameter
groups): processes whose specs differ run different scripts or arguments, which no recovery can fix.

Sharded models (FSDP2, DTensor tensor parallelism) are seen through their local shards: what a rank streams is
the shard it holds (`DTensor.to_local()`, written in place), while the spec names the global shapes, equal in
every process of the job.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch
from torch import nn
from torch.distributed.tensor import DTensor

META_VERSION = 2


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """The part of `t` this process holds: a DTensor's local shard (a view: writes reach the DTensor), else `t`."""
    return t.to_local() if isinstance(t, DTensor) else t


class Stateful(Protocol):
    """Anything with `state_dict()`/`load_state_dict()`: an EMA model, a GradScaler, a counter object."""

    def state_dict(self) -> Any: ...

    def load_state_dict(self, state_dict: Any, /) -> Any: ...


class StateMismatchError(RuntimeError):
    """The receiver's model or optimizer does not have the shape of the sender's."""


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """One tensor of the state, as both sides name it."""

    key: str
    shape: tuple[int, ...]
    dtype: str


@dataclass(frozen=True, slots=True)
class RngStates:
    """The random generators' states a replay needs: torch's CPU generator (hex bytes), Python's and NumPy's (their
    `getstate()` forms as JSON lists) and, once CUDA is initialised, every GPU's (hex bytes)."""

    cpu: str
    python: list[Any]
    numpy: list[Any]
    cuda: tuple[str, ...] | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"cpu": self.cpu, "python": self.python, "numpy": self.numpy}
        if self.cuda is not None:
            out["cuda"] = list(self.cuda)
        return out


@dataclass(frozen=True, slots=True)
class StateMeta:
    """Everything of a replica's state that is not a streamed tensor, as the handoff and buddy copies carry it: one
    JSON object on the wire (version `META_VERSION`), read back only through `from_json`.

    The optimizer's non-tensor values, its parameter groups' hyper-parameters, the scheduler's state and the
    registered state's skeletons are the user's objects in `encode_json`'s form: JSON values, typed by their owner."""

    step: int
    tensors: tuple[TensorEntry, ...]
    """Every streamed tensor, in the order the chunks follow."""
    optim_values: dict[str, Any]
    """Per "group.param.key", a non-tensor optimizer value (encode_json)."""
    param_groups: tuple[dict[str, Any], ...]
    """Per parameter group, its hyper-parameters (encode_json), `params` left out."""
    scheduler: Any
    """The LR scheduler's state_dict (encode_json); None without a scheduler."""
    rng: RngStates
    extras: dict[str, Any]
    """Per registered extra state, its state_dict with the tensors left out (their slots are streamed)."""
    extra: Any = None
    """What the caller sends along (JSON)."""

    def to_json(self) -> dict[str, Any]:
        return {"version": META_VERSION, "step": self.step,
                "tensors": [[e.key, list(e.shape), e.dtype] for e in self.tensors],
                "optim_values": self.optim_values, "param_groups": list(self.param_groups),
                "scheduler": self.scheduler, "rng": self.rng.to_json(), "extras": self.extras, "extra": self.extra}

    def to_bytes(self) -> bytes:
        return json.dumps(self.to_json()).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> StateMeta:
        try:
            raw = json.loads(data)
        except ValueError:
            raise StateMismatchError("the handoff metadata is not JSON") from None
        return cls.from_json(raw)

    @classmethod
    def from_json(cls, raw: Any) -> StateMeta:
        """The record of a peer's JSON object; StateMismatchError, naming what is wrong, for anything else."""
        if not isinstance(raw, dict):
            raise StateMismatchError("the handoff metadata is not a JSON object")
        if raw.get("version") != META_VERSION:
            raise StateMismatchError(f"handoff metadata version {raw.get('version')!r}, expected {META_VERSION}")
        try:
            rng = raw["rng"]
            cuda = rng.get("cuda")
            return cls(
                step=int(raw["step"]),
                tensors=tuple(TensorEntry(str(k), tuple(int(n) for n in shape), str(d))
                              for k, shape, d in raw["tensors"]),
                optim_values=dict(raw["optim_values"]),
                param_groups=tuple(dict(g) for g in raw["param_groups"]),
                scheduler=raw["scheduler"],
                rng=RngStates(str(rng["cpu"]), list(rng["python"]), list(rng["numpy"]),
                              None if cuda is None else tuple(str(c) for c in cuda)),
                extras=dict(raw.get("extras", {})),
                extra=raw.get("extra"),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise StateMismatchError(f"the handoff metadata is malformed ({type(exc).__name__}: {exc})") from None

    def copy(self) -> StateMeta:
        """A deep copy, exactly as a peer would receive it (nothing shared with the live optimizer's values)."""
        return StateMeta.from_bytes(self.to_bytes())


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise StateMismatchError(f"unknown tensor dtype {name!r} in handoff metadata")
    return dtype


def encode_json(value: Any) -> Any:
    """Turn optimizer/scheduler values into JSON, keeping tuples and small tensors recognisable."""
    if isinstance(value, bool | int | float | str) or value is None:
        return value
    if isinstance(value, tuple):
        return {"__tuple__": [encode_json(v) for v in value]}
    if isinstance(value, list):
        return [encode_json(v) for v in value]
    if isinstance(value, dict):
        if not all(isinstance(k, str | int) for k in value):
            raise TypeError(f"cannot hand off a dict with keys {list(value)[:3]!r}")
        return {"__dict__": [[k, encode_json(v)] for k, v in value.items()]}
    if isinstance(value, torch.Tensor) and value.numel() <= 16:
        return {"__tensor__": value.detach().cpu().tolist(), "dtype": _dtype_name(value.dtype)}
    raise TypeError(
        f"cannot hand off a value of type {type(value).__name__}; optimizer hyper-parameters and "
        "LR-scheduler state must be numbers, strings, lists, tuples or dicts"
    )


def decode_json(value: Any, device: torch.device | None = None) -> Any:
    if isinstance(value, list):
        return [decode_json(v, device) for v in value]
    if isinstance(value, dict):
        if "__tuple__" in value:
            return tuple(decode_json(v, device) for v in value["__tuple__"])
        if "__dict__" in value:
            return {k: decode_json(v, device) for k, v in value["__dict__"]}
        if "__tensor__" in value:
            return torch.tensor(value["__tensor__"], dtype=_dtype_from_name(value["dtype"]), device=device)
    return value


def split_tensors(value: Any, out: list[torch.Tensor]) -> Any:
    """A JSON skeleton of `value` where every tensor is replaced by a slot in `out` (streamed, not inlined)."""
    if isinstance(value, torch.Tensor):
        out.append(value.detach())
        return {"__slot__": len(out) - 1}
    if isinstance(value, tuple):
        return {"__tuple__": [split_tensors(v, out) for v in value]}
    if isinstance(value, list):
        return [split_tensors(v, out) for v in value]
    if isinstance(value, dict):
        if not all(isinstance(k, str | int) for k in value):
            raise TypeError(f"cannot hand off a dict with keys {list(value)[:3]!r}")
        return {"__dict__": [[k, split_tensors(v, out)] for k, v in value.items()]}
    return encode_json(value)


def join_tensors(skeleton: Any, slots: list[torch.Tensor]) -> Any:
    """The inverse of `split_tensors`."""
    if isinstance(skeleton, list):
        return [join_tensors(v, slots) for v in skeleton]
    if isinstance(skeleton, dict):
        if "__slot__" in skeleton:
            return slots[int(skeleton["__slot__"])]
        if "__tuple__" in skeleton:
            return tuple(join_tensors(v, slots) for v in skeleton["__tuple__"])
        if "__dict__" in skeleton:
            return {k: join_tensors(v, slots) for k, v in skeleton["__dict__"]}
        if "__tensor__" in skeleton:
            return decode_json(skeleton)
    return skeleton


def _python_rng_state() -> Any:
    version, internal, gauss = random.getstate()
    return [version, list(internal), gauss]


def _numpy_rng_state() -> Any:
    state: Any = np.random.get_state(legacy=True)
    name, keys, pos, has_gauss, cached = state
    return [name, keys.tolist(), int(pos), int(has_gauss), float(cached)]


def _empty_like_param(p: torch.Tensor, local_shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A new optimizer-state tensor for `p`: sharded like `p` where it has `p`'s local shape (Adam's moments of a
    DTensor parameter are DTensors with its placements), else a plain tensor (a scalar step count)."""
    if isinstance(p, DTensor) and tuple(p.to_local().shape) == local_shape:
        local = torch.empty(local_shape, dtype=dtype, device=p.to_local().device)
        return DTensor.from_local(local, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                  stride=p.stride())
    return torch.empty(local_shape, dtype=dtype, device=p.device)


def spec_difference(mine: list[Any], theirs: list[Any], me: str, them: str) -> str | None:
    """The first difference between two specs, as a sentence that names the tensor; None if they are equal."""
    for a, b in zip(mine, theirs, strict=False):
        if a != b:
            return f"{a[0]!r} is {tuple(a[1])} {a[2]} in {me}, but {them} has {b[0]!r} {tuple(b[1])} {b[2]}"
    if len(mine) != len(theirs):
        longer, extra = (me, mine[len(theirs)]) if len(mine) > len(theirs) else (them, theirs[len(mine)])
        return f"only {longer} has {extra[0]!r}"
    return None


class TrainingState:
    """A replica's model, optimizer, scheduler and registered extra state, seen as ordered tensors plus metadata."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.extras: dict[str, Stateful] = {}
        self._extra_in: dict[str, list[torch.Tensor]] = {}

    def register(self, name: str, obj: Stateful) -> None:
        """Hand `obj` over with the state. Its tensors are streamed, the rest travels as JSON."""
        if not name or "." in name:
            raise ValueError(f"a registered state's name must be non-empty and without dots, got {name!r}")
        if name in self.extras:
            raise ValueError(f"a state named {name!r} is registered already")
        if not callable(getattr(obj, "state_dict", None)) or not callable(getattr(obj, "load_state_dict", None)):
            raise TypeError(f"register_state({name!r}, ...) needs an object with state_dict() and load_state_dict(); "
                            f"got {type(obj).__name__}")
        self.extras[name] = obj

    def _extra_split(self) -> dict[str, tuple[Any, list[torch.Tensor]]]:
        out: dict[str, tuple[Any, list[torch.Tensor]]] = {}
        for name, obj in self.extras.items():
            slots: list[torch.Tensor] = []
            out[name] = (split_tensors(obj.state_dict(), slots), slots)
        return out

    # -- the spec ------------------------------------------------------------------------------------
    def spec(self) -> list[Any]:
        """Model tensors (name, shape, dtype), parameter groups and registered names: equal in every process."""
        out: list[Any] = [[k, list(t.shape), _dtype_name(t.dtype)] for k, t in self._model_tensors(local=False)]
        for gi, group in enumerate(self.optimizer.param_groups):
            out.append([f"optimizer.param_groups.{gi}", [len(group["params"])], "params"])
        out.extend([f"registered.{name}", [], type(obj).__name__] for name, obj in self.extras.items())
        return out

    @staticmethod
    def spec_hash(spec: list[Any]) -> str:
        return hashlib.sha256(json.dumps(spec).encode()).hexdigest()[:32]

    # -- the tensors ---------------------------------------------------------------------------------
    def _model_tensors(self, local: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
        """The model's tensors by state-dict name: their local shards, or (`local=False`) as the model holds them."""
        seen: set[tuple[int, tuple[int, ...], torch.dtype]] = set()
        for name, t in self.model.state_dict(keep_vars=True).items():
            data = t.data if isinstance(t, nn.Parameter) else t
            shard = local_shard(data)
            ident = (shard.data_ptr(), tuple(data.shape), data.dtype)
            if ident in seen:  # tied weights appear under two names but are one tensor
                continue
            seen.add(ident)
            yield f"model.{name}", shard if local else data

    def _params(self) -> Iterator[tuple[str, torch.Tensor]]:
        for gi, group in enumerate(self.optimizer.param_groups):
            for pi, p in enumerate(group["params"]):
                yield f"{gi}.{pi}", p

    def tensors(self, local: bool = True) -> list[tuple[str, torch.Tensor]]:
        """The live tensors, in the order both sides stream them: local shards, or (`local=False`) whole DTensors."""
        out = list(self._model_tensors(local))
        for prefix, p in self._params():
            state = self.optimizer.state.get(p, {})
            for key in sorted(state):
                value = state[key]
                if isinstance(value, torch.Tensor):
                    out.append((f"optim.{prefix}.{key}", local_shard(value.data) if local else value.data))
        for name, (_, slots) in self._extra_split().items():
            out.extend((f"extra.{name}.{i}", t) for i, t in enumerate(slots))
        return out

    def state_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for _, t in self.tensors())

    # -- the metadata --------------------------------------------------------------------------------
    def meta(self, step: int, extra: Any = None) -> StateMeta:
        optim_values: dict[str, Any] = {}
        for prefix, p in self._params():
            for key, value in self.optimizer.state.get(p, {}).items():
                if not isinstance(value, torch.Tensor):
                    optim_values[f"{prefix}.{key}"] = encode_json(value)
        cuda = None
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            cuda = tuple(s.numpy().tobytes().hex() for s in torch.cuda.get_rng_state_all())
        return StateMeta(
            step=step,
            tensors=tuple(TensorEntry(k, tuple(t.shape), _dtype_name(t.dtype)) for k, t in self.tensors()),
            optim_values=optim_values,
            param_groups=tuple(
                {k: encode_json(v) for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups
            ),
            scheduler=None if self.scheduler is None else encode_json(self.scheduler.state_dict()),
            rng=RngStates(torch.get_rng_state().numpy().tobytes().hex(), _python_rng_state(), _numpy_rng_state(),
                          cuda),
            extras={name: skeleton for name, (skeleton, _) in self._extra_split().items()},
            extra=extra,
        )

    def prepare_receive(self, meta: StateMeta) -> list[tuple[str, torch.Tensor]]:
        """Shape this replica's optimizer state like the sender's and return the tensors to write into.

        Model tensors must already match (same script, same arguments). Optimizer state may differ, e.g. a
        standby that ran a shadow step holds Adam moments while the sender has taken no step yet: entries are
        created or dropped to match, reusing the buffers the standby allocated where shapes agree.
        """
        wanted = list(meta.tensors)
        own_model = dict(self._model_tensors())
        params = dict(self._params())
        wanted_optim: dict[str, set[str]] = {prefix: set() for prefix in params}
        self._extra_in = {name: [] for name in self.extras}
        if sorted(meta.extras) != sorted(self.extras):
            raise StateMismatchError(
                f"the sender registered state {sorted(meta.extras)} and this replica "
                f"{sorted(self.extras)}; start standbys with the same script and arguments as the workers"
            )
        own_extra = {name: slots for name, (_, slots) in self._extra_split().items()}
        for entry in wanted:
            if entry.key.startswith("extra."):
                _, name, index = entry.key.split(".")
                mine = own_extra[name]
                near = mine[int(index)] if int(index) < len(mine) else None
                device = near.device if near is not None else torch.device("cpu")
                self._extra_in[name].append(torch.empty(entry.shape, dtype=_dtype_from_name(entry.dtype),
                                                        device=device))
            elif entry.key.startswith("model."):
                own = own_model.get(entry.key)
                if own is None:
                    raise StateMismatchError(
                        f"the sender has {entry.key[6:]!r} but this replica's model does not; start standbys "
                        "with the same script and arguments as the workers"
                    )
                if tuple(own.shape) != entry.shape or _dtype_name(own.dtype) != entry.dtype:
                    raise StateMismatchError(
                        f"{entry.key[6:]!r} is {tuple(own.shape)} {_dtype_name(own.dtype)} here but "
                        f"{entry.shape} {entry.dtype} on the sender; start standbys with the same script and arguments"
                    )
            else:
                _, gi, pi, key = entry.key.split(".", 3)
                prefix = f"{gi}.{pi}"
                if prefix not in params:
                    raise StateMismatchError(f"the sender's optimizer has parameter {prefix} and this one does not")
                wanted_optim[prefix].add(key)
                p = params[prefix]
                state = self.optimizer.state[p]
                current = state.get(key)
                dtype = _dtype_from_name(entry.dtype)
                if (
                    not isinstance(current, torch.Tensor)
                    or tuple(local_shard(current).shape) != entry.shape
                    or current.dtype != dtype
                ):
                    state[key] = _empty_like_param(p, entry.shape, dtype)
        missing = set(own_model) - {e.key for e in wanted}
        if missing:
            raise StateMismatchError(
                f"this replica's model has {sorted(missing)[:3]} that the sender lacks; start standbys with the "
                "same script and arguments as the workers"
            )
        for prefix, p in params.items():
            state = self.optimizer.state.get(p)
            if state is None:
                continue
            for key in [k for k, v in state.items() if isinstance(v, torch.Tensor) and k not in wanted_optim[prefix]]:
                del state[key]
            if not state:
                del self.optimizer.state[p]
        receiving = [(k, t) for k, t in self.tensors() if not k.startswith("extra.")]
        receiving += [(f"extra.{name}.{i}", t) for name, ts in self._extra_in.items() for i, t in enumerate(ts)]
        if [k for k, _ in receiving] != [e.key for e in wanted]:
            raise StateMismatchError("handoff tensor order differs between sender and receiver")
        return receiving

    def apply_meta(self, meta: StateMeta) -> None:
        """Set everything that is not a streamed tensor: optimizer values, hyper-parameters, scheduler, RNG."""
        params = dict(self._params())
        for full_key, value in meta.optim_values.items():
            gi, pi, key = full_key.split(".", 2)
            p = params[f"{gi}.{pi}"]
            self.optimizer.state[p][key] = decode_json(value, p.device)
        groups = meta.param_groups
        if len(groups) != len(self.optimizer.param_groups):
            raise StateMismatchError("the sender's optimizer has a different number of parameter groups")
        for group, values in zip(self.optimizer.param_groups, groups, strict=True):
            for k, v in values.items():
                group[k] = decode_json(v)
        if self.scheduler is not None and meta.scheduler is not None:
            self.scheduler.load_state_dict(decode_json(meta.scheduler))
        for name, skeleton in meta.extras.items():
            self.extras[name].load_state_dict(join_tensors(skeleton, self._extra_in.get(name, [])))
        self._extra_in = {}
        rng = meta.rng
        version, internal, gauss = rng.python
        random.setstate((version, tuple(internal), gauss))
        name, keys, pos, has_gauss, cached = rng.numpy
        np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
        torch.set_rng_state(torch.frombuffer(bytearray(bytes.fromhex(rng.cpu)), dtype=torch.uint8))
        if rng.cuda is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(
                [torch.frombuffer(bytearray(bytes.fromhex(s)), dtype=torch.uint8) for s in rng.cuda]
            )

    def digest(self) -> str:
        """SHA-256 over every state tensor and optimizer value: equal digests mean bit-identical replicas."""
        h = hashlib.sha256()
        for key, t in self.tensors():
            h.update(key.encode())
            h.update(t.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy().tobytes())
        meta = self.meta(0)
        h.update(json.dumps([meta.optim_values, meta.param_groups, meta.scheduler, meta.extras],
                            sort_keys=True).encode())
        return h.hexdigest()
