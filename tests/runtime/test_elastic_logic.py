"""Elastic width in-process: which units of data a member trains on at any width, the generations a shrink and a
grow make, the coordinator's plans and its figures; and the coordinator's loop on a fake clock (a shrink after the
standby wait, a planned grow and a planned shrink, what a resize request may ask). The multi-process scenarios are
tests/runtime/test_elastic.py."""

from __future__ import annotations

import itertools

import pytest

from runtime.control.elastic import change_figures, cover_plan, resize_plan
from runtime.training.elastic import DataCursor, Layout
from runtime.wire import store as keys
from runtime.wire.control import ControlValueError, parse_resize
from runtime.wire.event_records import (
    GenerationStarted,
    Grew,
    JobFinished,
    MemberFailed,
    Moved,
    Recovered,
    Shrunk,
    WidthTargetChanged,
)
from runtime.wire.protocol import (
    Assignment,
    ControlCommand,
    CurrentGeneration,
    FailureReport,
    Generation,
    Joined,
    MoveRequest,
    MoveResult,
    Progress,
    RecoveryReport,
    ResizeRequest,
    StateHomes,
)
from tests.runtime.test_coordinator_fake_clock import TICK, Scene, Script


# -- which data a member trains on -------------------------------------------------------------------------------
def _consumed(widths: list[int], logical: int, mode: str) -> list[tuple[int, int]]:
    """Every unit the steps consume when step i runs at widths[i], over all members, in step order."""
    cursor = DataCursor() if mode.startswith("lr") else None
    out: list[tuple[int, int]] = []
    for step, w in enumerate(widths, start=1):
        layouts = [Layout(logical, w, r, mode) for r in range(w)]  # type: ignore[arg-type]
        units = [u for lay in layouts for u in lay.units(step, cursor)]
        out += sorted(units)
        if cursor is not None:
            cursor.units += layouts[0].units_per_step()
    return out


@pytest.mark.parametrize("mode", ["accumulate", "lr-linear", "lr-sqrt"])
def test_no_unit_of_data_is_skipped_or_seen_twice_whatever_the_widths(mode: str) -> None:
    widths = [4, 4, 3, 3, 3, 1, 2, 4, 4, 3, 4]
    seen = _consumed(widths, 4, mode)
    assert len(seen) == len(set(seen)), "a unit seen twice"
    index = [(s - 1) * 4 + r for s, r in seen]
    assert index == list(range(len(index))), "units consumed in order, none skipped"
    if mode == "accumulate":  # every step consumes a whole global batch: the same units as at full width
        assert seen == _consumed([4] * len(widths), 4, mode)


def test_at_full_width_each_rank_reads_what_it_always_did() -> None:
    for step, rank in itertools.product(range(1, 6), range(4)):
        assert Layout(4, 4, rank, "accumulate").units(step, None) == [(step, rank)]
        assert Layout(4, 4, rank, "lr-sqrt").units(step, DataCursor()) in ([(1, rank)],)  # the cursor, not the step


def test_a_shrunk_member_takes_every_w_th_unit_and_member_0_starts_with_logical_rank_0() -> None:
    assert Layout(4, 3, 0, "accumulate").units(2, None) == [(2, 0), (2, 3)]
    assert Layout(4, 3, 1, "accumulate").units(2, None) == [(2, 1)]
    assert Layout(4, 1, 0, "accumulate").units(1, None) == [(1, 0), (1, 1), (1, 2), (1, 3)]


def test_the_learning_rate_scale_of_each_mode() -> None:
    assert Layout(4, 2, 0, "accumulate").lr_factor() == 1.0
    assert Layout(4, 2, 0, "lr-linear").lr_factor() == 0.5
    assert Layout(4, 1, 0, "lr-sqrt").lr_factor() == 0.5
    assert Layout(4, 4, 0, "lr-sqrt").lr_factor() == 1.0


# -- generations --------------------------------------------------------------------------------------------------
def test_a_generation_leaves_ranks_out_and_adds_members_keeping_the_survivors_order() -> None:
    g0 = Generation(0, ("w0", "w1", "w2", "w3"))
    g1 = g0.change("lost", assign={1: "s0"}, drop=[2, 3])
    assert g1 == Generation(1, ("w0", "s0"), "lost", ((1, "w1", "s0"),), logical=4)
    assert g1.world_size == 2 and g1.logical_width == 4 and not g1.planned
    g2 = g1.change("grow", add=["s1", "s2"], planned=True)
    assert g2.members == ("w0", "s0", "s1", "s2") and g2.logical == 0 and g2.logical_width == 4 and g2.planned
    assert Generation.from_json(g1.to_json()) == g1 and Generation.from_json(g2.to_json()) == g2
    assert g2.change("again").planned is False, "a generation the coordinator forms after a failure is never planned"
    with pytest.raises(ValueError, match="5 members for a job of 4 logical ranks"):
        g2.change("too many", add=["s3"])
    with pytest.raises(ValueError, match="0 members"):
        g1.change("none", drop=[0, 1])


def test_plans_cover_what_the_width_target_needs() -> None:
    assert cover_plan([1, 3], world=4, width_target=4) == ([1, 3], [])
    assert cover_plan([3, 1], world=4, width_target=3) == ([1], [3]), "the lowest lost rank keeps its number"
    assert cover_plan([2], world=4, width_target=2) == ([], [2])
    assert cover_plan([0, 2, 3], world=4, width_target=4, ready=1) == ([0], [2, 3])
    assert resize_plan(4, 2, ["s0"]) == ([2, 3], [])
    assert resize_plan(2, 4, ["s0", "s1", "s2"]) == ([], ["s0", "s1"])
    assert resize_plan(2, 4, []) == ([], [])


def test_a_sharded_job_keeps_or_leaves_out_whole_replica_groups() -> None:
    """HSDP 3 x 2 (replica groups {0, 1}, {2, 3}, {4, 5}): a group whose lost ranks all get standbys is kept, the
    lowest first; any other group that lost a rank is left out whole (its live member with it)."""
    assert cover_plan([3], world=6, width_target=6, unit=2) == ([3], [])
    assert cover_plan([3], world=6, width_target=6, ready=0, unit=2) == ([], [2, 3])
    # One standby: group 1 lost two ranks and cannot be filled, group 2 lost one and is.
    assert cover_plan([2, 3, 5], world=6, width_target=6, ready=1, unit=2) == ([5], [2, 3])
    assert cover_plan([0, 5], world=6, width_target=6, ready=2, unit=2) == ([0, 5], [])
    # A width target of two groups: the loss of a rank of group 0 leaves it out, since two groups are intact.
    assert cover_plan([1], world=6, width_target=4, unit=2) == ([], [0, 1])
    assert resize_plan(2, 6, ["s0", "s1", "s2"], unit=2) == ([], ["s0", "s1"]), "one whole group of two"
    assert resize_plan(2, 6, ["s0"], unit=2) == ([], []), "half a group is no group"
    assert resize_plan(6, 2, [], unit=2) == ([2, 3, 4, 5], [])


def test_a_group_kept_into_a_generation_of_another_shape_is_rebuilt_when_it_lost_ranks() -> None:
    """HSDP 3 x 2 shrunk to 2 x 2 at a step boundary: the replicate groups {0, 2, 4} and {1, 3, 5} become {0, 2}
    and {1, 3}, held by the same processes, built in the same generation, with the same collectives issued: only
    their size says that a member is gone. The shard groups {0, 1} and {2, 3} are whole and kept."""
    from runtime.training.groups import Held, mesh_groups, plan_rebuild

    groups = mesh_groups((2, 2), ("replicate", "shard"))
    held = {r: {"replicate0" if r % 2 == 0 else "replicate1": Held(0, 7, 3), f"shard{r // 2}": Held(0, 9, 2)}
            for r in range(4)}
    assert plan_rebuild(groups, held) == {"replicate0", "replicate1"}
    unsaid = {r: {k: Held(h.built, h.issued) for k, h in v.items()} for r, v in held.items()}
    assert plan_rebuild(groups, unsaid) == set(), "a size not said (an older member) changes nothing"


def _report(rank: int, role: str, seen: float, end: float, first: float | None = 0.1,
            steady: float | None = 0.08, nbytes: int = 0) -> RecoveryReport:
    return RecoveryReport(rank=rank, role=role, group_ready_at=end, handoff_s=0.0, handoff_bytes=nbytes,
                          handoff_end_at=end, replay_step=5, gen_seen_at=seen, replay_step_s=first,
                          steady_step_s=steady, replay_done_at=end + (first or 0.0), final=True)


def test_a_planned_change_costs_from_the_first_holder_leaving_to_the_last_member_holding_the_state() -> None:
    # The new member saw the generation long before (it waited for the others): not the start of the stall.
    f = change_figures([_report(0, "source", 10.0, 10.05, nbytes=0), _report(1, "idle", 10.01, 10.04),
                        _report(2, "receiver", 3.0, 10.07, first=0.2, steady=None, nbytes=4096)])
    assert f.stall_s == pytest.approx(0.07)
    assert f.first_step_s == 0.2 and f.steady_step_s == pytest.approx(0.08) and f.handoff_bytes == 4096


def test_a_resize_request_is_checked_before_the_coordinator_sees_it() -> None:
    assert parse_resize(ResizeRequest(3, 2, "free capacity").to_json()) == ResizeRequest(3, 2, "free capacity")
    for raw, message in (("[]", "JSON object"), ('{"seq": 0, "width": 2}', "positive integer seq"),
                         ('{"seq": 1, "width": 0}', "positive integer"), ('{"seq": 1, "width": true}', "positive"),
                         ('{"seq": 1, "width": 2, "reason": ""}', "reason")):
        with pytest.raises(ControlValueError, match=message):
            parse_resize(raw)


# -- the coordinator's loop on a fake clock ------------------------------------------------------------------------
def _start(scene: Scene) -> None:
    """Start the job, and publish a committed step as the members' heartbeats would: the coordinator makes planned
    changes only once a step was committed (a sharded job has said so by then)."""
    scene.c.start()
    scene.member.put(keys.k_progress(), Progress(1))


def _join(scene: Scene, gen: Generation) -> None:
    for r in range(gen.world_size):
        scene.member.put(keys.k_joined(gen.gen, r), Joined())


def _report_all(scene: Scene, gen: Generation, receivers: tuple[int, ...] = ()) -> None:
    now = scene.clock.wall()
    for r in range(gen.world_size):
        role = "receiver" if r in receivers else "source"
        nbytes = 1000 if role == "receiver" else 0
        scene.member.put(keys.k_report(gen.gen, r), _report(r, role, now - 0.05, now, nbytes=nbytes))


@pytest.mark.timeout(20)
def test_no_standby_within_the_wait_shrinks_the_job_and_a_standby_warm_later_grows_it_at_a_step_boundary() -> None:
    scene = Scene(lambda name, role: Script(exit_at=1.0) if name == "w1" else
                  Script(ready_at=9.0) if role == "standby" else Script(), nproc=3, standby=0, standby_wait_s=4.0)
    _start(scene)
    shrunk_at = scene.until(lambda: scene.c.gen.gen == 1, 10.0)
    assert 5.0 < shrunk_at <= 5.0 + TICK, "shrunk at the first tick past the standby wait, not before"
    g1 = scene.member.get_record(keys.k_gen(1), Generation)
    assert g1 == scene.c.gen and g1.members == ("w0", "w2") and g1.logical == 3 and not g1.planned
    assert scene.member.get_record(keys.k_current_gen(), CurrentGeneration) == CurrentGeneration(1)
    assert "1 rank(s) left out (no standby ready within 4 s): 2 of 3 members" in g1.reason
    assert not scene.c.stop_sent
    _report_all(scene, g1)
    scene.until(lambda: bool(scene.events(Shrunk)), 2.0)
    (shrunk,) = scene.events(Shrunk)
    assert (shrunk.width_from, shrunk.width_to, shrunk.planned, shrunk.mode) == (3, 2, False, "accumulate")
    (recovered,) = scene.events(Recovered)
    assert recovered.ranks == [{"rank": 1, "old": "w1", "new": None}]
    # The standby started to cover the loss warms at 9 s: the job grows back onto it, planned.
    scene.until(lambda: scene.c.gen.gen == 2, 6.0)
    g2 = scene.member.get_record(keys.k_gen(2), Generation)
    assert g2 is not None and g2.members == ("w0", "w2", "s0") and g2.planned and g2.logical == 0
    assert scene.member.get_record(keys.k_assign("s0"), Assignment) == Assignment(2)
    assert scene.member.get_record(keys.k_current_gen(), CurrentGeneration) == CurrentGeneration(1), \
        "current only once every member switched: no step in flight is abandoned"
    _join(scene, g2)
    scene.until(lambda: scene.member.get_record(keys.k_current_gen(), CurrentGeneration) == CurrentGeneration(2), 1.0)
    _report_all(scene, g2, receivers=(2,))
    scene.until(lambda: bool(scene.events(Grew)), 1.0)
    (grew,) = scene.events(Grew)
    assert (grew.width_from, grew.width_to, grew.procs, grew.cause) == (2, 3, ["s0"], "a standby is ready")
    assert grew.stall_s == pytest.approx(0.05) and grew.handoff_bytes == 1000


@pytest.mark.timeout(20)
def test_a_sharded_job_without_a_replica_group_to_spare_stops_after_the_standby_wait() -> None:
    scene = Scene(lambda name, role: Script(exit_at=1.0) if name == "w1" else Script(), standby=0, standby_wait_s=2.0)
    scene.member.put(keys.k_state_homes(), StateHomes([[1], [0]]))
    result = scene.c.run()
    assert result.exit_code == 1 and "no standby became ready within 2 s" in result.message
    assert "--shrink" not in result.message, "no advice that cannot apply"


@pytest.mark.timeout(20)
def test_hsdp_loses_a_rank_with_no_standby_and_goes_on_without_its_replica_group() -> None:
    """HSDP 2 x 2 (replica groups {w0, w1} and {w2, w3}): w3 dies and no standby comes within the wait. The job
    goes on with replica group 0; w2, alive, is released with its group and leaves without counting as a failure.
    A resize to a width that is not whole replica groups is refused, naming the unit."""
    scene = Scene(lambda name, role: Script(exit_at=1.0) if name == "w3" else
                  Script(exit_at=4.0, exit_code=0) if name == "w2" else Script(), nproc=4, standby=0,
                  standby_wait_s=2.0, replenish=False)
    scene.member.put(keys.k_state_homes(), StateHomes([[2], [3], [0], [1]], replica_size=2))
    _start(scene)
    scene.until(lambda: scene.c.gen.gen == 1, 6.0)
    g1 = scene.member.get_record(keys.k_gen(1), Generation)
    assert g1 == scene.c.gen and g1.members == ("w0", "w1") and g1.logical == 4 and g1.released == ("w2",)
    assert "2 rank(s) left out (no standby ready within 2 s): 2 of 4 members" in g1.reason
    assert scene.c.procs["w2"].released
    _report_all(scene, g1)
    scene.until(lambda: bool(scene.events(Shrunk)) and scene.now > 4.0 + TICK, 6.0)
    (shrunk,) = scene.events(Shrunk)
    assert (shrunk.width_from, shrunk.width_to, [r["proc"] for r in shrunk.ranks]) == (4, 2, ["w3"])
    assert scene.c.gen.gen == 1 and not scene.c.stop_sent, "w2's exit is no failure"
    assert _resize(scene, 1, 3) == MoveResult(1, False, "a sharded job resizes by whole replica groups of 2 ranks: "
                                                        "ask for a multiple of 2")


def _resize(scene: Scene, seq: int, width: int) -> MoveResult:
    scene.orchestrator.put(keys.k_control_resize(), ControlCommand(seq, ResizeRequest(seq, width, "free capacity")
                                                                   .to_json()))
    scene.until(lambda: (r := scene.member.get_record(keys.k_control_resize_result(), MoveResult)) is not None
                and r.seq == seq, 2.0)
    answer = scene.member.get_record(keys.k_control_resize_result(), MoveResult)
    assert answer is not None
    return answer


@pytest.mark.timeout(20)
def test_a_resize_leaves_out_the_highest_ranks_at_a_step_boundary_and_their_exit_is_no_failure() -> None:
    scene = Scene(lambda name, role: Script(ready_at=0.3) if role == "standby" else Script(), nproc=4, standby=1)
    _start(scene)
    scene.run_for(1.0)
    assert _resize(scene, 1, 5) == MoveResult(1, False, "width 5 is more than the job's 4 logical ranks (--nproc)")
    assert _resize(scene, 2, 2) == MoveResult(2, True, "")
    (changed,) = scene.events(WidthTargetChanged)
    assert (changed.old, changed.new, changed.reason) == (4, 2, "free capacity")
    scene.until(lambda: scene.c.gen.gen == 1, 1.0)
    g1 = scene.c.gen
    assert g1.members == ("w0", "w1") and g1.planned and g1.logical == 4
    assert scene.c.procs["w2"].released and scene.c.procs["w3"].released
    _join(scene, g1)
    scene.until(lambda: scene.member.get_record(keys.k_current_gen(), CurrentGeneration) == CurrentGeneration(1), 1.0)
    scene.pool.procs["w2"].script = Script(exit_at=scene.now, exit_code=0)  # left as told
    scene.pool.procs["w3"].script = Script(exit_at=scene.now, exit_code=0)
    _report_all(scene, g1)
    scene.until(lambda: bool(scene.events(Shrunk)), 1.0)
    (shrunk,) = scene.events(Shrunk)
    assert shrunk.planned and shrunk.ranks == [{"rank": 2, "proc": "w2"}, {"rank": 3, "proc": "w3"}]
    assert shrunk.cause == "resize to 2: free capacity"
    scene.run_for(1.0)
    assert scene.c.gen.gen == 1, "no failure, no growth while the target is 2"
    assert len(scene.events(GenerationStarted)) == 2


@pytest.mark.timeout(20)
def test_a_member_left_out_that_dies_before_the_switch_makes_the_others_rebuild() -> None:
    scene = Scene(lambda name, role: Script(), nproc=2, standby=0)
    _start(scene)
    scene.run_for(0.5)
    assert _resize(scene, 1, 1).accepted
    scene.until(lambda: scene.c.gen.gen == 1, 1.0)
    scene.pool.procs["w1"].script = Script(exit_at=scene.now, exit_code=-9)  # killed before the others switched
    scene.until(lambda: scene.c.gen.gen == 2, 1.0)
    g2 = scene.c.gen
    assert g2.members == ("w0",) and not g2.planned and "before the members switched" in g2.reason
    assert scene.member.get_record(keys.k_current_gen(), CurrentGeneration) == CurrentGeneration(2)


@pytest.mark.timeout(20)
def test_members_that_cannot_agree_on_the_switch_report_in_the_old_generation_and_the_groups_are_rebuilt() -> None:
    """An outsider wrote the switch point first (members raise, report the failure in the generation they train
    in, and wait): the coordinator reads the old generation's reports too, and forms a failure's generation."""
    scene = Scene(lambda name, role: Script(), nproc=2, standby=0, hang_timeout_s=1.0)
    _start(scene)
    scene.run_for(0.5)
    assert _resize(scene, 1, 1).accepted
    scene.until(lambda: scene.c.gen.gen == 1, 1.0)
    for proc in ("w0", "w1"):
        scene.member.put(keys.k_failed(0, proc), FailureReport("the switch point is not the job's", scene.clock.wall(),
                                                               7))
        scene.store.add(keys.k_failed_count(0), 1)
    rebuilt_at = scene.until(lambda: scene.c.gen.gen == 2, 3.0)
    g2 = scene.c.gen
    assert g2.members == ("w0",) and not g2.planned and "collective error without a lost member" in g2.reason
    assert scene.member.get_record(keys.k_current_gen(), CurrentGeneration) == CurrentGeneration(2)
    assert rebuilt_at > 1.0, "after the hang timeout, as any collective error without a lost member"


@pytest.mark.timeout(20)
def test_a_job_whose_last_step_came_before_the_switch_ends_in_the_old_generation() -> None:
    scene = Scene(lambda name, role: Script(finish_at=2.0) if role == "worker" else Script(ready_at=0.3),
                  nproc=2, standby=1)
    _start(scene)
    scene.run_for(0.5)
    assert _resize(scene, 1, 1).accepted
    result = scene.c.run_loop()
    assert result.exit_code == 0 and set(result.digests) == {"w0", "w1"}
    (finished,) = scene.events(JobFinished)
    assert finished.generation == 0


@pytest.mark.timeout(20)
def test_a_resize_is_refused_when_the_job_runs_at_full_width_only() -> None:
    scene = Scene(lambda name, role: Script(), nproc=2, standby=0, shrink="off")
    _start(scene)
    scene.run_for(0.5)
    assert _resize(scene, 1, 1) == MoveResult(1, False, "the job was started with --shrink off: it runs at its full "
                                                        "width only")


@pytest.mark.timeout(20)
def test_a_planned_move_gives_the_rank_to_a_standby_at_a_step_boundary_and_nobody_fails() -> None:
    scene = Scene(lambda name, role: Script(ready_at=0.3) if role == "standby" else Script(), nproc=3, standby=1,
                  replenish=False)
    _start(scene)
    scene.until(lambda: bool(scene.c.standbys.ready()), 2.0)
    scene.orchestrator.put(keys.k_control_move(), ControlCommand(1, MoveRequest(1, (1,), "maintenance").to_json()))
    scene.until(lambda: scene.c.gen.gen == 1, 1.0)
    g1 = scene.c.gen
    assert g1.members == ("w0", "s0", "w2") and g1.planned and g1.replaced == ((1, "w1", "s0"),)
    assert scene.c.procs["w1"].released and not scene.pool.procs["w1"].killed, "not fenced: it leaves on its own"
    assert scene.member.get_record(keys.k_assign("s0"), Assignment) == Assignment(1)
    assert scene.member.get_record(keys.k_current_gen(), CurrentGeneration) == CurrentGeneration(0)
    # A second move while this one is under way waits: refused, and asked again later.
    scene.orchestrator.put(keys.k_control_move(), ControlCommand(2, MoveRequest(2, (2,), "maintenance").to_json()))
    scene.until(lambda: (r := scene.member.get_record(keys.k_control_move_result(), MoveResult)) is not None
                and r.seq == 2, 1.0)
    assert scene.member.get_record(keys.k_control_move_result(), MoveResult) == MoveResult(
        2, False, "a recovery is in progress; ask again once it is reported")
    _join(scene, g1)
    scene.pool.procs["w1"].script = Script(exit_at=scene.now, exit_code=0)  # it left after the switch
    _report_all(scene, g1, receivers=(1,))
    scene.until(lambda: bool(scene.events(Moved)), 1.0)
    (moved,) = scene.events(Moved)
    assert moved.ranks == [{"rank": 1, "old": "w1", "new": "s0"}] and moved.reason == "maintenance"
    assert moved.stall_s == pytest.approx(0.05) and moved.handoff_bytes == 1000
    scene.run_for(0.5)
    assert not scene.events(MemberFailed) and not scene.events(Recovered)


@pytest.mark.timeout(20)
def test_a_move_before_the_first_committed_step_waits_for_it_then_happens_at_a_step_boundary() -> None:
    scene = Scene(lambda name, role: Script(ready_at=0.3) if role == "standby" else Script(), nproc=2, standby=1,
                  replenish=False)
    scene.c.start()  # no step committed yet: a data-parallel job is not told apart from a sharded one
    scene.until(lambda: bool(scene.c.standbys.ready()), 2.0)
    scene.orchestrator.put(keys.k_control_move(), ControlCommand(1, MoveRequest(1, (1,), "maintenance").to_json()))
    scene.run_for(1.0)
    assert scene.c.gen.gen == 0 and scene.member.get_record(keys.k_control_move_result(), MoveResult) is None
    scene.member.put(keys.k_progress(), Progress(1))
    scene.until(lambda: scene.c.gen.gen == 1, 1.0)
    assert scene.c.gen.planned and scene.c.gen.members == ("w0", "s0")
    assert scene.member.get_record(keys.k_control_move_result(), MoveResult) == MoveResult(1, True, "")
    assert not scene.pool.procs["w1"].killed
