"""The grammar of a fault plan (`runtime.faults`), without torch: what the flows' parameter schema needs.

A plan is `;`-separated items `ACTION:key=value,...`; `PLAN_PATTERN` is a regular expression for exactly the plans
`runtime.faults.parse_plan` reads, less its cross-checks (corrupt only in phase handoff_send). The flows put it in
their parameter schema, so the API and the UI form refuse a malformed plan before a flow run exists.
"""

from __future__ import annotations

ACTION_NAMES: tuple[str, ...] = ("kill", "stop", "term", "exit", "corrupt", "host")
PHASES: tuple[str, ...] = (
    "before_exchange", "exchange", "after_exchange", "optimizer", "handoff_send", "handoff_recv", "warmup",
    "standby_wait", "switch",
)
INT_KEYS: tuple[str, ...] = ("step", "rank", "chunk", "gen")
NAME_KEYS: tuple[str, ...] = ("proc", "role")


def _plan_pattern() -> str:
    sp = r"[ \t]*"
    pair = (f"{sp}(?:phase{sp}={sp}(?:{'|'.join(PHASES)})|(?:{'|'.join(INT_KEYS)}){sp}={sp}[0-9]+"
            f"|(?:{'|'.join(NAME_KEYS)}){sp}={sp}[A-Za-z0-9_.-]+){sp}")
    item = f"(?:{'|'.join(ACTION_NAMES)})(?::(?:{pair})?(?:,(?:{pair})?)*)?"
    return f"^{sp}(?:{item})?{sp}(?:;{sp}(?:{item})?{sp})*$"


PLAN_PATTERN = _plan_pattern()
