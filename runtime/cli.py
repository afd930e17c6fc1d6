"""The runtime's subcommands: `trainmover run` (the launcher) and `trainmover demo` (the local demo)."""

from __future__ import annotations

import argparse
import sys

from runtime.launcher import ConfigError, LaunchConfig, launch


def add_run_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "run", help="run a training script with N workers and K warm standbys",
        description="Start the coordinator, N workers and K warm standbys on this machine. A lost worker's rank "
                    "goes to a standby; the survivors never restart.",
    )
    p.add_argument("--nproc", type=int, default=2, help="number of workers (logical data-parallel ranks)")
    p.add_argument("--standby", type=int, default=1, help="number of warm standby processes")
    p.add_argument("--backend", choices=["gloo", "nccl"], default="gloo")
    p.add_argument("--events", metavar="FILE", help="write membership and recovery events as JSON lines")
    p.add_argument("--hang-timeout", type=float, default=2.0, metavar="S",
                   help="heartbeat silence after which a worker is declared hung and fenced (default 2 s)")
    p.add_argument("--standby-wait", type=float, default=30.0, metavar="S",
                   help="with no standby ready, how long to wait for one before stopping (default 30 s)")
    p.add_argument("--no-replenish", action="store_true", help="do not start replacement standbys")
    p.add_argument("--wait-for-standbys", action="store_true",
                   help="start training only once every standby is warm")
    p.add_argument("--threads", type=int, default=None, help="torch threads per process (default cores/nproc)")
    p.add_argument("--faults", default="", help="fault-injection plan, e.g. 'kill:rank=1,step=5,phase=exchange'")
    p.add_argument("--no-fork-server", action="store_true",
                   help="start standbys as new interpreters instead of forking them from a pre-imported zygote")
    p.add_argument("--chaos", default="", metavar="SPEC",
                   help="random faults the coordinator injects, e.g. 'seed=1,every_s=1.5,max=100,signals=kill|stop'")
    p.add_argument("--port", type=int, default=0,
                   help="coordinator store port, where an orchestrator steers the job with runtime.control.JobControl "
                        "(default: a free one, named in the job_started event)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address the job's store and Gloo listen on, and only there (default 127.0.0.1)")
    p.add_argument("--secret-file", metavar="FILE",
                   help="the job's secret (mode 600), which an orchestrator needs to steer the job; created with a "
                        "fresh secret if absent. Default: $TRAINMOVER_JOB_SECRET, else a secret no one else knows")
    p.add_argument("--handoff-transport", choices=["gloo", "tls"], default="gloo",
                   help="how the state reaches a new member: over the Gloo/NCCL group (default), or over mutual TLS "
                        "(encrypted; for standbys across a trust boundary)")
    p.add_argument("--tls-cert", metavar="PEM", help="with tls: the job's certificate (default: a fresh one per job)")
    p.add_argument("--tls-key", metavar="PEM", help="with tls: its private key (mode 600)")
    p.add_argument("--tls-ca", metavar="PEM", help="with tls: what peers' certificates must chain to")
    p.add_argument("--quiet", action="store_true", help="log errors only")
    p.add_argument("script", help="training script")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")


def run_command(ns: argparse.Namespace) -> int:
    try:
        cfg = LaunchConfig(
            script=ns.script, args=tuple(ns.script_args), nproc=ns.nproc, standby=ns.standby, backend=ns.backend,
            events_path=ns.events, hang_timeout_s=ns.hang_timeout, standby_wait_s=ns.standby_wait,
            replenish=not ns.no_replenish, num_threads=ns.threads, faults=ns.faults, chaos=ns.chaos, port=ns.port,
            host=ns.host, secret_file=ns.secret_file, handoff_transport=ns.handoff_transport, tls_cert=ns.tls_cert,
            tls_key=ns.tls_key, tls_ca=ns.tls_ca,
            quiet=ns.quiet,
            wait_for_standbys=ns.wait_for_standbys, fork_server=not ns.no_fork_server,
        )
        result = launch(cfg)
    except ConfigError as exc:
        print(f"trainmover run: {exc}", file=sys.stderr)
        return 2
    return result.exit_code


def add_demo_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("demo", help="the local demo: one injected failure, what it cost")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--events", metavar="FILE", help="also write the faulted run's events here")


def demo_command(ns: argparse.Namespace) -> int:
    from runtime.demo import run_demo

    return run_demo(steps=ns.steps, events_path=ns.events)
