"""`trainmover bench ...`: the benchmarks' subcommands (each benchmark module is imported only when it runs)."""

from __future__ import annotations

import argparse


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def add_bench_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("bench", help="benchmarks")
    kinds = p.add_subparsers(dest="kind", required=True, metavar="KIND")
    r = kinds.add_parser("recovery", help="lost time of killed workers: TrainMover vs checkpoint-restart vs torchft")
    r.add_argument("--quick", action="store_true",
                   help="a 4M-parameter model: about 5 minutes with 5 kills (full size: about 20)")
    r.add_argument("--kills", type=_positive, default=5, help="kills per system (default: %(default)s)")
    r.add_argument("--json", metavar="FILE", help="write the full report as JSON")
    r.add_argument("--sections", default="data-parallel,sharded", metavar="data-parallel,sharded",
                   help="comma-separated: data-parallel (the systems side by side, host loss), sharded (lost time per "
                        "mesh shape, buddy copies' cost, reconfiguration by world size), reconfiguration (that last "
                        "part alone: delta against the full rebuild), coordinator-loss (the coordinator SIGKILLed, "
                        "alone; data-parallel runs it too), backups (persistent backups' cost by period, and a "
                        "restore after every copy is lost), elastic (a shrink when no standby is left and the grow "
                        "back, against a takeover and torchft), overlap (the handoff beside the replayed step, against "
                        "the handoff before it), hot (a hot standby's takeover against a warm one's, and the cost of "
                        "mirroring) (default: %(default)s)")
    c = kinds.add_parser("chaos", help="a soak: a worker SIGKILLed every ~1.5 s, many times, in one TrainMover job")
    c.add_argument("--interruptions", type=_positive, default=100,
                   help="signals the chaos monkey sends (default: %(default)s, about 15 minutes)")
    c.add_argument("--signals", default="kill", metavar="kill|stop",
                   help="|-separated: kill (SIGKILL, a crash), stop (SIGSTOP, a hang) (default: %(default)s)")
    c.add_argument("--targets", default="worker", metavar="worker|standby",
                   help="|-separated: worker (members), standby (unpromoted standbys) (default: %(default)s)")
    c.add_argument("--every", type=float, default=1.5, metavar="SECONDS",
                   help="mean gap between injections, exponential (default: %(default)s)")
    c.add_argument("--seed", type=int, default=1, help="the chaos monkey's seed (default: %(default)s)")
    c.add_argument("--json", metavar="FILE", help="write the full report as JSON")
    sec = kinds.add_parser("security", help="what authentication costs: MACs, TLS and sealed records vs raw")
    sec.add_argument("--quick", action="store_true", help="a 48 MB state, 3 repetitions (full: 200 MB, 5)")
    sec.add_argument("--json", metavar="FILE", help="write the full report as JSON")
    sc = kinds.add_parser("scale", help="the coordinator against simulated hosts: host loss to new generation, CPU")
    sc.add_argument("--hosts", default="64,256,1024,4096", help="comma-separated host counts (default: %(default)s)")
    sc.add_argument("--slots", type=_positive, default=1, help="processes per host (default: %(default)s)")
    sc.add_argument("--trials", type=_positive, default=10, help="hosts killed per size (default: %(default)s)")
    sc.add_argument("--quick", action="store_true", help="64 and 256 hosts, 3 trials")
    sc.add_argument("--json", metavar="FILE", help="write the full report as JSON")
    e = kinds.add_parser("exit-path", help="one machine: a death reaching the coordinator, own pidfd vs agent")
    e.add_argument("--trials", type=_positive, default=40, help="kills per path and load (default: %(default)s)")
    e.add_argument("--loads", default="0,2", help="busy processes beside it, comma-separated (default: %(default)s)")
    e.add_argument("--json", metavar="FILE", help="write the full report as JSON")
    k = kinds.add_parser("connect-kill", help="a worker killed as its generation is published: the survivor's rebuild")
    k.add_argument("--trials", type=_positive, default=6, help="jobs, one kill each (default: %(default)s)")
    k.add_argument("--load", type=int, default=2, help="busy processes beside the job (default: %(default)s)")
    k.add_argument("--json", metavar="FILE", help="write the full report as JSON")
    s = kinds.add_parser("policy", help="learned standby policy vs static spares and the oracle; simulator timings")
    s.add_argument("--quick", action="store_true", help="small fleets, about a minute")
    s.add_argument("--json", metavar="FILE", help="write the full report as JSON")


def bench_command(ns: argparse.Namespace) -> int:
    if ns.kind == "scale":
        from bench.scale import main as scale_main

        try:
            sizes = [int(x) for x in ns.hosts.split(",")]
        except ValueError:
            print(f"trainmover bench scale: --hosts takes comma-separated counts, e.g. 64,256, got {ns.hosts!r}")
            return 2
        if ns.quick:
            sizes, ns.trials = [n for n in sizes if n <= 256] or [64], 3
        return scale_main(sizes, slots=ns.slots, trials=ns.trials, json_path=ns.json)
    if ns.kind == "exit-path":
        from bench.exitpath import main as exit_main

        try:
            loads = [int(x) for x in ns.loads.split(",")]
        except ValueError:
            loads = [-1]
        if any(n < 0 for n in loads):
            print(f"trainmover bench exit-path: --loads takes comma-separated counts >= 0, e.g. 0,2, got {ns.loads!r}")
            return 2
        return exit_main(ns.trials, loads, ns.json)
    if ns.kind == "connect-kill":
        if ns.load < 0:
            print(f"trainmover bench connect-kill: --load takes a count >= 0, got {ns.load}")
            return 2
        from bench.connectkill import main as connect_kill_main

        return connect_kill_main(ns.trials, ns.load, ns.json)
    if ns.kind == "policy":
        from bench.policy import main as policy_main

        return policy_main(quick=ns.quick, json_path=ns.json)
    if ns.kind == "security":
        from bench.security import main as security_main

        return security_main(quick=ns.quick, json_path=ns.json)
    if ns.kind == "chaos":
        if not ns.every > 0:
            print(f"trainmover bench chaos: --every must be a positive number of seconds, got {ns.every}")
            return 2
        signals, targets = ns.signals.split("|"), ns.targets.split("|")
        if not signals or any(x not in ("kill", "stop") for x in signals):
            print(f"trainmover bench chaos: --signals takes kill, stop or kill|stop, got {ns.signals!r}")
            return 2
        if not targets or any(x not in ("worker", "standby") for x in targets):
            print(f"trainmover bench chaos: --targets takes worker, standby or worker|standby, got {ns.targets!r}")
            return 2
        from bench.chaos import main as chaos_main

        return chaos_main(ns.interruptions, ns.json, every_s=ns.every, seed=ns.seed, signals=signals,
                          targets=targets)
    sections = [x for x in ns.sections.split(",") if x]
    if not sections or any(x not in ("data-parallel", "sharded", "reconfiguration", "coordinator-loss", "backups",
                                     "elastic", "overlap", "hot") for x in sections):
        print("trainmover bench recovery: --sections takes data-parallel, sharded, reconfiguration, coordinator-loss, "
              "backups, elastic, overlap, hot, comma-separated; "
              f"got {ns.sections!r}")
        return 2
    from bench.recovery import main

    return main(quick=ns.quick, json_path=ns.json, kills=ns.kills, sections=sections)
