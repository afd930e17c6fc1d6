"""The grammar of a fault plan (`runtime.faults`), without torch: what the flows' parameter schema needs.

A plan is `;`-separated items `ACTION:key=value,...`; `PLAN_PATTERN` is a regular expression for exactly the plans
`runtime.faults.parse_plan` reads, less its cross-checks (corrupt only in phase handoff_send). The flows put it in
their parameter schema, so the API and the UI form refuse a malformed plan before a flow run exists. A refusal by
the pattern can only quote it, so `plan_mistake` says in one sentence what is wrong with a plan the pattern refuses:
the item and the part of it that is wrong, and a plan written right.
"""

from __future__ import annotations

import re

ACTION_NAMES: tuple[str, ...] = ("kill", "stop", "term", "exit", "corrupt", "host")
PHASES: tuple[str, ...] = (
    "before_exchange", "exchange", "after_exchange", "optimizer", "handoff_send", "handoff_recv", "warmup",
    "standby_wait", "switch",
)
INT_KEYS: tuple[str, ...] = ("step", "rank", "chunk", "gen")
NAME_KEYS: tuple[str, ...] = ("proc", "role")
NAME_PATTERN = r"[A-Za-z0-9_.-]+"


def _plan_pattern() -> str:
    sp = r"[ \t]*"
    pair = (f"{sp}(?:phase{sp}={sp}(?:{'|'.join(PHASES)})|(?:{'|'.join(INT_KEYS)}){sp}={sp}[0-9]+"
            f"|(?:{'|'.join(NAME_KEYS)}){sp}={sp}{NAME_PATTERN}){sp}")
    item = f"(?:{'|'.join(ACTION_NAMES)})(?::(?:{pair})?(?:,(?:{pair})?)*)?"
    return f"^{sp}(?:{item})?{sp}(?:;{sp}(?:{item})?{sp})*$"


PLAN_PATTERN = _plan_pattern()
EXAMPLE_PLAN = "kill:rank=1,step=8;stop:rank=0,step=20"
_BLANK = " \t"  # what the pattern lets surround an item, a key or a value


def plan_mistake(plan: str) -> str | None:
    """What is wrong with `plan` by the grammar, as one sentence that quotes the wrong item and part and shows a plan
    written right; None when `PLAN_PATTERN` matches it (the parser's cross-checks are the parser's to tell)."""
    if re.fullmatch(PLAN_PATTERN, plan):
        return None
    how = f"; write faults as ACTION:key=value,... separated by ';', e.g. {EXAMPLE_PLAN!r}"
    for item in filter(None, (part.strip(_BLANK) for part in plan.split(";"))):
        action, _, rest = item.partition(":")
        if action not in ACTION_NAMES:
            return (f"fault {item!r}: {action!r} is not an action (the action must be one of "
                    f"{', '.join(ACTION_NAMES)}){how}")
        for pair in filter(None, rest.split(",")):
            key, eq, value = (part.strip(_BLANK) for part in pair.partition("="))
            if not eq:
                return f"fault {item!r}: {pair.strip(_BLANK)!r} is not key=value{how}"
            if key == "phase" and value not in PHASES:
                return f"fault {item!r}: {value!r} is not a phase (one of {', '.join(PHASES)}){how}"
            if key in INT_KEYS and not re.fullmatch("[0-9]+", value):
                return f"fault {item!r}: {key} takes a whole number, not {value!r}{how}"
            if key in NAME_KEYS and not re.fullmatch(NAME_PATTERN, value):
                return f"fault {item!r}: {key} takes a name of letters, digits, '_', '.' and '-', not {value!r}{how}"
            if key != "phase" and key not in INT_KEYS + NAME_KEYS:
                return (f"fault {item!r}: {key!r} is not a key (keys: phase, {', '.join(INT_KEYS + NAME_KEYS)})"
                        f"{how}")
    return f"{plan!r} is not a fault plan{how}"  # e.g. a line break, which the pattern does not allow
