"""The shell every peer script shares: its command line (``--quick``, and the hidden ``--worker`` its launched
workers run under) and the first and last lines of a worker."""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
import torch.distributed as dist

from bench.peers.common import fast_exit, register_worker_pid


def start_worker() -> None:
    """A worker's first lines: register its pid (`register_worker_pid`) and train on one thread."""
    register_worker_pid()
    torch.set_num_threads(1)


def end_worker() -> None:
    """A torch.distributed worker's last lines, once its outputs are written: leave the group, then `fast_exit`."""
    dist.destroy_process_group()
    fast_exit()


def peer_parser(doc: str, quick_help: str) -> argparse.ArgumentParser:
    """A peer script's parser: the first line of its docstring, the hidden ``--worker`` its launched workers run
    under, and ``--quick`` (explained by `quick_help`); the script adds its own options."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true", help=quick_help)
    return parser


def parse_peer_args(
    parser: argparse.ArgumentParser, argv: list[str] | None, worker: Callable[[], None]
) -> argparse.Namespace | None:
    """Parse a peer script's arguments; under ``--worker`` run `worker` instead and give None."""
    args = parser.parse_args(argv)
    if args.worker:
        worker()
        return None
    return args
