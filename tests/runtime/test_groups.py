"""Delta reconfiguration's decisions (runtime.training.groups), table-tested without processes: which mesh groups
exist, and which of them the next generation rebuilds from what every member says it holds."""

from __future__ import annotations

import pytest

from runtime.training.groups import Held, mesh_groups, plan_rebuild
from runtime.training.sharded import MeshSpec

HSDP = MeshSpec(replicate=2, shard=2)
HSDP_16 = MeshSpec(replicate=2, shard=8)


def _groups(mesh: MeshSpec) -> dict[str, tuple[int, ...]]:
    return mesh_groups(mesh.shape, mesh.names)


@pytest.mark.parametrize("mesh", [HSDP, HSDP_16, MeshSpec(replicate=2, tp=2), MeshSpec(shard=4),
                                  MeshSpec(replicate=2, shard=2, tp=2)])
def test_every_rank_is_in_one_group_per_dimension_laid_out_as_the_mesh_coordinates(mesh: MeshSpec) -> None:
    groups = _groups(mesh)
    for rank in range(mesh.world_size):
        mine = [k for k, ranks in groups.items() if rank in ranks]
        assert sorted(k.rstrip("0123456789") for k in mine) == sorted(mesh.names)
        for key in mine:
            dim = key.rstrip("0123456789")
            # The members of a rank's group along `dim` differ from it along `dim` only.
            for peer in groups[key]:
                a, b = mesh.coords(rank), mesh.coords(peer)
                assert all(a[d] == b[d] for d in a if d != dim)
            assert len(groups[key]) == getattr(mesh, dim)


def test_the_hsdp_groups_are_the_replica_pairs_and_the_shard_rows() -> None:
    assert _groups(HSDP) == {"replicate0": (0, 2), "replicate1": (1, 3), "shard0": (0, 1), "shard1": (2, 3)}


def _held(groups: dict[str, tuple[int, ...]], built: int = 0, issued: int = 5) -> dict[int, dict[str, Held]]:
    out: dict[int, dict[str, Held]] = {}
    for key, ranks in groups.items():
        for r in ranks:
            out.setdefault(r, {})[key] = Held(built, issued)
    return out


def test_a_replaced_rank_holds_nothing_so_only_its_two_groups_are_rebuilt() -> None:
    groups = _groups(HSDP_16)
    held = _held(groups)
    held[5] = {}  # the standby that took rank 5
    assert plan_rebuild(groups, held) == {"replicate5", "shard0"}
    assert len(plan_rebuild(groups, held, full=True)) == len(groups) == 10


def test_a_group_left_half_entered_or_cut_is_rebuilt_even_without_a_lost_member() -> None:
    groups = _groups(HSDP)
    held = _held(groups)
    held[1] = {}  # rank 1 replaced: replicate1 and shard0 go
    held[2]["shard1"] = Held(0, 6)  # rank 2 entered one more collective on shard1 than rank 3
    held[0]["replicate0"] = Held(0, -1)  # rank 0 cut replicate0 while draining
    assert plan_rebuild(groups, held) == {"replicate1", "shard0", "shard1", "replicate0"}


def test_members_holding_different_incarnations_of_a_group_rebuild_it() -> None:
    groups = _groups(HSDP)
    held = _held(groups)
    held[3]["replicate1"] = Held(2, 5)
    assert plan_rebuild(groups, held) == {"replicate1"}


def test_nothing_held_anywhere_rebuilds_everything() -> None:
    groups = _groups(HSDP)
    assert plan_rebuild(groups, {}) == set(groups)
