"""`trainmover policy ...`: simulate standby policies on a fault trace, tune them, and generate synthetic traces.

The dispatcher calls `add_policy_parser(subparsers)` and then `policy_command(namespace)`. Errors a user can
cause (a missing or malformed trace, a negative price) print one line on stderr and return exit code 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from policy.costs import StandbyCosts
from policy.traces import FaultRecord, FaultTrace

_EXIT_USAGE = 2
_COST_FLAGS = {
    "job_price_usd_per_h": "--job-price-usd-per-h",
    "lead_time_h": "--lead-time-h",
    "restart_downtime_s": "--restart-downtime-s",
    "budget_usd_per_h": "--budget-usd-per-h",
    "hysteresis": "--hysteresis",
    "min_hold_s": "--min-hold-s",
}


class PolicyUsageError(Exception):
    """A mistake in the command line or its inputs; the message says what to fix."""


def _add_trace_and_costs(p: argparse.ArgumentParser) -> None:
    defaults = StandbyCosts()
    p.add_argument("--trace", required=True, help="'infinitehbd' (the shipped trace) or a CSV file (see load_csv)")
    p.add_argument(
        "--nodes", type=int, help="fleet size incl. nodes that never failed (required for a CSV; 400 for infinitehbd)"
    )
    p.add_argument("--job-nodes", type=int, help="nodes the job runs on (default: the whole fleet)")
    p.add_argument("--json", metavar="FILE", help="also write the result as JSON")
    p.add_argument(
        "--job-price-usd-per-h",
        type=float,
        default=defaults.job_price_usd_per_h,
        help="whole-job price per hour (default: %(default)s)",
    )
    p.add_argument(
        "--lead-time-h",
        type=float,
        default=defaults.lead_time_h,
        help="replenishment lead time in hours (default: %(default)s)",
    )
    p.add_argument(
        "--restart-downtime-s",
        type=float,
        default=defaults.restart_downtime_s,
        help="downtime of an uncovered failure in seconds (default: %(default)s)",
    )
    p.add_argument("--budget-usd-per-h", type=float, default=None, help="cap on the standbys' hourly cost")
    p.add_argument("--hysteresis", type=float, default=defaults.hysteresis, help="(default: %(default)s)")
    p.add_argument("--min-hold-s", type=float, default=defaults.min_hold_s, help="(default: %(default)s)")


def add_policy_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("policy", help="standby policies: simulate, tune, generate traces")
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
    g.add_argument("--out", required=True, metavar="FILE.csv", help="where to write the CSV")


def _costs(ns: argparse.Namespace) -> StandbyCosts:
    try:
        return StandbyCosts(**{field: getattr(ns, field) for field in _COST_FLAGS})
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = err["loc"][0] if err["loc"] else ""
        flag = _COST_FLAGS.get(str(loc), "prices")
        raise PolicyUsageError(f"{flag}: {err['msg']}") from None


def _trace(ns: argparse.Namespace) -> Any:
    from policy.traces import INFINITEHBD_N_NODES, TraceFormatError, load_csv, load_infinitehbd

    if ns.nodes is not None and ns.nodes < 1:
        raise PolicyUsageError(f"--nodes {ns.nodes}: the fleet needs at least 1 node")
    try:
        if ns.trace == "infinitehbd":
            trace = load_infinitehbd(n_nodes=ns.nodes or INFINITEHBD_N_NODES)
        else:
            path = Path(ns.trace)
            if not path.is_file():
                raise PolicyUsageError(f"--trace {ns.trace}: no such file; pass 'infinitehbd' or a CSV trace")
            if ns.nodes is None:
                raise PolicyUsageError(
                    "--nodes is required with a CSV trace: the fleet size incl. nodes that never failed"
                )
            trace = load_csv(path, n_nodes=ns.nodes)
    except (TraceFormatError, ValueError, OSError) as exc:
        if isinstance(exc, PolicyUsageError):
            raise
        raise PolicyUsageError(f"--trace {ns.trace}: {exc}") from None
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
    from policy.simulator import compare_policies, format_table

    costs, trace = _costs(ns), _trace(ns)
    rows = compare_policies(trace, costs, job_nodes=ns.job_nodes)
    print(format_table(rows))
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
            }
            for r in rows
        ],
    )
    return 0


def _tune(ns: argparse.Namespace) -> int:
    from policy.tuning import NoSettingMeetsFloor, frontier_table, pareto_frontier, plot_frontier, recommend, sweep

    if ns.min_ettr is not None and not 0.0 <= ns.min_ettr <= 1.0:
        raise PolicyUsageError(f"--min-ettr {ns.min_ettr}: must lie in [0, 1], e.g. 0.995")
    costs, trace = _costs(ns), _trace(ns)
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
    from policy.synthetic import SyntheticFleetConfig, generate_fleet
    from policy.traces import write_csv

    try:
        config = SyntheticFleetConfig(n_nodes=ns.nodes, days=ns.days, seed=ns.seed)
    except ValidationError as exc:
        err = exc.errors()[0]
        flag = {"n_nodes": "--nodes", "days": "--days", "seed": "--seed"}.get(str(err["loc"][0]), "config")
        raise PolicyUsageError(f"{flag}: {err['msg']}") from None
    trace, merged = _merge_overlaps(generate_fleet(config).trace)
    try:
        write_csv(trace, ns.out)
    except OSError as exc:
        raise PolicyUsageError(f"--out {ns.out}: cannot write ({exc.strerror})") from None
    print(
        f"wrote {len(trace.records)} faults of {config.n_nodes} nodes over {config.days:g} days to {ns.out}"
        f" ({merged} faults that struck a node already down were merged into the earlier one)"
    )
    return 0


def _merge_overlaps(trace: FaultTrace) -> tuple[FaultTrace, int]:
    """Merge each fault that starts while its node is still down into the earlier one.

    The synthetic generator draws fault starts independently of repairs, so a node can fail again "while down";
    `load_csv` rejects such overlaps, and the simulator never counts them as new job failures anyway.
    """
    last: dict[str, int] = {}
    kept: list[FaultRecord] = []
    for r in trace.records:  # sorted by start
        i = last.get(r.node_id)
        prev = None if i is None else kept[i]
        if i is not None and prev is not None and (prev.end_h is None or r.start_h < prev.end_h):
            end = None if prev.end_h is None or r.end_h is None else max(prev.end_h, r.end_h)
            kept[i] = FaultRecord(prev.node_id, prev.start_h, end, prev.cause)
            continue
        last[r.node_id] = len(kept)
        kept.append(r)
    return FaultTrace(tuple(kept), trace.n_nodes, trace.duration_h), len(trace.records) - len(kept)


def policy_command(ns: argparse.Namespace) -> int:
    """Run `trainmover policy ACTION`; 0 on success, 2 with one line on stderr for a user's mistake."""
    handlers = {"simulate": _simulate, "tune": _tune, "generate": _generate}
    try:
        return handlers[ns.action](ns)
    except PolicyUsageError as exc:
        print(f"trainmover policy {ns.action}: error: {exc}", file=sys.stderr)
        return _EXIT_USAGE


def main(argv: list[str] | None = None) -> int:
    """Stand-alone entry (`python -m policy.cli ...`), the same as `trainmover policy ...`."""
    parser = argparse.ArgumentParser(prog="trainmover")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_policy_parser(sub)
    return policy_command(parser.parse_args(["policy", *(sys.argv[1:] if argv is None else argv)]))


if __name__ == "__main__":
    raise SystemExit(main())
