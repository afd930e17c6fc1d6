"""Generations: who holds which logical rank, as a frozen record the coordinator publishes.

Every membership change makes a new generation. Its process groups are built from a `PrefixStore` named
after it, so survivors build new groups in-process without clashing with the old ones.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class Generation:
    """One membership of the job."""

    gen: int
    """Generation number, 0 at start, +1 at every change."""
    members: tuple[str, ...]
    """Process name holding each logical rank (index = rank)."""
    reason: str = "start"
    """Why this generation exists, in words."""
    replaced: tuple[tuple[int, str, str], ...] = field(default_factory=tuple)
    """(rank, old process, new process) for every rank that changed hands."""

    @property
    def world_size(self) -> int:
        return len(self.members)

    def rank_of(self, proc: str) -> int | None:
        return self.members.index(proc) if proc in self.members else None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> Generation:
        return cls(
            gen=int(raw["gen"]),
            members=tuple(raw["members"]),
            reason=str(raw.get("reason", "")),
            replaced=tuple((int(r), str(a), str(b)) for r, a, b in raw.get("replaced", [])),
        )

    def replace(self, rank_to_proc: dict[int, str], reason: str) -> Generation:
        members = list(self.members)
        replaced = []
        for rank, proc in sorted(rank_to_proc.items()):
            replaced.append((rank, members[rank], proc))
            members[rank] = proc
        return Generation(self.gen + 1, tuple(members), reason, tuple(replaced))
