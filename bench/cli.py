"""`trainmover bench ...`: the benchmarks' subcommands."""

from __future__ import annotations

import argparse


def add_bench_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("bench", help="benchmarks")
    kinds = p.add_subparsers(dest="kind", required=True, metavar="KIND")
    r = kinds.add_parser("recovery", help="lost time of one killed worker: TrainMover vs checkpoint-restart vs torchft")
    r.add_argument("--quick", action="store_true", help="a 4M-parameter model, under a minute")
    r.add_argument("--json", metavar="FILE", help="write the full report as JSON")
    s = kinds.add_parser("policy", help="learned standby policy vs static spares and the oracle; simulator timings")
    s.add_argument("--quick", action="store_true", help="small fleets, about a minute")
    s.add_argument("--json", metavar="FILE", help="write the full report as JSON")


def bench_command(ns: argparse.Namespace) -> int:
    if ns.kind == "policy":
        from bench.policy import main as policy_main

        return policy_main(quick=ns.quick, json_path=ns.json)
    from bench.recovery import main

    return main(quick=ns.quick, json_path=ns.json)
