"""The runtime's subcommands: `trainmover run` (one machine), `coordinator` and `agent` (across hosts), `demo`.

The options of `run`, `coordinator` and `agent` are the fields of their records (runtime.config.LaunchConfig,
runtime.host.agent.AgentConfig): each option's name, default, type and help come from the field (`add_options`), and
the record is built from the parsed options (`from_namespace`). Only what is not a field is written here.
"""

from __future__ import annotations

import argparse
import signal
import sys
from typing import TYPE_CHECKING

from runtime.config import LaunchConfig, add_options, from_namespace

if TYPE_CHECKING:
    from runtime.host.agent import NoticeWatch


def _add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser], name: str, summary: str,
                description: str, cls: type, groups: tuple[str, ...]) -> argparse.ArgumentParser:
    """Subcommand `name`, with the options of `cls`'s fields flagged for each of `groups`, in that order."""
    p = sub.add_parser(name, help=summary, description=description)
    for group in groups:
        add_options(p, cls, group)
    return p


def add_run_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    _add_parser(
        sub, "run", "run a training script with N workers and K warm standbys",
        "Start the coordinator, N workers and K warm standbys on this machine. A lost worker's rank goes to a "
        "standby; the survivors never restart.",
        LaunchConfig, ("", "local"),
    )


def add_coordinator_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    _add_parser(
        sub, "coordinator", "coordinate a job across hosts, each running `trainmover agent`",
        "Run the coordinator alone: wait for --agents hosts (each runs `trainmover agent`), place N workers and K "
        "standbys in their slots, and move a lost host's ranks to standbys. It never starts a training process "
        "itself. Ports: --port (the store: every process and an orchestrator connect) and --agent-port (the "
        "agents' links).",
        LaunchConfig, ("hosts", ""),
    )


def add_agent_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from runtime.host.agent import AgentConfig

    p = _add_parser(
        sub, "agent", "run this host's agent: start the processes a coordinator assigns to its slots",
        "One per host. Joins the coordinator at --coordinator with --slots slots, starts the workers and standbys "
        "it assigns, reports their exits at once, and kills them all when it loses the coordinator for longer "
        "than its lease (unless the job's store, served apart by `trainmover store`, shows the coordinator gone: "
        "then they train on and it hands them to the coordinator that takes the job over). The job's secret comes "
        "from --secret-file or $TRAINMOVER_JOB_SECRET (never the command line).",
        AgentConfig, ("",),
    )
    p.add_argument("--secret-file", metavar="FILE", help="the job's secret (mode 600)")
    p.add_argument("--notices", choices=["aws", "azure"],
                   help="watch this host's cloud notices (EC2 instance metadata: spot interruption and rebalance; "
                        "Azure Scheduled Events: eviction and maintenance) and have the coordinator move this host's "
                        "ranks to standbys before the cloud acts")
    p.add_argument("--metadata-url", default="http://169.254.169.254", metavar="URL",
                   help="the instance metadata service (default: the clouds' link-local address)")
    p.add_argument("--quiet", action=argparse.BooleanOptionalAction, default=False,
                   help="log errors only (default: off)")


def _notice_watch(kind: str | None, name: str, url: str) -> NoticeWatch | None:
    """The agent's notice watcher for `kind`'s metadata service; cloud/ is imported only when asked for."""
    if kind is None:
        return None
    from runtime.host.agent import NoticeWatch

    if kind == "aws":
        from cloud.aws.notices import ImdsNoticeSource

        return NoticeWatch(ImdsNoticeSource(name, endpoint=url))
    from cloud.azure.notices import ScheduledEventsSource

    return NoticeWatch(ScheduledEventsSource(name, endpoint=url))


def _secret(path: str | None, who: str) -> str:
    """The job's secret from --secret-file, else $TRAINMOVER_JOB_SECRET (never the command line: `ps` shows it);
    ValueError saying where to put it."""
    import os

    from runtime.wire.auth import ENV_SECRET, check_secret, read_secret_file

    if path:
        return read_secret_file(path)
    if os.environ.get(ENV_SECRET):
        return check_secret(os.environ[ENV_SECRET], ENV_SECRET)
    raise ValueError(f"the {who} needs the job's secret: --secret-file FILE or ${ENV_SECRET}")


def agent_command(ns: argparse.Namespace) -> int:
    import dataclasses

    from runtime.host.agent import Agent, AgentConfig, AgentError, configure_agent_logging

    try:
        secret = _secret(ns.secret_file, "agent")
        configure_agent_logging(ns.quiet)
        cfg = from_namespace(AgentConfig, ns, secret=secret)
        cfg = dataclasses.replace(cfg, notices=_notice_watch(ns.notices, cfg.name, ns.metadata_url))
        agent = Agent(cfg)
        try:
            return agent.run()
        finally:
            agent.close()
    except (AgentError, ValueError, OSError) as exc:
        print(f"trainmover agent: {exc}", file=sys.stderr)
        return 2


def add_store_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "store", help="serve a job's store in a process of its own, so that the job outlives its coordinator",
        description="Serve the job's key-value store (behind its TLS gate when --host is not loopback) until the job "
                    "ends. Start the coordinator with --store HOST:PORT; if it dies, the agents keep their processes "
                    "training, and `trainmover coordinator --takeover --store HOST:PORT ...` takes the job over. The "
                    "job's secret comes from --secret-file or $TRAINMOVER_JOB_SECRET.")
    p.add_argument("--host", required=True, help="address to listen on (only there)")
    p.add_argument("--port", type=int, required=True, help="port to listen on")
    p.add_argument("--secret-file", metavar="FILE", help="the job's secret (mode 600)")
    p.add_argument("--idle-exit", type=float, default=600.0, metavar="S",
                   help="exit when no coordinator has renewed its lease here for this long (default %(default)s s)")


def store_command(ns: argparse.Namespace) -> int:
    from runtime.launcher import ConfigError, serve_store

    try:
        code = serve_store(ns.host, ns.port, _secret(ns.secret_file, "store"), ns.idle_exit)
    except (ConfigError, ValueError, OSError) as exc:
        print(f"trainmover store: {exc}", file=sys.stderr)
        return 2
    # Exiting: a SIGTERM now (an orchestrator stopping a store that ends on its own) must not turn a clean exit
    # into a death by signal. Python resets its own handlers to the default as it exits, not an ignored signal.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    return code


def add_steer_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """`trainmover resize` and `trainmover move`: an orchestrator's requests to a running job, sealed with the job's
    secret (runtime.wire.control.JobControl, the same path as the API)."""
    resize = sub.add_parser(
        "resize", help="run a job at N members: fewer frees capacity, more grows back onto standbys",
        description="Ask a running job (trainmover run --port P) to run at WIDTH members, 1 up to its --nproc: the "
                    "highest ranks leave at a step boundary, or ready standbys join at one, with the state handed "
                    "over from memory. A data-parallel job keeps its global batch (--shrink accumulate) or scales its "
                    "learning rate (lr-linear, lr-sqrt). The job's secret comes from --secret-file or "
                    "$TRAINMOVER_JOB_SECRET.")
    resize.add_argument("--width", type=int, required=True, help="members to run with")
    move = sub.add_parser(
        "move", help="move ranks of a running job to standbys, on purpose",
        description="Ask a running job to move RANKS to warm standbys (a host to drain, a spot notice an agent did "
                    "not see). The job's secret comes from --secret-file or $TRAINMOVER_JOB_SECRET.")
    move.add_argument("--ranks", required=True, help="comma-separated ranks, e.g. 1,3")
    for p in (resize, move):
        p.add_argument("--port", type=int, required=True, help="the job's store port (its job_started event's)")
        p.add_argument("--host", default="127.0.0.1", help="where the job's store listens (default %(default)s)")
        p.add_argument("--reason", default="requested", help="why, in the events (default %(default)s)")
        p.add_argument("--secret-file", metavar="FILE", help="the job's secret (mode 600)")
        p.add_argument("--timeout", type=float, default=30.0, metavar="S",
                       help="how long to wait for the job's answer (default %(default)s s)")


def steer_command(ns: argparse.Namespace) -> int:
    """Send the request and print the job's answer; 0 when accepted, 1 when refused, 2 when it could not be sent."""
    from runtime.wire.control import JobControl, JobEnded, JobNotFound

    try:
        ranks = [int(r) for r in ns.ranks.split(",")] if ns.command == "move" else []
        with JobControl(ns.host, ns.port, secret=_secret(ns.secret_file, ns.command)) as job:
            if ns.command == "move":
                outcome = job.wait_move(job.move(ranks, ns.reason), ns.timeout)
            else:
                outcome = job.wait_resize(job.resize(ns.width, ns.reason), ns.timeout)
    except (JobNotFound, JobEnded, TimeoutError, ValueError, OSError) as exc:
        print(f"trainmover {ns.command}: {exc}", file=sys.stderr)
        return 2
    if not outcome.accepted:
        print(f"trainmover {ns.command}: refused: {outcome.reason}", file=sys.stderr)
        return 1
    print(f"trainmover {ns.command}: accepted (request {outcome.seq}); the job's events say when it is done")
    return 0


def run_command(ns: argparse.Namespace) -> int:
    from runtime.launcher import ConfigError, launch

    try:
        cfg = from_namespace(LaunchConfig, ns)
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
