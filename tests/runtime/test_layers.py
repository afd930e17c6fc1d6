"""runtime/'s sub-packages show where code runs; these are their import rules (docs/design.md), checked from
the source: every `runtime` import of every module, at module level or inside a function, names an allowed part."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.runtime.fresh import loaded_by

RUNTIME = Path(__file__).resolve().parents[2] / "runtime"
SHARED = {"runtime.config", "runtime.faults", "runtime.fault_grammar"}
# Which parts each part may import (itself always). The entry points at the top (cli, launcher, client, demo, the
# package's script API) may import any part.
ALLOWED: dict[str, set[str]] = {
    "wire": {"runtime.wire"},
    "control": {"runtime.wire", *SHARED},
    "host": {"runtime.wire", "runtime.config"},
    "training": {"runtime.wire", *SHARED},
    "runtime.faults": {"runtime.wire", "runtime.fault_grammar"},
    "runtime.fault_grammar": set(),
    # The one configuration tree validates its values with the parsers of the parts that read them (imported inside
    # the check that needs them, and HostTiming for a type only), so that every command fails early the same way.
    "runtime.config": {"runtime.wire", "runtime.faults", "runtime.control.chaos", "runtime.control.hosts"},
}


def _imports(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "runtime"}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "runtime":
            found |= {f"{node.module}.{a.name}" if node.module == "runtime" else node.module for a in node.names}
    return found


def _part(path: Path) -> str:
    rel = path.relative_to(RUNTIME)
    return rel.parts[0] if len(rel.parts) > 1 else f"runtime.{rel.stem}"


def _allowed(part: str, name: str) -> bool:
    own = f"runtime.{part}" if not part.startswith("runtime.") else part
    return any(name == a or name.startswith(a + ".") for a in {own, *ALLOWED[part]})


@pytest.mark.parametrize("path", sorted(RUNTIME.rglob("*.py")), ids=lambda p: str(p.relative_to(RUNTIME)))
def test_each_module_imports_only_what_its_part_may(path: Path) -> None:
    part = _part(path)
    if part not in ALLOWED:
        return  # an entry point: cli, launcher, client, demo, the script API
    wrong = sorted(n for n in _imports(path) if n != "runtime" and not _allowed(part, n))
    assert not wrong, f"{path.relative_to(RUNTIME)} ({part}) imports {wrong}: see the rules in docs/design.md"


def test_the_rules_catch_an_import_across_parts(tmp_path: Path) -> None:
    """The check itself can fail: an agent module importing the coordinator is refused."""
    bad = RUNTIME / "host" / "agent.py"
    assert "runtime.control.coordinator" not in _imports(bad)
    fake = tmp_path / "x.py"
    fake.write_text("def f():\n    from runtime.control.coordinator import Coordinator\n")
    assert not _allowed("host", next(iter(_imports(fake))))
    assert _allowed("host", "runtime.wire.protocol") and not _allowed("wire", "runtime.config")


def test_a_hosts_agent_and_its_fork_server_load_no_torch_until_they_need_it() -> None:
    """The agent starts before its zygote has imported torch (runtime.host.zygote): an agent that imported torch
    itself cost each host start 1.4 s of CPU beside the zygote's (the lease watch reads a separate store with torch's
    client only once it must)."""
    assert loaded_by("import runtime.host.agent, runtime.host.zygote, runtime.host.survival",
                     ["torch", "numpy", "sklearn"]) == []
