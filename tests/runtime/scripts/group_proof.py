"""One rank of a group whose peers prove they belong to the job: `group_proof.py RANK WORLD PORT TOKEN OUT`."""

from __future__ import annotations

import datetime
import json
import sys

import torch
import torch.distributed as dist

from runtime.control.membership import Generation
from runtime.training.comm import CommFailure, Communicator
from runtime.training.trainer import check_group


def main() -> None:
    rank, world, port, token, out = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
    store = dist.TCPStore("127.0.0.1", port, None, False, timeout=datetime.timedelta(seconds=30))
    comm = Communicator("gloo", store, 30.0, torch.device("cpu"))
    record = Generation(3, tuple(f"p{r}" for r in range(world)))
    comm.build(record.gen, rank, world, 30.0)
    try:
        check_group(comm, token, "job", record, rank)
        result: dict[str, object] = {"ok": True}
    except CommFailure as exc:
        result = {"ok": False, "error": str(exc)}
    comm.teardown()
    with open(out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
