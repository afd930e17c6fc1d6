"""What a stack dump looks like on stderr, Python's or torch's C++ (a user reads either as a crash)."""

from __future__ import annotations

MARKERS = ("Traceback (most recent call last)", "Exception raised from", "frame #", "TCPStore.cpp",
           "terminate called")


def assert_no_stack_dump(stderr: str) -> None:
    found = [m for m in MARKERS if m in stderr]
    assert not found, f"a stack dump reached the user ({found}):\n{stderr[-3000:]}"
