"""Two Gloo ranks: rank 1 joins and then never sends; rank 0's bounded receive must fail instead of waiting.

argv: RANK INIT_FILE RESULT_PREFIX
"""

from __future__ import annotations

import datetime
import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from runtime.training.handoff import GlooLinks

rank, init, out = int(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=2,
                        timeout=datetime.timedelta(seconds=60))
result: dict[str, object] = {"rank": rank}
if rank == 0:
    t0 = time.monotonic()
    try:
        GlooLinks(timeout_s=1.0).recv(torch.zeros(4), 1, 7)
        result["error"] = None
    except RuntimeError as exc:
        result["error"] = type(exc).__name__
    result["waited_s"] = time.monotonic() - t0
    Path(f"{out}.0").write_text(json.dumps(result))
else:
    deadline = time.monotonic() + 60
    while not Path(f"{out}.0").exists() and time.monotonic() < deadline:
        time.sleep(0.05)  # the peer that never sends: it only outlives rank 0's wait
    Path(f"{out}.1").write_text(json.dumps(result))
