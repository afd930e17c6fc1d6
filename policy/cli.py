"""`trainmover policy ...`: simulate standby policies on a fault trace, tune them, generate synthetic traces,
train the failure predictor on synthetic fleets and evaluate it (and the learned policy) on a fresh fleet.

The dispatcher calls `add_policy_parser(subparsers)` and then `policy_command(namespace)`. Errors a user can
cause (a missing or malformed trace, a negative price, a file that is not a model) print one line on stderr
and return exit code 2.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import warnings
import zipfile
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from policy.costs import (
    DEFAULT_STOPPED_CAPACITY,
    DEFAULT_TIER_NAMES,
    HOT_EXTRA_USD_PER_H,
    NODE_PRICE_USD_PER_H,
    SPOT_INTERRUPTIONS_PER_H,
    SPOT_PRICE_RATIO,
    STOPPED_WAKE_FAILURE_PROB,
    TIER_NAMES,
    StandbyCosts,
    TierCosts,
    TierName,
    default_tiers,
    spot_tier,
)
from policy.features import DEFAULT_HORIZON_H
from policy.traces import MAX_FLEET_NODES
from trainmover.cli import part_main

if TYPE_CHECKING:
    from policy.predictor import FailurePredictor, ModelScore
    from policy.synthetic import SyntheticFleetConfig

_EXIT_USAGE = 2
_COST_FLAGS = {
    "job_price_usd_per_h": "--job-price-usd-per-h",
    "lead_time_h": "--lead-time-h",
    "restart_downtime_s": "--restart-downtime-s",
    "replacement_h": "--replacement-h",
    "shrink_s": "--shrink-s",
    "shrink_replica_nodes": "--shrink-replica-nodes",
    "budget_usd_per_h": "--budget-usd-per-h",
    "hysteresis": "--hysteresis",
    "min_hold_s": "--min-hold-s",
}
_FLEET_FLAGS = {
    "n_nodes": "--nodes",
    "days": "--days",
    "seed": "--seed",
    "precursor_fraction": "--precursor-fraction",
    "false_alarms_per_node_year": "--false-alarms-per-node-year",
    "burst_share": "--burst-share",
}


class PolicyUsageError(Exception):
    """A mistake in the command line or its inputs; the message says what to fix."""


def _add_trace_and_costs(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--trace",
        required=True,
        help="'infinitehbd' or 'lanl-system20' (real fleets shipped with the package) or a CSV file (see read_csv)",
    )
    p.add_argument(
        "--nodes",
        type=int,
        help="fleet size incl. nodes that never failed (required for a CSV; 400 for infinitehbd, 512 for "
        f"lanl-system20; at most {MAX_FLEET_NODES:,})",
    )
    p.add_argument(
        "--duration-h",
        type=float,
        help="the trace's observation window in hours from hour 0 (default: up to its latest fault time)",
    )
    p.add_argument("--job-nodes", type=int, help="nodes the job runs on (default: the whole fleet)")
    p.add_argument("--json", metavar="FILE", help="also write the result as JSON")
    _add_cost_flags(p)


def _add_cost_flags(p: argparse.ArgumentParser) -> None:
    """The StandbyCosts knobs (see `_COST_FLAGS` and `policy.costs` for the source of every default). The job
    price defaults to the job's node count (--job-nodes, else the fleet) x --node-price-usd-per-h; tier prices
    default to what a node of that price costs in each tier."""
    defaults = StandbyCosts()
    tiers = default_tiers()
    p.add_argument(
        "--node-price-usd-per-h",
        type=float,
        default=NODE_PRICE_USD_PER_H,
        help="on-demand price of one node (default: %(default)s, AWS p5.48xlarge in us-east-1)",
    )
    p.add_argument(
        "--job-price-usd-per-h",
        type=float,
        default=None,
        help="whole-job price per hour (default: the job's nodes x --node-price-usd-per-h)",
    )
    p.add_argument(
        "--tiers",
        default=",".join(DEFAULT_TIER_NAMES),
        help="standby tiers offered, comma-separated, from stopped, warm, hot and spot (default: %(default)s)",
    )
    described: tuple[tuple[TierName, str], ...] = (
        ("stopped", "a parked instance's volumes, plus the node price when --stopped-capacity reserved"),
        ("warm", "the node price"),
        ("hot", f"the node price + {HOT_EXTRA_USD_PER_H:g} for mirroring"),
        ("spot", f"{SPOT_PRICE_RATIO:g} x the node price, an assumed spot price"),
    )
    for tier, what in described:
        p.add_argument(
            f"--{tier}-price-usd-per-h",
            type=float,
            default=None,
            help=f"hourly price of a {tier} standby (default: {what})",
        )
        p.add_argument(
            f"--{tier}-takeover-s",
            type=float,
            default=(tiers[tier] if tier in tiers else spot_tier()).takeover_s,
            help=f"whole-job downtime when a {tier} standby takes over (default: %(default)s)",
        )
    p.add_argument(
        "--spot-interruptions-per-h",
        type=float,
        default=SPOT_INTERRUPTIONS_PER_H,
        help="rate at which the provider reclaims a spot standby, per hour (default: %(default).3g, the AWS Spot "
        "Instance Advisor's top bucket, >20%% a month, taken at 20%%: an assumption, use your instance's bucket)",
    )
    p.add_argument(
        "--stopped-capacity",
        choices=("unreserved", "reserved"),
        default=DEFAULT_STOPPED_CAPACITY,
        help="unreserved: a stopped standby may fail to start (--stopped-wake-failure-prob); reserved: a capacity "
        "reservation billed at the node price makes it always start (default: %(default)s)",
    )
    p.add_argument(
        "--stopped-wake-failure-prob",
        type=float,
        default=None,
        help=f"P(a stopped standby cannot start) (default: {STOPPED_WAKE_FAILURE_PROB:g} unreserved, 0 reserved)",
    )
    p.add_argument(
        "--lead-time-h",
        type=float,
        default=defaults.lead_time_h,
        help="replenishment lead time: hours to obtain a fresh node (default: %(default)s)",
    )
    p.add_argument(
        "--restart-downtime-s",
        type=float,
        default=defaults.restart_downtime_s,
        help="checkpoint-restart downtime of an uncovered failure once a host is there (default: %(default)s)",
    )
    p.add_argument(
        "--shrink-s",
        type=float,
        default=None,
        help="the job shrinks when no standby is left (trainmover run --shrink): an uncovered failure costs this "
        "many seconds plus one node's share of the throughput until a replacement arrives, instead of a restart "
        "(default: it restarts)",
    )
    p.add_argument(
        "--shrink-replica-nodes",
        type=int,
        default=defaults.shrink_replica_nodes,
        help="with --shrink-s: nodes a shrink leaves out per lost node, one data-parallel replica's (default: "
        "%(default)s, pure data parallelism)",
    )
    p.add_argument(
        "--replacement-h",
        type=float,
        default=None,
        help="hours an uncovered failure waits for a replacement host before restarting (default: --lead-time-h)",
    )
    p.add_argument("--budget-usd-per-h", type=float, default=None, help="cap on the standbys' hourly cost")
    p.add_argument("--hysteresis", type=float, default=defaults.hysteresis, help="(default: %(default)s)")
    p.add_argument("--min-hold-s", type=float, default=defaults.min_hold_s, help="(default: %(default)s)")


def _add_fleet_flags(p: argparse.ArgumentParser) -> None:
    """Size and calibration of the synthetic fleets (`pipeline.fleet_config`)."""
    p.add_argument("--nodes", type=int, default=256, help="nodes per fleet (default: %(default)s)")
    p.add_argument("--days", type=float, default=180.0, help="window length in days (default: %(default)s)")
    p.add_argument(
        "--horizon-h",
        type=float,
        default=None,
        help=f"a row is positive if its node faults within this many hours (train default: {DEFAULT_HORIZON_H:g}); "
        "evaluate uses the horizon saved in the model",
    )
    p.add_argument("--precursor-fraction", type=float, help="share of faults preceded by telemetry precursors")
    p.add_argument(
        "--false-alarms-per-node-year", type=float, help="precursor-like bursts per node-year that no fault follows"
    )
    p.add_argument(
        "--burst-share",
        type=float,
        help="share of faults in common-cause bursts (default 0, independent nodes; 0.3 matches InfiniteHBD)",
    )


def add_policy_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("policy", help="standby policies: simulate, tune, generate traces, train, evaluate")
    actions = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    s = actions.add_parser("simulate", help="compare the baseline policies on a trace (ETTR, cost, regret)")
    _add_trace_and_costs(s)
    t = actions.add_parser("tune", help="sweep policy settings, print the ETTR/cost frontier and a recommendation")
    _add_trace_and_costs(t)
    t.add_argument("--plot", metavar="FILE.png", help="write the frontier as a PNG")
    t.add_argument("--min-ettr", type=float, help="recommend the cheapest setting with at least this ETTR")
    g = actions.add_parser("generate", help="write a synthetic fleet's fault trace as CSV")
    g.add_argument("--nodes", type=int, default=1024, help="fleet size (default: %(default)s)")
    g.add_argument("--days", type=float, default=365.0, help="window length in days (default: %(default)s)")
    g.add_argument("--seed", type=int, default=0, help="random seed (default: %(default)s)")
    g.add_argument(
        "--burst-share",
        type=float,
        default=0.0,
        help="share of faults in common-cause bursts across a failure domain (default: %(default)s, independent "
        "nodes; 0.3 matches the InfiniteHBD trace's burst curve)",
    )
    g.add_argument(
        "--hazard-shift",
        action="append",
        default=[],
        metavar="START_DAY:DAYS:FACTOR",
        help="a period in which the fleet fails FACTOR times as often, e.g. 60:14:3 for a rollout from day 60 for "
        "two weeks; repeat for several (default: none)",
    )
    g.add_argument("--out", required=True, metavar="FILE.csv", help="where to write the CSV")
    g.add_argument("--json", metavar="FILE", help="also write a summary (faults, nodes, days, seed, path) as JSON")
    tr = actions.add_parser("train", help="fit the failure predictor on synthetic fleets and save it (skops)")
    tr.add_argument("--seeds", required=True, help="comma-separated seeds of the training fleets, e.g. 1,2,3")
    _add_fleet_flags(tr)
    tr.add_argument("--max-iter", type=int, default=100, help="boosting iterations (default: %(default)s)")
    tr.add_argument("--out", required=True, metavar="MODEL.skops", help="where to write the model")
    tr.add_argument("--json", metavar="FILE", help="also write the training report as JSON")
    ev = actions.add_parser(
        "evaluate",
        help="score a saved model on a fresh fleet, or fit on the first part of a trace (--trace) and judge on the "
        "rest, against the baselines",
    )
    ev.add_argument(
        "--model",
        metavar="MODEL.skops",
        help="a model written by `policy train` (for a synthetic fleet; not with --trace)",
    )
    ev.add_argument(
        "--trace",
        help="judge on a fault trace instead: 'infinitehbd', 'lanl-system20' or a CSV file; a history-only model is "
        "fitted on its first part (--train-fraction) and kept only if it beat the statics within that part",
    )
    ev.add_argument(
        "--duration-h", type=float, help="with --trace: its observation window in hours (default: its latest time)"
    )
    ev.add_argument("--seed", type=int, default=9001, help="seed of the evaluation fleet (default: %(default)s)")
    _add_fleet_flags(ev)
    ev.add_argument(
        "--multiplier", type=float, default=1.0, help="scales the learned policy's hazards (default: %(default)s)"
    )
    ev.add_argument(
        "--train-fraction",
        type=float,
        default=0.5,
        help="share of the window, from its start, on which the reference static is chosen; the rest is judged "
        "(default: %(default)s)",
    )
    ev.add_argument(
        "--candidates",
        help="with --trace: the candidates to fit and judge, comma-separated (default: all of learned-history, "
        "learned-burst, burst-aware, reactive-hold)",
    )
    ev.add_argument("--json", metavar="FILE", help="also write the evaluation as JSON")
    _add_cost_flags(ev)
    ev.set_defaults(nodes=None)  # 256 for a synthetic fleet; a trace's own size (required for a CSV)


def _costs(ns: argparse.Namespace, job_nodes: int) -> StandbyCosts:
    """The prices of the flags, for a job of `job_nodes` nodes; a bad value names its flag."""
    offered = [t.strip() for t in ns.tiers.split(",") if t.strip()]
    unknown = sorted(set(offered) - set(TIER_NAMES))
    if unknown or not offered or len(set(offered)) != len(offered):
        raise PolicyUsageError(
            f"--tiers {ns.tiers}: name each of {', '.join(TIER_NAMES)} at most once, e.g. hot,stopped"
        )
    try:
        base = default_tiers(ns.node_price_usd_per_h, ns.stopped_capacity) | {
            "spot": spot_tier(ns.node_price_usd_per_h)
        }
    except ValidationError as exc:
        raise PolicyUsageError(f"--node-price-usd-per-h: {exc.errors()[0]['msg']}") from None
    tiers = {}
    for tier in offered:
        update: dict[str, float] = {"takeover_s": getattr(ns, f"{tier}_takeover_s")}
        if getattr(ns, f"{tier}_price_usd_per_h") is not None:
            update["price_usd_per_h"] = getattr(ns, f"{tier}_price_usd_per_h")
        if tier == "stopped" and ns.stopped_wake_failure_prob is not None:
            update["wake_failure_prob"] = ns.stopped_wake_failure_prob
        if tier == "spot":
            update["interruptions_per_h"] = ns.spot_interruptions_per_h
        try:
            tiers[tier] = TierCosts.model_validate(base[tier].model_dump() | update)
        except ValidationError as exc:
            err = exc.errors()[0]
            field = str(err["loc"][0]) if err["loc"] else "price_usd_per_h"
            flag = {
                "price_usd_per_h": "price-usd-per-h",
                "takeover_s": "takeover-s",
                "interruptions_per_h": "interruptions-per-h",
            }.get(field, "wake-failure-prob")
            raise PolicyUsageError(f"--{tier}-{flag}: {err['msg']}") from None
    values = {field: getattr(ns, field) for field in _COST_FLAGS}
    if values["job_price_usd_per_h"] is None:
        values["job_price_usd_per_h"] = job_nodes * ns.node_price_usd_per_h
    try:
        return StandbyCosts(**values, tiers=tiers)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = err["loc"][0] if err["loc"] else ""
        flag = _COST_FLAGS.get(str(loc), "prices")
        raise PolicyUsageError(f"{flag}: {str(err['msg']).removeprefix('Value error, ')}") from None


def _priced_job(costs: StandbyCosts, job_nodes: int, ns: argparse.Namespace) -> str:
    """One line that says what the job and its failures were priced at."""
    source = "given" if ns.job_price_usd_per_h is not None else f"{job_nodes} nodes x {ns.node_price_usd_per_h:g}"
    tiers = ", ".join(
        f"{t} {c.price_usd_per_h:g} USD/h, {c.takeover_s:g} s"
        + (f", wakes {1 - c.wake_failure_prob:.0%}" if c.wake_failure_prob else "")
        + (f", reclaimed {c.interruptions_per_h:.3g}/h" if c.interruptions_per_h else "")
        for t, c in costs.tiers.items()
    )
    uncovered = costs.uncovered_cost_s(job_nodes)
    how = (f"a shrink by {costs.shrink_replica_nodes} node(s) until a fresh node arrives"
           if uncovered < costs.uncovered_downtime_s else f"restart {costs.restart_downtime_s:g} s + replacement")
    return (
        f"job {costs.job_price_usd_per_h:.2f} USD/h ({source}); uncovered failure {uncovered:g} s ({how}); "
        f"standbys: {tiers}"
    )


def _trace(ns: argparse.Namespace) -> Any:
    """The trace `--trace` names, on `--nodes` nodes over `--duration-h` hours; what the reader changed in a raw
    export (duplicates, overlaps, a byte-order mark) is printed in one line."""
    from policy.traces import SHIPPED_TRACES, TraceFormatError, load_shipped, read_csv, with_window

    if ns.nodes is not None and not 1 <= ns.nodes <= MAX_FLEET_NODES:
        raise PolicyUsageError(
            f"--nodes {ns.nodes}: must lie in [1, {MAX_FLEET_NODES:,}]; the simulator names and places every node, "
            "so for a larger fleet simulate a representative part of it (and its faults)"
        )
    if ns.duration_h is not None and not (math.isfinite(ns.duration_h) and ns.duration_h > 0):
        raise PolicyUsageError(f"--duration-h {ns.duration_h:g}: must be a positive number of hours")
    try:
        if ns.trace in SHIPPED_TRACES:
            trace, report = load_shipped(ns.trace, ns.nodes)
        else:
            path = Path(ns.trace)
            if not path.is_file():
                raise PolicyUsageError(
                    f"--trace {ns.trace}: no such file; pass {' or '.join(map(repr, SHIPPED_TRACES))} or a CSV trace"
                )
            if ns.nodes is None:
                raise PolicyUsageError(
                    "--nodes is required with a CSV trace: the fleet size incl. nodes that never failed"
                )
            trace, report = read_csv(path, n_nodes=ns.nodes)
        if ns.duration_h is not None:
            trace = with_window(trace, ns.duration_h)
    except (TraceFormatError, ValueError, OSError) as exc:
        if isinstance(exc, PolicyUsageError):
            raise
        flag = "--duration-h" if "duration_h" in str(exc) else "--trace " + ns.trace
        raise PolicyUsageError(f"{flag}: {exc}") from None
    if report is not None:
        print(f"trace {report.summary()}")
    if not trace.duration_h > 0:
        raise PolicyUsageError(f"--trace {ns.trace}: the trace spans 0 hours; it needs faults at positive times")
    if ns.job_nodes is not None and not 1 <= ns.job_nodes <= trace.n_nodes:
        raise PolicyUsageError(f"--job-nodes {ns.job_nodes}: must lie in [1, {trace.n_nodes}] (the fleet size)")
    return trace


def _write_json(path: str | None, payload: Any) -> None:
    if path is not None:
        try:
            Path(path).write_text(json.dumps(payload, indent=2, default=float) + "\n", encoding="utf-8")
        except OSError as exc:
            raise PolicyUsageError(f"--json {path}: cannot write ({exc.strerror})") from None


def _simulate(ns: argparse.Namespace) -> int:
    from policy.simulator import compare_policies, default_policies, format_table, frontier_names, static_pools

    trace = _trace(ns)
    job_nodes = ns.job_nodes or trace.n_nodes
    costs = _costs(ns, job_nodes)
    print(_priced_job(costs, job_nodes, ns))
    pools = static_pools(costs.tiers)
    rows = compare_policies(trace, costs, [*default_policies(costs.tiers), *pools], job_nodes=ns.job_nodes)
    # Every mixed-tier pool is replayed; the table shows those on the Pareto frontier (the others are beaten).
    front, pool_names = set(frontier_names(rows)), {p.name for p in pools}
    rows = [r for r in rows if r.name not in pool_names or r.name in front]
    print(format_table(rows))
    print(f"('*': Pareto frontier; {len(pools)} mixed-tier pools replayed, those on the frontier shown)")
    _write_json(
        ns.json,
        [
            {
                "policy": r.name,
                "ettr": r.ettr,
                "cost_per_useful_hour": r.cost_per_useful_hour,
                "regret_usd_per_useful_h": r.regret_usd_per_useful_h,
                "covered_failures": r.covered_failures,
                "uncovered_failures": r.uncovered_failures,
                "standby_cost_usd": r.standby_cost_usd,
                "downtime_cost_usd": r.downtime_cost_usd,
                "frontier": r.name in front,
            }
            for r in rows
        ],
    )
    return 0


def _tune(ns: argparse.Namespace) -> int:
    from policy.tuning import NoSettingMeetsFloor, frontier_table, pareto_frontier, plot_frontier, recommend, sweep

    if ns.min_ettr is not None and not 0.0 <= ns.min_ettr <= 1.0:
        raise PolicyUsageError(f"--min-ettr {ns.min_ettr}: must lie in [0, 1], e.g. 0.995")
    trace = _trace(ns)
    job_nodes = ns.job_nodes or trace.n_nodes
    costs = _costs(ns, job_nodes)
    print(_priced_job(costs, job_nodes, ns))
    points = sweep(trace, costs, job_nodes=ns.job_nodes)
    try:
        best = recommend(points, ns.min_ettr)
    except NoSettingMeetsFloor as exc:
        raise PolicyUsageError(f"--min-ettr {ns.min_ettr}: {exc}") from None
    print(frontier_table(points))
    print(f"recommended: {best.setting} (ETTR {best.ettr:.5f}, {best.cost_per_useful_hour:.2f} USD per useful hour)")
    if ns.plot is not None:
        try:
            plot_frontier(points, ns.plot, recommended=best)
        except OSError as exc:
            raise PolicyUsageError(f"--plot {ns.plot}: cannot write ({exc.strerror})") from None
    _write_json(
        ns.json,
        {
            "points": [p.to_dict() for p in points],
            "frontier": [p.setting for p in pareto_frontier(points)],
            "recommended": best.to_dict(),
            "min_ettr": ns.min_ettr,
        },
    )
    return 0


def _generate(ns: argparse.Namespace) -> int:
    from policy.synthetic import HazardShift, SyntheticFleetConfig, generate_fleet
    from policy.traces import write_csv

    shifts = []
    for text in ns.hazard_shift:
        try:
            shifts.append(HazardShift.parse(text))
        except ValidationError as exc:
            err = exc.errors()[0]
            raise PolicyUsageError(f"--hazard-shift {text}: {err['loc'][0]} {err['msg']}") from None
        except ValueError as exc:
            raise PolicyUsageError(f"--hazard-shift {exc}") from None
    try:
        config = SyntheticFleetConfig(
            n_nodes=ns.nodes, days=ns.days, seed=ns.seed, burst_share=ns.burst_share, hazard_shifts=tuple(shifts)
        )
    except ValidationError as exc:
        err = exc.errors()[0]
        flag = {"n_nodes": "--nodes", "days": "--days", "seed": "--seed", "burst_share": "--burst-share"}.get(
            str(err["loc"][0]), "config"
        )
        raise PolicyUsageError(f"{flag}: {err['msg']}") from None
    trace = generate_fleet(config).trace  # a node under repair never faults again, so no record overlaps
    try:
        write_csv(trace, ns.out)
    except OSError as exc:
        raise PolicyUsageError(f"--out {ns.out}: cannot write ({exc.strerror})") from None
    print(f"wrote {len(trace.records)} faults of {config.n_nodes} nodes over {config.days:g} days to {ns.out}")
    _write_json(
        ns.json,
        {
            "faults": len(trace.records),
            "nodes": config.n_nodes,
            "days": config.days,
            "seed": config.seed,
            "path": str(ns.out),
        },
    )
    return 0


def _seeds(text: str) -> tuple[int, ...]:
    try:
        seeds = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise PolicyUsageError(f"--seeds {text}: expected comma-separated integers, e.g. 1,2,3") from None
    if len(set(seeds)) != len(seeds):
        raise PolicyUsageError(f"--seeds {text}: each seed may appear once (a repeated seed repeats its fleet)")
    return seeds


def _fleet_configs(ns: argparse.Namespace, seeds: Sequence[int]) -> list[SyntheticFleetConfig]:
    """One `pipeline.fleet_config` per seed, with the calibration flags the user set; bad values name their flag."""
    from policy.pipeline import fleet_config

    if ns.nodes < 1:
        raise PolicyUsageError(f"--nodes {ns.nodes}: the fleet needs at least 1 node")
    if not ns.days > 0:
        raise PolicyUsageError(f"--days {ns.days:g}: the window must be longer than 0 days")
    if ns.horizon_h is not None and not ns.horizon_h > 0:
        raise PolicyUsageError(f"--horizon-h {ns.horizon_h:g}: must be > 0 hours, e.g. 2")
    overrides = {
        field: getattr(ns, field)
        for field in ("precursor_fraction", "false_alarms_per_node_year", "burst_share")
        if getattr(ns, field) is not None
    }
    try:
        return [fleet_config(seed, ns.nodes, ns.days, **overrides) for seed in seeds]
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = err["loc"][0] if err["loc"] else ""
        flag = _FLEET_FLAGS.get(str(loc), "fleet")
        if flag == "--seed" and ns.action == "train":
            flag = "--seeds"
        raise PolicyUsageError(f"{flag}: {err['msg']}") from None


def _train(ns: argparse.Namespace) -> int:
    from policy.pipeline import train_predictor
    from policy.predictor import FailurePredictor

    seeds = _seeds(ns.seeds)
    if ns.max_iter < 1:
        raise PolicyUsageError(f"--max-iter {ns.max_iter}: needs at least 1 boosting iteration, e.g. 100")
    configs = _fleet_configs(ns, seeds)
    horizon_h = DEFAULT_HORIZON_H if ns.horizon_h is None else ns.horizon_h
    try:
        model, report = train_predictor(configs, horizon_h=horizon_h, predictor=FailurePredictor(max_iter=ns.max_iter))
    except ValueError as exc:  # e.g. no fault at all in the training fleets
        raise PolicyUsageError(f"{exc}; train on more --seeds or a larger --nodes / --days") from None
    try:
        model.save(ns.out)
    except OSError as exc:
        raise PolicyUsageError(f"--out {ns.out}: cannot write ({exc.strerror})") from None
    print(
        f"trained on {len(seeds)} fleet(s) of {ns.nodes} nodes x {ns.days:g} days (seeds {ns.seeds}): "
        f"{report.rows} rows, {report.positives} positive; features {report.features_s:.2f} s, "
        f"fit {report.fit_s:.2f} s"
    )
    print(f"wrote the model to {ns.out}")
    _write_json(
        ns.json,
        {
            **asdict(report),
            "model": str(ns.out),
            "parameters": {
                "nodes": ns.nodes,
                "days": ns.days,
                "horizon_h": horizon_h,
                "max_iter": ns.max_iter,
                "precursor_fraction": configs[0].precursor_fraction,
                "false_alarms_per_node_year": configs[0].false_alarms_per_node_year,
                "burst_share": configs[0].burst_share,
            },
        },
    )
    return 0


def _load_model(path: str) -> FailurePredictor:
    from policy.predictor import IncompatibleModelError, UntrustedModelError, load_policy_model

    if not Path(path).is_file():
        raise PolicyUsageError(f"--model {path}: no such file; write one with `trainmover policy train --out`")
    if Path(path).stat().st_size == 0:
        raise PolicyUsageError(f"--model {path}: empty, not a model file written by `trainmover policy train`")
    try:
        return load_policy_model(path)
    except (UntrustedModelError, IncompatibleModelError) as exc:
        raise PolicyUsageError(f"--model {path}: {exc}") from None
    # skops reports a file that is not one of its archives in several ways (an empty file is a ValueError).
    except (OSError, zipfile.BadZipFile, KeyError, ValueError) as exc:
        raise PolicyUsageError(
            f"--model {path}: not a model file written by `trainmover policy train` ({type(exc).__name__}: {exc})"
        ) from None


def _score_line(name: str, score: ModelScore) -> str:
    brier = "-" if score.brier is None else f"{score.brier:.5f}"
    lead = "-" if score.mean_lead_h is None else f"{score.mean_lead_h:.1f}"
    return (
        f"{name:<10} {score.pr_auc:>7.4f} {score.precision_at_recall:>12.4f} {brier:>8} {lead:>12} "
        f"{score.alarmed_faults:>5d}/{score.test_faults:<5d}"
    )


def _evaluate_trace(ns: argparse.Namespace) -> int:
    from policy.history import CANDIDATES, INNER_ORIGINS, evaluate_trace
    from policy.pipeline import baseline_policies
    from policy.simulator import format_table

    if ns.model is not None:
        raise PolicyUsageError(
            "--model and --trace: a trace has no telemetry for a saved model; leave --model out (a history-only "
            "model is fitted on the trace's training part)"
        )
    only = CANDIDATES if ns.candidates is None else tuple(c.strip() for c in ns.candidates.split(",") if c.strip())
    unknown = sorted(set(only) - set(CANDIDATES))
    if unknown or not only:
        raise PolicyUsageError(f"--candidates {ns.candidates!r}: name one or more of {', '.join(CANDIDATES)}")
    ns.job_nodes = None
    trace = _trace(ns)
    costs = _costs(ns, trace.n_nodes)
    print(_priced_job(costs, trace.n_nodes, ns))
    horizon_h = DEFAULT_HORIZON_H if ns.horizon_h is None else ns.horizon_h
    if not (math.isfinite(horizon_h) and horizon_h > 0):
        raise PolicyUsageError(f"--horizon-h {horizon_h:g}: must be > 0 hours, e.g. 3")
    try:
        result = evaluate_trace(
            trace, costs, baseline_policies(costs.tiers), train_fraction=ns.train_fraction, horizon_h=horizon_h,
            only=only,
        )
    except ValueError as exc:
        raise PolicyUsageError(f"--trace {ns.trace}: {exc}") from None
    print(
        f"fitted on {result.chosen_on}, judged on the rest; the edge check: each candidate fitted before each of "
        f"the rolling origins at {', '.join(f'{o:.0%}' for o in INNER_ORIGINS)} of the training part, judged on the "
        "stretch after it against the static it would fall back to (an edge: never dearer on a stretch, never "
        "dominated, mean saving > spread):"
    )
    for c in result.edge_checks:
        mark = "edge" if c.edge else ("dominated" if c.dominated else "no edge")
        ratio = "-" if math.isnan(c.cost_ratio) else f"{c.cost_ratio:.3f} +- {c.spread:.3f}"
        stretches = " ".join(f"{r:.3f}" for r in c.stretch_ratios)
        print(f"  {c.candidate:<16} mean inner ratio {ratio:>14}  ({stretches})  {mark}")
    for name, what in result.fitted.items():
        print(f"  {name} fitted on the training part: {what}")
    shown = result.judgements.get(result.chosen) or next(iter(result.judgements.values()))
    print("test part ('*': Pareto frontier of the judged hours):")
    print(format_table(shown.test_rows))
    if result.fell_back:
        print(f"fell back to the static {result.static}: no candidate had an edge on the training part")
    print(f"chosen: {result.chosen}: {result.summary}")
    _write_json(ns.json, result.to_dict())
    return 0


def _evaluate(ns: argparse.Namespace) -> int:
    from policy.pipeline import evaluate_fleet, model_horizon
    from policy.simulator import format_table

    if not ns.multiplier > 0:
        raise PolicyUsageError(f"--multiplier {ns.multiplier:g}: must be > 0, e.g. 1.0")
    if not 0.0 < ns.train_fraction < 1.0:
        raise PolicyUsageError(f"--train-fraction {ns.train_fraction:g}: must lie strictly between 0 and 1, e.g. 0.5")
    if ns.trace is not None:
        return _evaluate_trace(ns)
    if ns.candidates is not None:
        raise PolicyUsageError("--candidates applies to --trace: a synthetic fleet is judged with --model")
    if ns.model is None:
        raise PolicyUsageError(
            "--model is required for a synthetic fleet (write one with `trainmover policy train`), or pass --trace"
        )
    if ns.duration_h is not None:
        raise PolicyUsageError("--duration-h applies to --trace only; set a synthetic fleet's length with --days")
    if ns.nodes is None:
        ns.nodes = 256
    (config,) = _fleet_configs(ns, [ns.seed])
    costs = _costs(ns, ns.nodes)
    model = _load_model(ns.model)
    try:
        model_horizon(model, ns.horizon_h)
    except ValueError as exc:
        raise PolicyUsageError(f"--horizon-h {ns.horizon_h:g}: {exc}; leave --horizon-h out") from None
    try:
        with warnings.catch_warnings():
            # A test period without faults makes sklearn warn per metric; the note below says it once.
            warnings.filterwarnings("ignore", message="No positive class found", category=UserWarning)
            result = evaluate_fleet(
                model, config, costs, multiplier=ns.multiplier, horizon_h=ns.horizon_h, train_fraction=ns.train_fraction
            )
    except ValueError as exc:  # too few rows or faults to split, or a model fitted on other features
        raise PolicyUsageError(f"{exc}; evaluate on a larger --nodes / --days or retrain the model") from None
    pred = result.prediction
    print(_priced_job(costs, ns.nodes, ns))
    print(f"prediction on fleet {result.seed} ({result.faults} faults; {pred.n_train} train / {pred.n_test} test rows)")
    print(f"{'scorer':<10} {'pr_auc':>7} {'prec@recall':>12} {'brier':>8} {'mean_lead_h':>12} {'alarmed/faults':>14}")
    for name, score in (("predictor", pred.predictor), ("rule", pred.rule), ("logistic", pred.logistic)):
        print(_score_line(name, score))
    print(f"base rate {pred.base_rate:.5f} (PR-AUC of a coin), its Brier {pred.base_rate_brier:.5f}")
    if pred.predictor.test_faults == 0:
        print("note: the test period holds no fault, so these metrics mean little; use a larger --nodes / --days")
    print()
    v = result.verdict
    print(
        f"judged on hours {result.split_h:.0f}-{result.split_h + result.rows[0].result.wall_h:.0f}; the reference "
        f"static was chosen on {v.chosen_on} ('*': Pareto frontier of the judged hours)"
    )
    print(format_table(result.rows))
    print(f"verdict: {v.summary}")
    print(
        f"{v.learned}: {v.learned_usd_per_useful_h:.2f} USD/useful h at ETTR {v.learned_ettr:.5f} "
        f"vs best static {v.best_static} {v.best_static_usd_per_useful_h:.2f} at ETTR {v.best_static_ettr:.5f}: "
        f"ratio {v.cost_ratio:.3f}; oracle {v.oracle_usd_per_useful_h:.2f}, regret {v.regret_usd_per_useful_h:.2f}"
    )
    _write_json(ns.json, result.to_dict())
    return 0


def policy_command(ns: argparse.Namespace) -> int:
    """Run `trainmover policy ACTION`; 0 on success, 2 with one line on stderr for a user's mistake."""
    handlers = {
        "simulate": _simulate,
        "tune": _tune,
        "generate": _generate,
        "train": _train,
        "evaluate": _evaluate,
    }
    try:
        return handlers[ns.action](ns)
    except PolicyUsageError as exc:
        print(f"trainmover policy {ns.action}: error: {exc}", file=sys.stderr)
        return _EXIT_USAGE


def main(argv: list[str] | None = None) -> int:
    """Stand-alone entry (`python -m policy.cli ...`), the same as `trainmover policy ...`."""
    return part_main("policy", add_policy_parser, policy_command, argv)


if __name__ == "__main__":
    raise SystemExit(main())
