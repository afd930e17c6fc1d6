"""An outsider on another host, without the job's secret, against a running job's store gate and agent port.

It tries what the issue's attacker did across hosts: read the store's keys (the job's spec, parameter names),
overwrite and delete heartbeats, flood the port, and present a TLS certificate made from another secret; and it
sends junk and a bogus hello to the agent port. Prints one JSON line: what it managed (every count should be 0)
and how many connections it made to the gate.

argv: GATE_HOST GATE_PORT AGENT_PORT
"""

from __future__ import annotations

import datetime
import json
import secrets
import socket
import sys

import torch.distributed as dist

from runtime.wire.tunnel import StoreDoor

host, gate_port, agent_port = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
got = {"keys_read": 0, "keys_written": 0, "keys_deleted": 0, "stores_opened": 0, "gate_connections": 0,
       "tls_with_another_secret_admitted": 0}


def store_client(at: tuple[str, int]) -> dist.TCPStore | None:
    got["gate_connections"] += 1
    try:
        client = dist.TCPStore(*at, None, False, timeout=datetime.timedelta(seconds=2))
    except (RuntimeError, OSError):
        return None
    got["stores_opened"] += 1
    return client


def attack(client: dist.TCPStore) -> None:
    for call in (lambda: client.list_keys() if hasattr(client, "list_keys") else client.num_keys(),
                 lambda: client.get("job/config"), lambda: client.get("proc/w0/heartbeat")):
        try:
            call()
            got["keys_read"] += 1
        except (RuntimeError, OSError):
            pass
    for key in ("proc/w0/heartbeat", "proc/w1/heartbeat"):
        try:
            client.set(key, b"0" * 64 + b'{"n":999999}')
            got["keys_written"] += 1
        except (RuntimeError, OSError):
            pass
        try:
            if client.delete_key(key):
                got["keys_deleted"] += 1
        except (RuntimeError, OSError):
            pass


# 1. TCPStore's own protocol, straight at the gate.
if (client := store_client((host, gate_port))) is not None:
    attack(client)
# 2. A flood of plain connections with junk, and a heartbeat-shaped write in TCPStore's framing.
for i in range(40):
    got["gate_connections"] += 1
    try:
        with socket.create_connection((host, gate_port), timeout=2) as s:
            s.sendall(secrets.token_bytes(64) if i % 2 else b"\x00" * 16 + b"proc/w0/heartbeat")
    except OSError:
        pass
# 3. Mutual TLS with a certificate made, the same way, from another secret.
door = StoreDoor(host, gate_port, secrets.token_hex(32))
try:
    got["gate_connections"] += 1
    got["tls_with_another_secret_admitted"] += int(door.reachable(3.0))
    if (client := store_client(("127.0.0.1", door.port))) is not None:
        attack(client)
finally:
    door.close()
# 4. The agent port: junk, and a hello without a proof (the coordinator must admit no host "evil").
for payload in (secrets.token_bytes(200), b'\x00\x00\x00\x40{"v":1,"type":"hello","job_id":"x","host":"evil"}'):
    try:
        with socket.create_connection((host, agent_port), timeout=2) as s:
            s.sendall(payload)
            s.settimeout(2.0)
            while s.recv(4096):
                pass
    except OSError:
        pass
print(json.dumps(got), flush=True)
