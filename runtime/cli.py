"""The runtime's subcommands: `trainmover run` (one machine), `coordinator` and `agent` (across hosts), `demo`."""

from __future__ import annotations

import argparse
import sys


def add_run_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "run", help="run a training script with N workers and K warm standbys",
        description="Start the coordinator, N workers and K warm standbys on this machine. A lost worker's rank "
                    "goes to a standby; the survivors never restart.",
    )
    _add_job_options(p)


def add_coordinator_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "coordinator", help="coordinate a job across hosts, each running `trainmover agent`",
        description="Run the coordinator alone: wait for --agents hosts (each runs `trainmover agent`), place N "
                    "workers and K standbys in their slots, and move a lost host's ranks to standbys. It never "
                    "starts a training process itself. Ports: --port (the store: every process and an "
                    "orchestrator connect) and --agent-port (the agents' links).",
    )
    p.add_argument("--agents", type=int, required=True, metavar="N", help="hosts to wait for before starting")
    p.add_argument("--agent-port", type=int, default=0,
                   help="port the agents connect to (default: a free one, named in the job_started event)")
    p.add_argument("--host-timeout", type=float, default=3.0, metavar="S",
                   help="an agent silent this long loses its host and every process on it (default 3 s)")
    p.add_argument("--agents-wait", type=float, default=120.0, metavar="S",
                   help="how long to wait for the agents to join (default 120 s)")
    p.add_argument("--job-id", default=None, help="the job's id, which agents started with --job-id must name "
                                                  "(default: a fresh random one)")
    _add_job_options(p)


def add_agent_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "agent", help="run this host's agent: start the processes a coordinator assigns to its slots",
        description="One per host. Joins the coordinator at --coordinator with --slots slots, starts the workers "
                    "and standbys it assigns, reports their exits at once, and kills them all when it loses the "
                    "coordinator for longer than its lease. The job's secret comes from --secret-file or "
                    "$TRAINMOVER_JOB_SECRET (never the command line).",
    )
    p.add_argument("--coordinator", required=True, metavar="HOST:PORT", help="the coordinator's agent port")
    p.add_argument("--slots", type=int, default=1, help="processes this host runs (one per GPU; default 1)")
    p.add_argument("--secret-file", metavar="FILE", help="the job's secret (mode 600)")
    p.add_argument("--name", help="this host's name in the job's events (default: the hostname)")
    p.add_argument("--address", help="address this host's processes listen on (default: the one facing the "
                                     "coordinator)")
    p.add_argument("--job-id", default="", help="join only this job")
    p.add_argument("--connect-timeout", type=float, default=60.0, metavar="S",
                   help="how long to keep trying to reach the coordinator (default 60 s)")
    p.add_argument("--no-rejoin", action="store_true", help="exit after being fenced instead of rejoining as a "
                                                            "new host")
    p.add_argument("--fork-server", action="store_true",
                   help="fork standbys from a process that imported torch once (Gloo; a standby starts in "
                        "milliseconds instead of seconds)")
    p.add_argument("--notices", choices=["aws", "azure"],
                   help="watch this host's cloud notices (EC2 instance metadata: spot interruption and rebalance; "
                        "Azure Scheduled Events: eviction and maintenance) and have the coordinator move this host's "
                        "ranks to standbys before the cloud acts")
    p.add_argument("--metadata-url", default="http://169.254.169.254", metavar="URL",
                   help="the instance metadata service (default: the clouds' link-local address)")
    p.add_argument("--quiet", action="store_true", help="log errors only")


def _notice_watch(kind: str | None, name: str, url: str) -> object:
    """The agent's notice watcher for `kind`'s metadata service; cloud/ is imported only when asked for."""
    if kind is None:
        return None
    from runtime.agent import NoticeWatch

    if kind == "aws":
        from cloud.aws_notices import ImdsNoticeSource

        return NoticeWatch(ImdsNoticeSource(name, endpoint=url))
    from cloud.azure_notices import ScheduledEventsSource

    return NoticeWatch(ScheduledEventsSource(name, endpoint=url))


def agent_command(ns: argparse.Namespace) -> int:
    import os
    import socket

    from runtime.agent import Agent, AgentConfig, AgentError, configure_agent_logging
    from runtime.auth import ENV_SECRET, check_secret, read_secret_file

    try:
        if ns.secret_file:
            secret = read_secret_file(ns.secret_file)
        elif os.environ.get(ENV_SECRET):
            secret = check_secret(os.environ[ENV_SECRET], ENV_SECRET)
        else:
            raise AgentError(f"the agent needs the job's secret: --secret-file FILE or ${ENV_SECRET}")
        configure_agent_logging(ns.quiet)
        agent = Agent(AgentConfig(
            coordinator=ns.coordinator, slots=ns.slots, secret=secret, name=ns.name or socket.gethostname(),
            address=ns.address, job_id=ns.job_id, connect_timeout_s=ns.connect_timeout, rejoin=not ns.no_rejoin,
            fork_server=ns.fork_server,
            notices=_notice_watch(ns.notices, ns.name or socket.gethostname(), ns.metadata_url),  # type: ignore[arg-type]
        ))
        try:
            return agent.run()
        finally:
            agent.close()
    except (AgentError, ValueError, OSError) as exc:
        print(f"trainmover agent: {exc}", file=sys.stderr)
        return 2


def _add_job_options(p: argparse.ArgumentParser) -> None:
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
    from runtime.launcher import ConfigError, LaunchConfig, launch

    try:
        cfg = LaunchConfig(
            script=ns.script, args=tuple(ns.script_args), nproc=ns.nproc, standby=ns.standby, backend=ns.backend,
            events_path=ns.events, hang_timeout_s=ns.hang_timeout, standby_wait_s=ns.standby_wait,
            replenish=not ns.no_replenish, num_threads=ns.threads, faults=ns.faults, chaos=ns.chaos, port=ns.port,
            host=ns.host, secret_file=ns.secret_file, handoff_transport=ns.handoff_transport, tls_cert=ns.tls_cert,
            tls_key=ns.tls_key, tls_ca=ns.tls_ca,
            quiet=ns.quiet,
            wait_for_standbys=ns.wait_for_standbys, fork_server=not ns.no_fork_server,
            **({"agents": ns.agents, "agent_port": ns.agent_port, "host_timeout_s": ns.host_timeout,
                "agents_wait_s": ns.agents_wait} if getattr(ns, "agents", None) else {}),
            **({"job_id": ns.job_id} if getattr(ns, "job_id", None) else {}),
        )
        result = launch(cfg)
    except ConfigError as exc:
        print(f"trainmover {ns.command}: {exc}", file=sys.stderr)
        return 2
    return result.exit_code


def add_demo_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("demo", help="the local demo: one injected failure, what it cost")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--events", metavar="FILE", help="also write the faulted run's events here")


def demo_command(ns: argparse.Namespace) -> int:
    from runtime.demo import run_demo

    return run_demo(steps=ns.steps, events_path=ns.events)
