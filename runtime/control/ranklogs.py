"""Each rank's output in one file that follows the rank across failovers (`--rank-logs DIR`).

Without it, a process's stdout and stderr go where its agent's go, so a rank's output moves between hosts' agent
logs whenever a standby takes the rank. With it, every agent forwards its processes' output over its link
(`Output` frames, runtime.wire.protocol) and the coordinator's pool writes, in `DIR` on the coordinator's machine:

- `rank-<r>.log`: whatever the processes that held rank r wrote while they held it, in order, each stretch headed
  by the process and its host (`--- s0 on host h2 ---`), and a line at every generation that gave the rank to a new
  process (`[trainmover] generation 1: rank 3 is s0 from here on (was w3)`). A process that lost its rank keeps
  writing to that rank's file until it is gone (its last words are usually why).
- `standby-<name>.log`: a standby's output before it is promoted (its warm-up); after, it writes to its rank's file.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import IO


class RankLogs:
    """The coordinator's side of the rank logs; thread-safe (the pool's link thread writes, the coordinator's loop
    announces generations)."""

    def __init__(self, directory: str | Path) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self._rank_of: dict[str, int] = {}
        """Each process's rank: the one it holds, or the last one it held."""
        self._holder: dict[int, str] = {}
        self._last_writer: dict[Path, str] = {}
        self._files: dict[Path, IO[str]] = {}
        self._lock = threading.Lock()

    def path(self, proc: str) -> Path:
        rank = self._rank_of.get(proc)
        return self.dir / (f"rank-{rank}.log" if rank is not None else f"standby-{proc}.log")

    def _file(self, path: Path) -> IO[str]:
        f = self._files.get(path)
        if f is None:
            f = self._files[path] = open(path, "a", encoding="utf-8")  # noqa: SIM115 - kept open, closed in close()
        return f

    def generation(self, gen: int, members: list[str]) -> None:
        """Generation `gen` was published: rank r is `members[r]` from now on."""
        with self._lock:
            for rank, proc in enumerate(members):
                before = self._holder.get(rank)
                if before == proc:
                    continue
                self._holder[rank] = proc
                self._rank_of[proc] = rank
                path = self.dir / f"rank-{rank}.log"
                was = f" (was {before})" if before is not None else ""
                f = self._file(path)
                f.write(f"[trainmover] generation {gen}: rank {rank} is {proc} from here on{was}\n")
                f.flush()
                self._last_writer.pop(path, None)

    def write(self, proc: str, host: str, text: str) -> None:
        """What process `proc` on `host` wrote."""
        with self._lock:
            path = self.path(proc)
            f = self._file(path)
            if self._last_writer.get(path) != proc:
                f.write(f"--- {proc} on host {host} ---\n")
                self._last_writer[path] = proc
            f.write(text)
            f.flush()

    def close(self) -> None:
        with self._lock:
            for f in self._files.values():
                f.close()
            self._files.clear()
