"""Generations: who holds which logical rank, as a frozen record the coordinator publishes.

Every membership change makes a new generation. Its process groups are built from a `PrefixStore` named
after it, so survivors build new groups in-process without clashing with the old ones.

The record itself, `Generation`, is defined with every other store record in runtime.wire.protocol (one place to
read every message); it is re-exported here, where its users have always found it.
"""

from __future__ import annotations

from runtime.wire.protocol import Generation

__all__ = ["Generation"]
