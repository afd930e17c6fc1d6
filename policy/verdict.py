"""Honest verdicts: a candidate policy against the static pool a cost owner would have picked beforehand.

This module owns the question "is the candidate (the learned policy, a burst-aware rule) worth running?" and
answers it without hindsight, on a temporal split of one trace (`traces.split_trace`):

1. On the training part (the first `train_fraction` of the window) the candidate and every static policy are
   replayed. The reference is the cheapest static whose ETTR there is at least the candidate's; if none reaches
   it, the static with the highest ETTR (ties: the cheaper). A static that follows a rule (P99-binomial, a
   fraction of the job) is frozen at the pool it held on the training part, so nothing about the test part
   leaks into it.
2. On the test part (the rest of the window) the candidate, the reference and every other frozen static are
   replayed. The ratio is candidate / reference cost per useful hour; the Pareto frontier of all of them is
   reported; every static that dominates the candidate there (ETTR at least as high and cost at most as high,
   one of the two strictly) is named, and then the verdict says so whatever the ratio.

The old comparison (the cheapest static of lower or equal ETTR, picked on the test data) dropped exactly the
statics that were cheaper *and* more available, so a dominated candidate could still report a ratio below 1.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from policy.costs import TIER_NAMES, StandbyCosts
from policy.simulator import (
    ComparisonRow,
    Oracle,
    StandbyPolicy,
    StaticPool,
    compare_policies,
    fleet_node_ids,
    frontier_names,
    job_view,
    shifted,
)
from policy.traces import FaultTrace, split_trace

STATIC_PREFIXES = ("no-standby", "static-", "binomial-")
"""Names of the policies that hold a fixed pool: the comparison set for a candidate."""

DEFAULT_TRAIN_FRACTION = 0.5
"""Share of the window, from its start, on which the reference static is chosen; the rest judges."""

_TIE = 1e-12


def is_static(name: str) -> bool:
    return name.startswith(STATIC_PREFIXES)


@dataclass(frozen=True, slots=True)
class PolicyVerdict:
    """The candidate against the static chosen on training data, both judged on test data. USD per useful hour."""

    learned: str
    """The candidate's name (the learned policy, or any other adaptive policy)."""
    learned_ettr: float
    learned_usd_per_useful_h: float
    best_static: str
    """The reference: the cheapest static whose training-part ETTR is at least the candidate's."""
    best_static_ettr: float
    """The reference's ETTR on the test part."""
    best_static_usd_per_useful_h: float
    cost_ratio: float
    """Candidate / reference cost per useful hour on the test part; below 1 means the candidate is cheaper."""
    oracle_usd_per_useful_h: float
    regret_usd_per_useful_h: float
    chosen_on: str
    """Which data chose the reference, e.g. "hours 0-2160 of 4320"."""
    learned_train_ettr: float
    best_static_train_ettr: float
    best_static_train_usd_per_useful_h: float
    dominated_by: tuple[str, ...]
    """Statics that on the test part are at least as available and at most as expensive (one strictly), best first."""
    frontier: tuple[str, ...]
    """The Pareto frontier of every policy on the test part (oracle left out), cheapest first."""
    summary: str
    """The verdict in one sentence."""


def freeze(
    policy: StandbyPolicy,
    trace: FaultTrace,
    costs: StandbyCosts,
    job_nodes: int | None = None,
    seed: int = 0,
    node_ids: Sequence[str] | None = None,
) -> StaticPool:
    """The fixed pool a static policy holds on `trace` (a rule's P99 count uses that trace's rate), by its name."""
    sched = policy.schedule(job_view(trace, costs, job_nodes, seed, node_ids))
    if np.any(sched.counts != sched.counts[0]):
        raise ValueError(f"{policy.name} changes its pool over time; only a static policy can be frozen")
    counts = dict(zip(TIER_NAMES, (int(c) for c in sched.counts[0]), strict=True))
    return StaticPool(
        hot=counts["hot"], warm=counts["warm"], stopped=counts["stopped"], spot=counts["spot"], label=policy.name
    )


def choose_reference(train_rows: Sequence[ComparisonRow], candidate: str) -> ComparisonRow:
    """The cheapest static of `train_rows` whose ETTR is at least the candidate's (else the most available one)."""
    mine = next(r for r in train_rows if r.name == candidate)
    statics = [r for r in train_rows if is_static(r.name)]
    if not statics:
        raise ValueError("no static policy among the rows; a verdict needs at least one to compare with")
    eligible = [r for r in statics if r.ettr >= mine.ettr - _TIE]
    if eligible:
        return min(eligible, key=lambda r: (r.cost_per_useful_hour, -r.ettr))
    return max(statics, key=lambda r: (r.ettr, -r.cost_per_useful_hour))


def dominators(rows: Sequence[ComparisonRow], candidate: str) -> list[ComparisonRow]:
    """Statics at least as available and at most as expensive as the candidate, one of the two strictly; cheapest
    first."""
    mine = next(r for r in rows if r.name == candidate)
    out = [
        r
        for r in rows
        if is_static(r.name)
        and r.ettr >= mine.ettr - _TIE
        and r.cost_per_useful_hour <= mine.cost_per_useful_hour
        and (r.ettr > mine.ettr + _TIE or r.cost_per_useful_hour < mine.cost_per_useful_hour)
    ]
    return sorted(out, key=lambda r: (r.cost_per_useful_hour, -r.ettr))


def _ratio(a: float, b: float) -> float:
    if b > 0:
        return a / b
    return 1.0 if a == b else math.inf


def verdict(
    train_rows: Sequence[ComparisonRow], test_rows: Sequence[ComparisonRow], candidate: str, chosen_on: str
) -> PolicyVerdict:
    """Judge `candidate` on `test_rows` against the static that `train_rows` chose (see the module docstring).

    Both row sets must hold the same statics under the same names (frozen on the training part), and the oracle.
    """
    ref_train = choose_reference(train_rows, candidate)
    by_name = {r.name: r for r in test_rows}
    mine, ref, oracle = by_name[candidate], by_name[ref_train.name], by_name["oracle"]
    ratio = _ratio(mine.cost_per_useful_hour, ref.cost_per_useful_hour)
    beaten_by = dominators(test_rows, candidate)
    if beaten_by:
        best = beaten_by[0]
        summary = (
            f"{candidate} is dominated: {best.name} is cheaper or as cheap ({best.cost_per_useful_hour:.2f} vs "
            f"{mine.cost_per_useful_hour:.2f} USD/useful h) at an ETTR at least as high ({best.ettr:.5f} vs "
            f"{mine.ettr:.5f})"
            + (f", and {len(beaten_by) - 1} other static(s) too" if len(beaten_by) > 1 else "")
            + f"; run the static. Against {ref.name}, chosen on {chosen_on}, the ratio is {ratio:.3f}"
        )
    else:
        if math.isclose(ratio, 1.0, abs_tol=5e-4):
            how = "the same cost"
        else:
            how = f"{abs(1 - ratio):.0%} " + ("cheaper" if ratio < 1 else "dearer")
        summary = (
            f"{candidate} costs {ratio:.3f}x {ref.name} (chosen on {chosen_on}): {how}, at ETTR {mine.ettr:.5f} vs "
            f"{ref.ettr:.5f}; no static dominates it"
        )
    return PolicyVerdict(
        learned=candidate,
        learned_ettr=mine.ettr,
        learned_usd_per_useful_h=mine.cost_per_useful_hour,
        best_static=ref.name,
        best_static_ettr=ref.ettr,
        best_static_usd_per_useful_h=ref.cost_per_useful_hour,
        cost_ratio=ratio,
        oracle_usd_per_useful_h=oracle.cost_per_useful_hour,
        regret_usd_per_useful_h=mine.regret_usd_per_useful_h,
        chosen_on=chosen_on,
        learned_train_ettr=next(r for r in train_rows if r.name == candidate).ettr,
        best_static_train_ettr=ref_train.ettr,
        best_static_train_usd_per_useful_h=ref_train.cost_per_useful_hour,
        dominated_by=tuple(r.name for r in beaten_by),
        frontier=tuple(frontier_names(test_rows)),
        summary=summary,
    )


@dataclass(frozen=True, slots=True)
class Judgement:
    """Every policy on the training part and on the test part of a trace, and the verdict."""

    split_h: float
    train_rows: list[ComparisonRow]
    test_rows: list[ComparisonRow]
    verdict: PolicyVerdict


def judge(
    trace: FaultTrace,
    costs: StandbyCosts,
    candidate: StandbyPolicy,
    statics: Sequence[StandbyPolicy],
    *,
    train_fraction: float = DEFAULT_TRAIN_FRACTION,
    node_ids: Sequence[str] | None = None,
    job_nodes: int | None = None,
    seed: int = 0,
) -> Judgement:
    """Choose the reference static on the first `train_fraction` of `trace`, judge `candidate` on the rest.

    The candidate sees the second part with its own clock (`shifted`), so a learned policy reads the hazards of
    the hours it is judged on. Every static is frozen at the pool it held on the first part.
    """
    if not 0.0 < train_fraction < 1.0:
        raise ValueError(f"train_fraction={train_fraction} must lie strictly between 0 and 1, e.g. 0.5")
    names = [p.name for p in statics]
    if len(set(names)) != len(names) or candidate.name in names or not all(is_static(n) for n in names):
        raise ValueError(f"statics need unique names that start with {STATIC_PREFIXES}, none the candidate's")
    split_h = train_fraction * trace.duration_h
    head, tail = split_trace(trace, split_h)
    nodes = tuple(node_ids) if node_ids is not None else fleet_node_ids(trace)
    frozen = [freeze(p, head, costs, job_nodes, seed, nodes) for p in statics]
    train_rows = compare_policies(head, costs, [*frozen, candidate, Oracle()], job_nodes, seed, nodes)
    test_rows = compare_policies(tail, costs, [*frozen, shifted(candidate, split_h), Oracle()], job_nodes, seed, nodes)
    chosen_on = f"hours 0-{split_h:.0f} of {trace.duration_h:.0f}"
    return Judgement(split_h, train_rows, test_rows, verdict(train_rows, test_rows, candidate.name, chosen_on))


def cheapest_static(rows: Sequence[ComparisonRow]) -> ComparisonRow:
    """The static cheapest per useful hour (ties: the more available): the one a cost owner picks on these rows."""
    return min((r for r in rows if is_static(r.name)), key=lambda r: (r.cost_per_useful_hour, -r.ettr))


@dataclass(frozen=True, slots=True)
class StaticChoice:
    """The static a cost owner picks on the training part of a trace, and every static on the test part."""

    split_h: float
    chosen: str
    """The static cheapest per useful hour on the training part (rule-based ones frozen there)."""
    train_rows: list[ComparisonRow]
    test_rows: list[ComparisonRow]

    @property
    def on_test(self) -> ComparisonRow:
        """The chosen static's figures on the test part."""
        return next(r for r in self.test_rows if r.name == self.chosen)


def choose_static(
    trace: FaultTrace,
    costs: StandbyCosts,
    statics: Sequence[StandbyPolicy],
    *,
    train_fraction: float = DEFAULT_TRAIN_FRACTION,
    node_ids: Sequence[str] | None = None,
) -> StaticChoice:
    """Pick the static cheapest per useful hour on the first `train_fraction` of `trace` and replay every static
    (frozen there) on the rest: the temporal split without a candidate, e.g. to ask whether offering another tier
    (spot) pays without choosing its pools in hindsight."""
    if not 0.0 < train_fraction < 1.0:
        raise ValueError(f"train_fraction={train_fraction} must lie strictly between 0 and 1, e.g. 0.5")
    split_h = train_fraction * trace.duration_h
    head, tail = split_trace(trace, split_h)
    nodes = tuple(node_ids) if node_ids is not None else fleet_node_ids(trace)
    frozen = [freeze(p, head, costs, None, 0, nodes) for p in statics]
    train_rows = compare_policies(head, costs, [*frozen, Oracle()], node_ids=nodes)
    test_rows = compare_policies(tail, costs, [*frozen, Oracle()], node_ids=nodes)
    return StaticChoice(split_h, cheapest_static(train_rows).name, train_rows, test_rows)
