"""Test tiers, assigned mechanically from what each test and fixture was seen to do.

A test's tier follows from the processes it starts, observed through Python's audit hooks (`subprocess.Popen`,
`os.fork`, `os.posix_spawn`) while the test and each fixture set up, run and tear down, never from a hand-kept
list. Each observed process start gives markers:

* `processes`: the test (or a fixture it uses) starts any process;
* `jobs`: one of them is a Python process of this project (a training job, its zygote or agent, a runtime
  command): timing-sensitive, so these run one at a time on one xdist worker (group `jobs`), except the flows'
  (tests/flows/), which run one at a time in group `prefect`;
* `netns`: it makes Linux network namespaces (`ip netns`, `unshare`); in group `jobs` too (the flows': `prefect`);
* `prefect`: it starts a Prefect server or worker; the session's server is shared, so these run on one xdist
  worker (group `prefect`), beside the `jobs` group's;
* `servers`: it binds a socket (`socket.bind`): a fake cloud endpoint, a store, an agent link.

A test with none of these runs in this process only, without a server: the developer tier (`pytest --tier dev`).

`tests/tiers.json` keeps the observations: per test node id and per fixture name. `pytest --record-tiers` runs the
tests as usual and rewrites the file from what it saw (with xdist, each worker writes its part and the controller
merges them). A test missing from the file (a new one) is treated as starting processes until it is recorded;
a test that the file places in the developer tier but that starts a process fails its run (tests/conftest.py),
naming the process or socket, so the file cannot silently go stale.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

TIERS_FILE = Path(__file__).with_name("tiers.json")
MARKERS = {
    "processes": "starts OS processes (seen by the audit hook, or through a fixture that does)",
    "jobs": "starts this project's Python processes (training jobs, agents): timing-sensitive, xdist group `jobs`",
    "netns": "makes Linux network namespaces (root and iproute2); xdist group `jobs`",
    "prefect": "starts a Prefect server or worker; xdist group `prefect`",
    "servers": "binds a socket (a fake cloud endpoint, a store, an agent link)",
}
INCIDENTAL = frozenset({"lscpu", "uname", "file", "fc-list"})
"""Probes a library runs once per process whichever test first needs it (joblib's core count, `platform`'s
processor and architecture), or once per machine (matplotlib's font cache, built with `fc-list` the first time a
plot is drawn on a fresh machine): not the test's."""
PROJECT_DIRS = ("runtime", "flows", "cloud", "policy", "bench", "examples", "tests", "trainmover")


def marks_of_argv(argv: Iterable[object]) -> set[str]:
    """The markers one started process gives its test."""
    words = [os.fsdecode(a) if isinstance(a, bytes) else str(a) for a in argv]
    text = " ".join(words)
    marks = {"processes"}
    if "netns" in words or any(Path(w).name == "unshare" for w in words[:1]):
        marks.add("netns")
    if "prefect" in text:
        marks.add("prefect")
    elif words and Path(words[0]).name.startswith("python") and any(
            w.split(".")[0] in PROJECT_DIRS or any(f"/{d}/" in w for d in PROJECT_DIRS) for w in words[1:]):
        marks.add("jobs")
    return marks


GROUPS = ("jobs", "prefect")
"""The xdist groups (`--dist loadgroup`): each runs its tests one after another on one worker."""


def xdist_group(marks: set[str], nodeid: str = "", untimed: bool = False) -> str | None:
    """The test's group: `prefect` for the Prefect server's tests and for the flows' tests that run a real job (a
    supervisor driving one, as the Prefect end-to-end tests do), `jobs` for every other test that starts this
    project's processes or makes namespaces. The two groups run beside each other, one on each worker: the
    `jobs` group alone is the suite's longest path (23 of its 23 minutes when the flows' jobs were in it too).

    `untimed` (the test's `untimed` marker): a job on one machine whose assertions hold however slowly it runs
    (the final state bit-exact, a refusal, a message), no timeout of its own near its pace: it runs in the
    `prefect` group, to even the two workers out."""
    if "prefect" in marks or (nodeid.startswith("tests/flows/") and marks & {"jobs", "netns"}):
        return "prefect"
    if untimed and "netns" not in marks:
        return "prefect"
    if marks & {"jobs", "netns"}:
        return "jobs"
    return None


@dataclass
class Observer:
    """Attributes the processes started in this process to the test or fixture being run."""

    tests: dict[str, set[str]] = field(default_factory=dict)
    fixtures: dict[str, set[str]] = field(default_factory=dict)
    seen: dict[str, list[str]] = field(default_factory=dict)
    """Per test node id, the command lines it started and the sockets it bound itself (for the check's message)."""
    _stack: list[tuple[str, str]] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def install(self) -> None:
        sys.addaudithook(self._hook)

    def _hook(self, event: str, args: tuple[object, ...]) -> None:
        if event == "subprocess.Popen":
            argv: Iterable[object] = args[1] if isinstance(args[1], (list, tuple)) else [args[0] or args[1]]
        elif event in ("os.posix_spawn", "os.spawn"):
            argv = args[1] if isinstance(args[1], (list, tuple)) else [args[0]]
        elif event == "os.fork":
            argv = [sys.executable, "tests"]  # a fork of this very process
        elif event == "socket.bind":
            argv = ()
        else:
            return
        if argv and Path(str(next(iter(argv)))).name in INCIDENTAL:
            return
        with self._lock:
            if not self._stack:
                return
            kind, name = self._stack[-1]
            marks = marks_of_argv(argv) if argv else {"servers"}
            (self.tests if kind == "test" else self.fixtures).setdefault(name, set()).update(marks)
            if kind == "test":
                what = " ".join(map(str, argv)) if argv else f"a socket bound to {args[1]!r}"
                self.seen.setdefault(name, []).append(what[:200])

    def needs(self, argv: Iterable[object]) -> None:
        """What the running test would have started had a cache not held the result (a clean run's digest, kept
        for the session): its markers as if `argv` had started, so that a tier does not depend on test order."""
        with self._lock:
            if self._stack:
                kind, name = self._stack[-1]
                (self.tests if kind == "test" else self.fixtures).setdefault(name, set()).update(marks_of_argv(argv))

    @contextlib.contextmanager
    def watching(self, kind: str, name: str) -> Iterator[None]:
        """Attribute what starts inside the block to the test or fixture `name`."""
        with self._lock:
            self._stack.append((kind, name))
            if kind == "test":
                self.tests.setdefault(name, set())
        try:
            yield
        finally:
            with self._lock:
                self._stack.pop()


@dataclass
class Tiers:
    """The recorded observations (`tests/tiers.json`)."""

    tests: dict[str, set[str]]
    fixtures: dict[str, set[str]]

    @classmethod
    def load(cls, path: Path = TIERS_FILE) -> Tiers:
        if not path.exists():
            return cls({}, {})
        raw = json.loads(path.read_text())
        if raw.get("version") != 1:
            raise SystemExit(f"{path}: unknown version {raw.get('version')!r}; rerun with `pytest --record-tiers`")
        return cls({k: set(v) for k, v in raw["tests"].items()}, {k: set(v) for k, v in raw["fixtures"].items()})

    def marks(self, nodeid: str, fixturenames: Iterable[str]) -> set[str] | None:
        """The test's markers; None for a test never recorded."""
        own = self.tests.get(nodeid)
        if own is None:
            return None
        out = set(own)
        for name in fixturenames:
            out |= self.fixtures.get(name, set())
        return out

    def files_with_dev_tests(self) -> tuple[set[str], set[str]]:
        """(files recorded, files with at least one recorded developer-tier test), as node-id paths."""
        recorded, dev = set(), set()
        for nodeid, marks in self.tests.items():
            path = nodeid.split("::", 1)[0]
            recorded.add(path)
            if not marks:
                dev.add(path)
        return recorded, dev

    def merge(self, observer: Observer) -> None:
        for nodeid, marks in observer.tests.items():
            self.tests[nodeid] = set(marks)
        for name, marks in observer.fixtures.items():
            self.fixtures.setdefault(name, set()).update(marks)

    def dump(self, path: Path = TIERS_FILE) -> None:
        data = {"version": 1, "about": "written by `pytest --record-tiers` (tests/tiers.py); do not edit by hand",
                "fixtures": {k: sorted(v) for k, v in sorted(self.fixtures.items()) if v},
                "tests": {k: sorted(v) for k, v in sorted(self.tests.items())}}
        path.write_text(json.dumps(data, indent=0, sort_keys=False) + "\n")


def observed_part(path: Path, observer: Observer) -> None:
    """One xdist worker's observations, for the controller to merge."""
    path.write_text(json.dumps({"tests": {k: sorted(v) for k, v in observer.tests.items()},
                                "fixtures": {k: sorted(v) for k, v in observer.fixtures.items()}}))


def read_part(path: Path) -> Observer:
    raw = json.loads(path.read_text())
    return Observer({k: set(v) for k, v in raw["tests"].items()}, {k: set(v) for k, v in raw["fixtures"].items()})


OBSERVER = Observer()
"""This session's observer (installed by tests/conftest.py); helpers that cache a process's result report through
`OBSERVER.needs` what a cache hit spared."""
