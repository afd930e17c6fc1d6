"""Tiers of the suite (tests/tiers.py): markers from observed process starts, the developer tier, xdist groups.

* `pytest --tier dev`: only the tests that run in this process (about a minute); files with none are not even
  imported, so a policy change does not pay for importing Prefect.
* `pytest` (every test) with `-n 2`: xdist groups keep the timing-sensitive jobs on one worker and the Prefect
  tests on another, beside the in-process and fake-server tests.
* `pytest --record-tiers`: rewrite tests/tiers.json from what this run's tests were seen to start.
"""

from __future__ import annotations

from collections.abc import Generator
from pathlib import Path

import pytest

# urllib3's first import probes IPv6 by binding a socket to ::1: done here, before any test, not inside whichever
# test imports it first (a developer-tier test would then fail its tier check, depending on the order).
import urllib3  # noqa: F401
from threadpoolctl import threadpool_limits

from tests.diagnostics import take_job_events
from tests.tiers import GROUPS, MARKERS, OBSERVER, TIERS_FILE, Tiers, observed_part, read_part, xdist_group

ROOT = Path(__file__).resolve().parent.parent
_observer = OBSERVER
_tiers = Tiers({}, {})


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("tiers", "test tiers (tests/tiers.py)")
    group.addoption("--tier", choices=("dev", "all"), default="all",
                    help="dev: only the tests that start no process and bind no socket (about a minute); "
                         "all: every test (default)")
    group.addoption("--record-tiers", action="store_true",
                    help="rewrite tests/tiers.json from the processes this run's tests and fixtures start")


def pytest_configure(config: pytest.Config) -> None:
    global _tiers
    for name, text in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {text}")
    _tiers = Tiers.load()
    _observer.install()
    config.pluginmanager.register(_FixtureWatch(), "trainmover-tiers-fixtures")
    config.pluginmanager.register(_GroupCheck(), "trainmover-tiers-group-check")


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    if config.getoption("--tier") != "dev" or collection_path.suffix != ".py" or \
            not collection_path.name.startswith("test_"):
        return None
    recorded, dev = _tiers.files_with_dev_tests()
    rel = collection_path.resolve().relative_to(ROOT).as_posix()
    return True if rel in recorded and rel not in dev else None


def _test_id(item: pytest.Item) -> str:
    """The test's node id as tests/tiers.json keys it: without the `@group` suffix xdist's loadgroup adds."""
    nodeid = item.nodeid
    for group in GROUPS:
        nodeid = nodeid.removesuffix(f"@{group}")
    return nodeid


@pytest.hookimpl(tryfirst=True)  # before xdist's own, which reads the xdist_group markers set here
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    dev = config.getoption("--tier") == "dev"
    keep: list[pytest.Item] = []
    drop: list[pytest.Item] = []
    for item in items:
        recorded = _tiers.marks(_test_id(item), getattr(item, "fixturenames", ()))
        known = recorded is not None
        marks = recorded if recorded is not None else {"processes"}
        for name in sorted(marks):
            item.add_marker(getattr(pytest.mark, name))
        group = xdist_group(marks, _test_id(item), untimed=item.get_closest_marker("untimed") is not None)
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))
        (drop if dev and (marks or not known) else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
    # The soak (tests/chaos) last: its pace stretches with every second a fault's recovery loses, so it runs best
    # once the other worker is done, not beside the Prefect server; the order within it stays.
    items.sort(key=lambda item: _test_id(item).startswith("tests/chaos/"))


class _GroupCheck:
    """On an xdist worker with `--dist loadgroup`, after xdist's own hook: every grouped test carries its group in its
    node id, or xdist would spread the group over the workers (two training jobs at once on two cores) unseen."""

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, config: pytest.Config, items: list[pytest.Item]) -> None:
        if getattr(config, "workerinput", None) is None or not config.getvalue("loadgroup"):
            return
        lost = [item.nodeid for item in items if item.get_closest_marker("xdist_group") and "@" not in item.nodeid]
        if lost:
            raise pytest.UsageError(
                f"pytest-xdist ignored the xdist_group of {len(lost)} tests (e.g. {lost[0]}): this pytest and "
                "pytest-xdist do not group (pytest-dev/pytest-xdist#1386); install the project's dev extra "
                "(pytest<9.2), or run without -n")


class _FixtureWatch:
    """Registered as a plugin of its own (pytest_configure): a hook in this conftest would see only the fixtures set
    up below tests/, not the session-scoped ones (their node is the session, at the root: the Prefect server's)."""

    @pytest.hookimpl(wrapper=True)
    def pytest_fixture_setup(self, fixturedef: pytest.FixtureDef[object], request: pytest.FixtureRequest
                             ) -> Generator[None, object, object]:
        with _observer.watching("fixture", fixturedef.argname):
            return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None, object, object]:
    # One OpenMP and one BLAS thread in this process (scikit-learn, NumPy, torch in-process): beside the other worker's
    # jobs, a team of OpenMP threads spin-waits for a core and a fit runs about 4x slower (the predictor's tests:
    # 52 s against 14 s, the machine loaded). Processes the tests start keep their own settings.
    with threadpool_limits(limits=1), _observer.watching("test", _test_id(item)):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, object, object]:
    report = yield
    assert isinstance(report, pytest.TestReport)
    if call.when == "setup":
        take_job_events()  # a new test: no job of an earlier one is reported with it
    elif call.when == "call" and report.failed:
        for n, tail in enumerate(take_job_events(), 1):  # what the test's last jobs did (`run_job`)
            report.sections.append((f"the test's job events ({n})", tail))
    if call.when == "teardown" and report.passed and not item.config.getoption("--record-tiers"):
        recorded = _tiers.marks(_test_id(item), getattr(item, "fixturenames", ()))
        started = _observer.seen.get(_test_id(item), [])
        if recorded == set() and started:
            report.outcome = "failed"
            report.longrepr = (f"{item.nodeid} is in the developer tier (tests/tiers.json) but started "
                               f"{started[0]!r}: rerun its file with `pytest --record-tiers` to move it")
    return report


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    config = session.config
    if not config.getoption("--record-tiers"):
        return
    workerinput = getattr(config, "workerinput", None)
    parts = Path(config.rootpath) / ".pytest-tiers"
    if workerinput is not None:  # an xdist worker: leave its part for the controller
        parts.mkdir(exist_ok=True)
        observed_part(parts / f"{workerinput['workerid']}.json", _observer)
        return
    tiers = Tiers.load()
    tiers.merge(_observer)
    for part in sorted(parts.glob("*.json")) if parts.exists() else []:
        tiers.merge(read_part(part))
        part.unlink()
    if parts.exists():
        parts.rmdir()
    tiers.dump(TIERS_FILE)
