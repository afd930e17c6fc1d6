"""`trainmover bench security`: what authenticating the job costs, side by side in one run.

1. **Primitives**: throughput of the MAC candidates over one 64 MiB buffer (HMAC-SHA256, keyed BLAKE2b, keyed
   BLAKE3, Poly1305, and the handoff's: Poly1305 under a one-time key derived by keyed BLAKE3), on one core and on
   every core, and of the additive checksum the handoff used before (a torch sum, not keyed: it cannot refuse a
   forger).
2. **Handoff throughput**: one source hands a state of `--state-mb` to one receiver, in two processes, over
   the Gloo group and over mutual TLS, with the chunk MACs (the real `run_handoff`), against the raw link (the
   same tensors sent with no protocol and no MAC: the floor). The MACs' own time is measured inside the handoff.
3. **Sealed records**: seal and open of typical records, and one heartbeat (the only steady-state store traffic:
   a sealed put and two verified reads per beat, every 0.25 s, on the heartbeat thread) sealed against the same
   store operations unsealed, on a real TCPStore. The training thread reads or writes no record in a step.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import hmac
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from bench.peers.common import REPO_ROOT, free_port
from runtime.wire.tunnel import StoreDoor, StoreGate

MODULE = "bench.security"
TOKEN = "b" * 64


def _best(fn: Any, reps: int = 3) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def primitives(nbytes: int = 64 << 20) -> dict[str, Any]:
    """GB/s of each MAC candidate over one buffer (best of 3), on one core and on every core (the buffer in one chunk
    per core, hashed on a pool of threads, as the handoff hashes its chunks; BLAKE3 also hashes one buffer on every
    core itself). Poly1305 is a one-time authenticator: the handoff's MAC (`chunk_mac`) derives each chunk's key
    from the generation's key, the receiver, the step and the chunk's index, a keyed BLAKE3 of 32 bytes per chunk,
    measured here as the handoff runs it."""
    import blake3
    from cryptography.hazmat.primitives.poly1305 import Poly1305

    from runtime.training.handoff import chunk_mac

    data = os.urandom(nbytes)
    key = b"k" * 32
    tensor = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    words = tensor.view(torch.int64)
    cores = os.cpu_count() or 1
    candidates: dict[str, Any] = {
        "hmac_sha256": lambda b: hmac.new(key, b, hashlib.sha256).digest(),
        "blake2b_keyed": lambda b: hashlib.blake2b(b, key=key).digest(),
        "blake3_keyed": lambda b: blake3.blake3(b, key=key).digest(),
        "poly1305": lambda b: Poly1305.generate_tag(key, b),
        "chunk_mac": lambda b: chunk_mac(key, 1, 7, 3, b),
    }
    view = memoryview(data)
    size = nbytes // cores
    chunks = [view[i * size:(i + 1) * size] for i in range(cores)]
    out: dict[str, Any] = {}
    with ThreadPoolExecutor(max_workers=cores) as pool:
        for name, mac in candidates.items():
            out[f"{name}_GBps"] = nbytes / _best(lambda m=mac: m(data)) / 1e9
            out[f"{name}_every_core_GBps"] = size * cores / _best(lambda m=mac: list(pool.map(m, chunks))) / 1e9
    out["blake3_keyed_one_buffer_every_core_GBps"] = nbytes / _best(
        lambda: blake3.blake3(data, key=key, max_threads=blake3.blake3.AUTO).digest()) / 1e9
    out["additive_checksum_GBps"] = nbytes / _best(lambda: int(words.sum(dtype=torch.int64).item())) / 1e9
    out["cores"] = cores
    out["chosen"] = "chunk_mac: Poly1305 under a one-time key from keyed BLAKE3 (runtime.training.handoff)"
    out["blake3_vs_hmac_every_core"] = out["blake3_keyed_one_buffer_every_core_GBps"] / out[
        "hmac_sha256_every_core_GBps"]
    out["chunk_mac_vs_hmac"] = out["chunk_mac_GBps"] / out["hmac_sha256_GBps"]
    out["chunk_mac_vs_hmac_every_core"] = out["chunk_mac_every_core_GBps"] / out["hmac_sha256_every_core_GBps"]
    return {k: round(v, 3) if isinstance(v, float) else v for k, v in out.items()}


def records(beats: int = 400) -> dict[str, float]:
    """Microseconds per record seal/open, and per heartbeat sealed vs unsealed against a real store."""
    from runtime.control.membership import Generation
    from runtime.wire import store as keys
    from runtime.wire.auth import Sealer

    sealer = Sealer(TOKEN)
    gen = Generation(7, tuple(f"w{i}" for i in range(64)), "w3 killed by SIGKILL", ((3, "w3", "s9"),)).to_json()
    n = 2000
    sealed = sealer.seal("gen/7/record", gen)
    seal_us = _best(lambda: [sealer.seal("gen/7/record", gen) for _ in range(n)]) / n * 1e6
    open_us = _best(lambda: [sealer.open("gen/7/record", sealed) for _ in range(n)]) / n * 1e6
    server = dist.TCPStore("127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=30), wait_for_workers=False)
    client = dist.TCPStore("127.0.0.1", server.port, None, False, timeout=datetime.timedelta(seconds=30))
    rec = keys.Records(client, sealer)
    rec.put(keys.k_current_gen(), 7)
    client.set("raw/current", "7")

    def sealed_beats() -> None:
        for i in range(beats):
            rec.put(keys.k_heartbeat("w0"), i)
            rec.get_int(keys.k_current_gen())
            rec.has(keys.k_stop())

    def raw_beats() -> None:
        for _ in range(beats):
            client.add("raw/heartbeat", 1)
            int(client.get("raw/current")) if client.check(["raw/current"]) else -1
            client.check(["raw/stop"])

    sealed_s = _best(sealed_beats)
    raw_s = _best(raw_beats)
    beat_us, raw_us = sealed_s / beats * 1e6, raw_s / beats * 1e6
    # The same sealed beats through the store's tunnel (a host's door, TLS, the coordinator's gate), and one
    # plain round trip each way: what a process on another host pays (runtime.wire.tunnel).
    gate = StoreGate(socket.create_server(("127.0.0.1", 0)), server.port, TOKEN)
    door = StoreDoor("127.0.0.1", gate.port, TOKEN)
    try:
        far = dist.TCPStore("127.0.0.1", door.port, None, False, timeout=datetime.timedelta(seconds=30))
        far_rec = keys.Records(far, sealer)

        def tunnel_beats() -> None:
            for i in range(beats):
                far_rec.put(keys.k_heartbeat("w0"), i)
                far_rec.get_int(keys.k_current_gen())
                far_rec.has(keys.k_stop())

        tunnel_us = _best(tunnel_beats) / beats * 1e6
        rtt_us = _best(lambda: [client.check(["raw/stop"]) for _ in range(n)]) / n * 1e6
        rtt_tunnel_us = _best(lambda: [far.check(["raw/stop"]) for _ in range(n)]) / n * 1e6
    finally:
        door.close()
        gate.close()
    return {
        "seal_gen_record_us": round(seal_us, 2), "open_gen_record_us": round(open_us, 2),
        "record_bytes": len(sealed), "heartbeat_sealed_us": round(beat_us, 1),
        "heartbeat_unsealed_us": round(raw_us, 1),
        "heartbeat_extra_us": round(beat_us - raw_us, 1),
        "heartbeat_extra_core_fraction": round((beat_us - raw_us) * 4 / 1e6, 6),  # 4 beats a second
        "heartbeat_tunnel_us": round(tunnel_us, 1),
        "store_round_trip_us": round(rtt_us, 1), "store_round_trip_tunnel_us": round(rtt_tunnel_us, 1),
    }


# -- the handoff, in two processes ---------------------------------------------------------------------------
def _model(state_mb: int) -> nn.Module:
    torch.manual_seed(0)
    layers = max(1, state_mb // 4)  # a 1024 x 1024 float32 layer is 4 MiB
    return nn.Sequential(*(nn.Linear(1024, 1024, bias=False) for _ in range(layers)))


def worker(rank: int, port: int, state_mb: int, reps: int, transports: list[str], cert: str, out: str) -> None:
    from runtime.training.handoff import GlooLinks, HandoffPlan, HandoffSession, Links, run_handoff
    from runtime.training.state import TrainingState
    from runtime.wire import store as keys
    from runtime.wire.auth import Sealer

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, None, False, timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("gloo", store=dist.PrefixStore("pg", store), rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=120))
    model = _model(state_mb)
    if rank == 1:
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = TrainingState(model, opt)
    records = keys.Records(store, Sealer(TOKEN))
    plan = HandoffPlan(target_step=0, sources=(0,), receivers=(1,))
    tensors = [t for _, t in state.tensors()]
    result: dict[str, Any] = {"state_bytes": state.state_bytes()}
    gen = 0
    for transport in transports:
        handoff_s, mac_s, raw_s, open_s = [], [], [], []
        for _ in range(reps):
            for kind in ("raw", "handoff"):
                gen += 1
                dist.barrier()
                t0 = time.perf_counter()
                links: Links
                if transport == "tls":
                    from runtime.training.tls_transport import TlsConfig, open_tls_links

                    tls_links = open_tls_links(plan, rank, gen, records, TlsConfig(cert, cert + ".key"), 120.0)
                    links = tls_links
                else:
                    tls_links = None
                    links = GlooLinks()
                opened = time.perf_counter() - t0
                if kind == "raw":
                    # Every tensor in flight at once, as the handoff sends its chunks: the link's floor, not one
                    # blocking message after another.
                    works = [(links.isend if rank == 0 else links.irecv)(t, 1 - rank, 16 + i)
                             for i, t in enumerate(tensors)]
                    for w in works:
                        w.wait()
                    if tls_links is not None:  # a last small message back: the time covers delivery
                        ack = torch.zeros(1)
                        (links.recv if rank == 0 else links.send)(ack, 1 - rank, 1)
                    else:
                        dist.barrier()
                    raw_s.append(time.perf_counter() - t0)
                else:
                    session = HandoffSession(gen, ("p0", "p1"), "bench", TOKEN, 64 << 20)
                    stats, _ = run_handoff(plan, session, rank, state, links=links)
                    handoff_s.append(time.perf_counter() - t0)
                    mac_s.append(stats.mac_s)
                    open_s.append(opened)
                if tls_links is not None:
                    tls_links.close()
        result[transport] = {"handoff_s": handoff_s, "mac_s": mac_s, "raw_s": raw_s, "open_s": open_s}
    if rank == 1:
        Path(out).write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def handoff(state_mb: int, reps: int, transports: list[str]) -> dict[str, Any]:
    from runtime.training.tls_transport import make_job_certificate

    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, None, True, timeout=datetime.timedelta(seconds=60),
                           wait_for_workers=False)
    with tempfile.TemporaryDirectory(prefix="tm-bench-sec-") as d:
        cert, key = make_job_certificate(d)
        os.rename(key, cert + ".key")
        out = str(Path(d) / "result.json")
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT)}
        procs = [subprocess.Popen([sys.executable, "-m", MODULE, "--worker", str(r), str(port), str(state_mb),
                                   str(reps), ",".join(transports), cert, out], env=env, cwd=REPO_ROOT)
                 for r in range(2)]
        try:
            for p in procs:
                if p.wait(timeout=900) != 0:
                    raise RuntimeError(f"a handoff worker failed (exit {p.returncode})")
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        raw = json.loads(Path(out).read_text())
    del server
    nbytes = raw["state_bytes"]
    report: dict[str, Any] = {"state_bytes": nbytes, "reps": reps}
    for transport in transports:
        r = raw[transport]
        med = {k: statistics.median(v) for k, v in r.items()}
        report[transport] = {
            "raw_MBps": round(nbytes / med["raw_s"] / 1e6, 1),
            "handoff_MBps": round(nbytes / med["handoff_s"] / 1e6, 1),
            "handoff_vs_raw": round(med["raw_s"] / med["handoff_s"], 3),
            "mac_cpu_s": round(med["mac_s"], 4),
            "receiver_mac_MBps": round(nbytes / med["mac_s"] / 1e6, 1) if med["mac_s"] else None,
            "open_links_s": round(med["open_s"], 4),
            "each": {k: [round(x, 4) for x in v] for k, v in r.items()},
        }
    if "gloo" in report and "tls" in report:
        report["tls_vs_gloo_handoff"] = round(report["tls"]["handoff_MBps"] / report["gloo"]["handoff_MBps"], 3)
    return report


def main(quick: bool = False, json_path: str | None = None) -> int:
    t0 = time.monotonic()
    state_mb, reps = (48, 3) if quick else (200, 5)
    report: dict[str, Any] = {
        "primitives": primitives(16 << 20 if quick else 64 << 20),
        "records": records(200 if quick else 1000),
        "handoff": handoff(state_mb, reps, ["gloo", "tls"]),
        "machine": {"cpus": os.cpu_count(), "torch": torch.__version__},
    }
    report["wall_s"] = round(time.monotonic() - t0, 1)
    print(json.dumps(report, indent=2))
    if json_path:
        Path(json_path).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", nargs=7, metavar=("RANK", "PORT", "MB", "REPS", "TRANSPORTS", "CERT", "OUT"))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json")
    ns = ap.parse_args()
    if ns.worker:
        rank, port, mb, reps, transports, cert, out = ns.worker
        worker(int(rank), int(port), int(mb), int(reps), transports.split(","), cert, out)
    else:
        raise SystemExit(main(ns.quick, ns.json))
