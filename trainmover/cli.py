"""Dispatch `trainmover SUBCOMMAND` to the part that owns it, importing nothing else.

`trainmover run` in a training image must load neither Prefect nor scikit-learn nor a cloud SDK. `part_main` is a
part's stand-alone entry (`python -m cloud.cli ...`), the same as its `trainmover` subcommand.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="trainmover", description="Keep long PyTorch training runs alive.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    command = argv[0] if argv else ""
    if command == "demo" and "--runtime" not in argv:
        return _flow_demo(parser, sub, argv)
    if command in ("run", "demo", "coordinator", "agent", "store", "resize", "move"):
        from runtime.cli import (
            add_agent_parser,
            add_coordinator_parser,
            add_demo_parser,
            add_run_parser,
            add_steer_parsers,
            add_store_parser,
            agent_command,
            demo_command,
            run_command,
            steer_command,
            store_command,
        )

        add_run_parser(sub)
        add_coordinator_parser(sub)
        add_agent_parser(sub)
        add_store_parser(sub)
        add_demo_parser(sub)
        add_steer_parsers(sub)
        ns = parser.parse_args([a for a in argv if a != "--runtime"])
        if ns.command == "agent":
            return agent_command(ns)
        if ns.command == "store":
            return store_command(ns)
        if ns.command in ("resize", "move"):
            return steer_command(ns)
        return run_command(ns) if ns.command in ("run", "coordinator") else demo_command(ns)
    if command == "policy":
        from policy.cli import add_policy_parser, policy_command

        add_policy_parser(sub)
        return policy_command(parser.parse_args(argv))
    if command == "cloud":
        from cloud.cli import add_cloud_parser, cloud_command

        add_cloud_parser(sub)
        return cloud_command(parser.parse_args(argv))
    if command == "bench":
        from bench.cli import add_bench_parser, bench_command

        add_bench_parser(sub)
        return bench_command(parser.parse_args(argv))
    sub.add_parser("run", help="run a training script with N workers and K warm standbys")
    sub.add_parser("coordinator", help="coordinate a job across hosts, each running `trainmover agent`")
    sub.add_parser("agent", help="this host's agent: start the processes a coordinator assigns to its slots")
    sub.add_parser("store", help="serve a job's store in a process of its own (the job outlives its coordinator)")
    sub.add_parser("resize", help="run a job at N members: fewer frees capacity, more grows back onto standbys")
    sub.add_parser("move", help="move ranks of a running job to standbys, on purpose")
    sub.add_parser("demo", help="the main job on this machine: a resilient training flow with two failures")
    sub.add_parser("bench", help="benchmarks (recovery)")
    sub.add_parser("policy", help="failure traces, standby policy simulation and tuning (needs the policy extra)")
    sub.add_parser("cloud", help="cloud providers: check permissions, list or release a job's instances")
    parser.parse_args(argv or ["--help"])
    return 2


def part_main(
    command: str,
    add_parser: Callable[[argparse._SubParsersAction[argparse.ArgumentParser]], None],
    run: Callable[[argparse.Namespace], int],
    argv: list[str] | None = None,
) -> int:
    """A part's stand-alone entry (`python -m cloud.cli ...`): parse `trainmover COMMAND ...` with that part's parser
    alone (`add_parser`) and `run` it."""
    parser = argparse.ArgumentParser(prog="trainmover")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_parser(sub)
    return run(parser.parse_args([command, *(sys.argv[1:] if argv is None else argv)]))


def _flow_demo(
    parser: argparse.ArgumentParser, sub: argparse._SubParsersAction[argparse.ArgumentParser], argv: list[str]
) -> int:
    p = sub.add_parser("demo", help="the main job on this machine: a resilient training flow with two failures")
    p.add_argument("--steps", type=int, default=1500, help="training steps (default: %(default)s)")
    p.add_argument("--runtime", action="store_true", help="the runtime alone, without Prefect (one failure)")
    ns = parser.parse_args(argv)
    try:
        import prefect  # noqa: F401
    except ImportError:
        print(
            "trainmover demo: Prefect is not installed. Install the flows extra (pip install -e '.[flows]'), "
            "or run the runtime alone with `trainmover demo --runtime`.",
            file=sys.stderr,
        )
        return 2
    from flows.demo import run_demo

    return run_demo(steps=ns.steps)


if __name__ == "__main__":
    raise SystemExit(main())
