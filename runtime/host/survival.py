"""How an agent tells a coordinator that is gone from one it is cut off from: the coordinator's lease.

When the job's store lives apart from the coordinator (`trainmover store`, `Welcome.store`), the coordinator renews
its lease there every health tick (runtime.control.lease). An agent whose link to the coordinator went silent or
closed reads that lease twice, a heartbeat apart (`LeaseWatch.read`, each read bounded):

- the store does not answer: this host is cut off (or the store is gone): fence, as without a separate store;
- the count moved: the coordinator is alive and this host is cut off from it; it will give this host's ranks
  away at its host timeout: fence now;
- a newer epoch: a coordinator took over: re-attach to it with the processes still running;
- the count stood still: the coordinator is gone. Keep the processes (they train on: the store is up) and wait,
  up to the agent's connect timeout, for a coordinator to take the next epoch; fence if none does.

The agent never decides from its own link alone, and a store it cannot reach always means fencing, so a host
that is cut off behaves exactly as before.
"""

from __future__ import annotations

import datetime
import threading
from dataclasses import dataclass
from typing import Any

from runtime.wire.auth import Sealer
from runtime.wire.tunnel import Doors


@dataclass(frozen=True, slots=True)
class LeaseSeen:
    """One read of the coordinator's lease."""

    raw: bytes
    epoch: int
    holder: str
    agents: str
    """Where that coordinator's agents connect ("HOST:PORT")."""


def endpoint(address: str) -> tuple[str, int]:
    """("HOST", PORT) of "HOST:PORT" (a bracketed IPv6 host too); ValueError when it is not that."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise ValueError(f"an address must be HOST:PORT, got {address!r}")
    return host.strip("[]"), int(port)


class LeaseWatch:
    """Reads the coordinator's lease from the job's store, through this host's door to it; each read bounded."""

    def __init__(self, store: str, secret: str, doors: Doors, timeout_s: float = 2.0) -> None:
        self.address = endpoint(store)
        self.doors = doors
        self.sealer = Sealer(secret, "agent")
        self.timeout_s = timeout_s
        self._client: Any = None
        self._lock = threading.Lock()

    def _connect(self) -> Any:
        import torch.distributed as dist  # only an agent of a job whose store lives apart pays for it

        host, port = self.doors.local(*self.address)
        return dist.TCPStore(host, port, None, False, timeout=datetime.timedelta(seconds=self.timeout_s),
                             use_libuv=True)

    def warm(self) -> None:
        """Import and connect now, in the background, so that the first read after a loss is one round trip."""
        threading.Thread(target=self.read, args=(10.0,), name="lease-watch-warm", daemon=True).start()

    def read(self, timeout_s: float) -> LeaseSeen | None:
        """The lease now; None when the store does not answer within `timeout_s` or holds no sealed lease."""
        out: list[LeaseSeen | None] = []

        def look() -> None:
            with self._lock:
                try:
                    if self._client is None:
                        self._client = self._connect()
                    from runtime.wire.store import read_lease  # torch, with `_connect`: only where a lease is read

                    found = read_lease(self._client, self.sealer)
                except Exception:  # unreachable, reset, timed out: the answer is "no answer"
                    self._client = None
                    found = None
            out.append(None if found is None else LeaseSeen(found[0], found[1].epoch, found[1].holder,
                                                           found[1].agents))

        reader = threading.Thread(target=look, name="lease-watch", daemon=True)
        reader.start()
        reader.join(timeout_s)
        if reader.is_alive():  # stuck on a store that does not answer: left to its own timeout, never waited for
            self._client = None
            return None
        return out[0] if out else None
