"""`trainmover bench scale`: the real coordinator (its store, its agent links, its loop) against simulated hosts.

The coordinator runs as its own process, exactly as `trainmover coordinator` builds it (runtime.launcher's store,
runtime.control.hosts' HostPool, runtime.control.coordinator's loop) with its store wrapped to count requests. This
process simulates the hosts: one thread speaks the agent protocol on every link (handshake, sealed beats every
0.5 s, each a `proc_beats` frame with its processes' ages as a real agent's, spawn orders answered, generations
received), another plays every training process's part in the store (a sealed hello,
the warm record of a standby, a sealed heartbeat every 0.25 s, batched per beat; the reports of a recovery). No
torch runs in a simulated process.

A host "dies" in one of two ways, in alternate trials. **Closed**: as a killed machine's kernel does for its
sockets, its link closes (a FIN or a reset reaches the coordinator) and its processes stop beating. **Silent**: as a
machine that lost power or its network does, nothing more arrives from it and nothing closes: its link stays open,
unread, and its processes' store heartbeats stop; only the missing beats (`--host-timeout`, default 3 s) tell.
Measured per trial: the time from that moment to the new generation received by every surviving agent (and by
the median one), per kind; per size: the coordinator process's CPU share (its loop, its link thread and its store
server) at rest and the store requests per second its loop sends.
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

HEARTBEAT_S = 0.25


# -- the coordinator, in its own process ------------------------------------------------------------------
class CountingStore:
    """The coordinator's TCPStore, counting the requests the coordinator sends it."""

    def __init__(self, store: Any) -> None:
        self._store = store
        self.requests = 0
        self.port = store.port

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._store, name)
        if not callable(attr):
            return attr

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.requests += 1
            return attr(*args, **kwargs)

        return counted


def serve(hosts: int, slots: int, standby_hosts: int, out: str) -> None:
    """Run the coordinator until SIGTERM; write its store request count to `out` every second."""
    from runtime.control.coordinator import Coordinator, CoordinatorSettings
    from runtime.control.hosts import HostPool, HostTiming
    from runtime.launcher import bind, listen_store
    from runtime.wire.events import EventLog

    token = os.environ["TRAINMOVER_JOB_SECRET"]
    store = listen_store("127.0.0.1", 0)
    counting = CountingStore(store)
    listener = bind("127.0.0.1", 0, "--agent-port")
    pool = HostPool(listener, token, "scale", ["sim.py"], {}, HostTiming())
    Path(out + ".ports").write_text(json.dumps({"store": store.port, "agents": pool.port}))
    pool.wait_for_hosts(hosts + standby_hosts, 300)
    settings = CoordinatorSettings(job_id="scale", job_token=token, nproc=hosts * slots,
                                   standby=standby_hosts * slots, hang_timeout_s=5.0, standby_wait_s=600,
                                   replenish=False, start_when_standbys_ready=True, startup_timeout_s=600)

    def report() -> None:
        while True:
            Path(out).write_text(json.dumps({"requests": counting.requests, "time": time.time()}))
            time.sleep(1.0)  # a reporting pace

    threading.Thread(target=report, daemon=True).start()
    Coordinator(settings, counting, pool, EventLog(None)).run()  # type: ignore[arg-type]


# -- the simulated hosts, in this process --------------------------------------------------------------------
class SimHosts:
    def __init__(self, token: str, agent_port: int, store_port: int, count: int, slots: int) -> None:
        from runtime.wire.auth import Sealer
        from runtime.wire.store import Records, connect

        self.token = token
        self.slots = slots
        self.records = Records(connect("127.0.0.1", store_port), Sealer(token, "sim"))
        self.sel = selectors.DefaultSelector()
        self.links: dict[int, Any] = {}
        self.gen_seen: dict[int, dict[int, float]] = {}
        """generation -> host index -> when its notice arrived (monotonic)."""
        self.procs: dict[str, int] = {}
        """live simulated process -> host index."""
        self.dead: set[int] = set()
        self.silent: set[int] = set()
        """Dead hosts whose links stay open, unread (killed with `silent`)."""
        self.closed: set[int] = set()
        self.first_above: dict[int, dict[int, float]] = {}
        """generation g -> host -> when it first saw a generation above g."""
        self.worker_hosts: list[int] = []
        """Hosts the coordinator placed workers on, in order (the victims: each trial kills one)."""
        self.next_pid = 1000
        self.lock = threading.Lock()
        self.halt = False
        self.count = count
        self.port = agent_port
        self.io = threading.Thread(target=self._serve, daemon=True)
        self.io.start()
        self.beats = threading.Thread(target=self._beat_procs, args=(store_port,), daemon=True)
        self.beats.start()

    def _open(self, i: int, port: int) -> None:
        from runtime.wire.protocol import Hello, Link, new_nonce

        sock = socket.create_connection(("127.0.0.1", port))
        link = Link(sock, "agent")
        nonce = new_nonce()
        link.send(Hello(job_id="scale", host=f"sim{i}", incarnation="1", slots=self.slots, address="127.0.0.1",
                        pid=i, nonce=nonce))
        link.nonce = nonce  # type: ignore[attr-defined]
        self.links[i] = link
        self.sel.register(sock, selectors.EVENT_READ, i)

    def _serve(self) -> None:
        from runtime.wire.protocol import (
            Beat,
            GenerationNotice,
            ProcBeats,
            ProcessHello,
            Signal,
            Spawn,
            StandbyReady,
            Started,
            Welcome,
            session_key,
        )
        from runtime.wire.store import k_hello, k_ready

        beat_due = time.monotonic()
        while not self.halt:
            # Links open a batch at a time between reads, as hosts booting at once would: each one's handshake
            # is answered while the next ones connect (the coordinator gives a handshake 5 s).
            for i in range(len(self.links), min(self.count, len(self.links) + 32)):
                self._open(i, self.port)
            for key, _ in self.sel.select(0.05 if len(self.links) == self.count else 0):
                i = key.data
                link = self.links[i]
                if i in self.silent:
                    self.sel.unregister(link.sock)  # a silent host reads nothing more, and closes nothing
                    continue
                try:
                    data = link.sock.recv(1 << 16)
                except OSError:
                    data = b""
                if not data:
                    self.sel.unregister(link.sock)
                    self.closed.add(i)  # killed by the bench, or fenced by the coordinator (a false loss)
                    continue
                for msg, raw in link.feed(data):
                    if isinstance(msg, Welcome):
                        link.key = session_key(self.token, link.nonce, raw["cn"])
                        assert link.check_last()
                        link.send(Beat())
                    elif isinstance(msg, Spawn):
                        with self.lock:
                            self.next_pid += 1
                            pid = self.next_pid
                            self.procs[msg.proc] = i
                            if msg.role == "worker" and i not in self.worker_hosts:
                                self.worker_hosts.append(i)
                        self.records.put(k_hello(msg.proc), ProcessHello(pid, msg.role))
                        if msg.role == "standby":
                            self.records.put(k_ready(msg.proc), StandbyReady(0.0))
                        link.send(Started(msg.proc, pid))
                    elif isinstance(msg, GenerationNotice):
                        now = time.monotonic()
                        self.gen_seen.setdefault(msg.gen, {})[i] = now
                        for g in range(msg.gen):
                            self.first_above.setdefault(g, {}).setdefault(i, now)
                    elif isinstance(msg, Signal):
                        pass
            now = time.monotonic()
            if now >= beat_due:
                beat_due = now + 0.5
                with self.lock:
                    ran: dict[int, dict[str, float]] = {}
                    for proc, i in self.procs.items():
                        ran.setdefault(i, {})[proc] = 0.1
                for i, link in list(self.links.items()):
                    if i not in self.dead and link.key is not None:
                        with contextlib.suppress(OSError):  # as an agent beats: its processes' ages, or a bare beat
                            link.send(ProcBeats(ran[i]) if i in ran else Beat())

    def _beat_procs(self, store_port: int) -> None:
        """Every simulated process's sealed heartbeat, batched per beat in one multi_set."""
        from runtime.wire.store import connect, k_heartbeat

        client = connect("127.0.0.1", store_port)
        sealer = self.records.sealer
        count = 0
        while not self.halt:
            with self.lock:
                live = [p for p, i in self.procs.items() if i not in self.dead]
            keys = [k_heartbeat(p) for p in live]
            if keys:
                client.multi_set(keys, [sealer.seal(k, count) for k in keys])  # type: ignore[attr-defined]
            count += 1
            time.sleep(HEARTBEAT_S)  # the processes' heartbeat interval

    def kill(self, i: int, silent: bool = False) -> float:
        """Host i dies: its link closes and its processes stop beating; `silent`: nothing closes, nothing more is
        sent or read on its link (a host that lost power or its network: no FIN)."""
        link = self.links[i]
        with self.lock:
            self.dead.add(i)
            if silent:
                self.silent.add(i)
        at = time.monotonic()
        if not silent:
            link.sock.close()
        return at

    def write_reports(self, gen: int, members: int) -> None:
        """The members' final reports of a recovery, so the coordinator closes it (as real members do)."""
        from runtime.wire.protocol import RecoveryReport
        from runtime.wire.store import k_report

        now = time.time()
        for r in range(members):
            self.records.put(k_report(gen, r), RecoveryReport(
                rank=r, role="source", group_ready_at=now, handoff_s=0.0, handoff_bytes=0, handoff_end_at=now,
                replay_step=1, replay_done_at=now, final=True))

    def close(self) -> None:
        self.halt = True
        for link in self.links.values():
            with contextlib.suppress(OSError):
                link.sock.close()


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure(hosts: int, slots: int, trials: int, tmp: Path) -> dict[str, Any]:
    from runtime.wire.auth import new_token

    token = new_token()
    out = tmp / f"coord-{hosts}.json"
    env = {**os.environ, "TRAINMOVER_JOB_SECRET": token, "PYTHONUNBUFFERED": "1"}
    with open(str(out) + ".log", "wb") as log:
        coord = subprocess.Popen([sys.executable, "-m", "bench.scale", "--serve", str(hosts), str(slots),
                                  str(trials), str(out)], env=env, stderr=log, cwd=Path(__file__).resolve().parents[1])
    sim = None
    try:
        ports_path = Path(str(out) + ".ports")
        deadline = time.monotonic() + 60
        while not ports_path.exists():
            if coord.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the coordinator did not start: {Path(str(out) + '.log').read_text()[-2000:]}")
            time.sleep(0.05)  # waiting for another process's file
        ports = json.loads(ports_path.read_text())
        t_join = time.monotonic()
        sim = SimHosts(token, ports["agents"], ports["store"], hosts + trials, slots)
        _wait(lambda: 0 in sim.gen_seen and len(sim.gen_seen[0]) == hosts + trials, 600, "generation 0")
        started_s = time.monotonic() - t_join
        # At rest: CPU share and store requests over a few seconds with every host beating.
        cpu0, req0, t0 = _cpu_s(coord.pid), _requests(out), time.monotonic()
        _wait(lambda: _requests(out) != req0 and time.monotonic() - t0 > 4.0, 30, "the request counter")
        cpu1, req1, t1 = _cpu_s(coord.pid), _requests(out), time.monotonic()
        rest_cpu = (cpu1 - cpu0) / (t1 - t0)
        rest_rps = (req1 - req0) / (t1 - t0)
        every: list[float] = []
        median: list[float] = []
        silent_every: list[float] = []
        silent_median: list[float] = []
        cpu_r0, tr0 = _cpu_s(coord.pid), time.monotonic()
        last = 0
        for trial in range(trials):
            silent = trial % 2 == 1
            at = sim.kill(sim.worker_hosts[trial], silent=silent)

            def everyone(g: int = last) -> bool:
                alive = set(sim.links) - sim.dead - sim.closed
                return alive <= set(sim.first_above.get(g, {}))

            _wait(everyone, 60, f"a generation after {last} at every surviving agent")
            alive = set(sim.links) - sim.dead - sim.closed
            seen = sorted(sim.first_above[last][i] - at for i in alive)
            (silent_every if silent else every).append(seen[-1])
            (silent_median if silent else median).append(statistics.median(seen))
            last = max(sim.gen_seen)
            sim.write_reports(last, hosts * slots)
        busy_cpu = (_cpu_s(coord.pid) - cpu_r0) / (time.monotonic() - tr0)
        return {"hosts": hosts, "slots": slots, "processes": (hosts + trials) * slots, "trials": trials,
                "start_s": started_s, "every_agent_p50_s": _pct(every, 50), "every_agent_p99_s": _pct(every, 99),
                "median_agent_p50_s": _pct(median, 50), "rest_cpu_share": rest_cpu, "rest_store_rps": rest_rps,
                "silent_every_agent_p50_s": _pct(silent_every, 50),
                "silent_every_agent_p99_s": _pct(silent_every, 99),
                "silent_median_agent_p50_s": _pct(silent_median, 50), "silent_every_agent_s": silent_every,
                "recovering_cpu_share": busy_cpu, "every_agent_s": every,
                "hosts_lost_falsely": len(sim.closed - sim.dead), "generations": max(sim.gen_seen)}
    finally:
        if sim is not None:
            sim.close()
        coord.terminate()
        try:
            coord.wait(timeout=30)
        except subprocess.TimeoutExpired:
            coord.kill()
            coord.wait(timeout=10)


def _requests(out: Path) -> int:
    try:
        return int(json.loads(out.read_text())["requests"])
    except (OSError, ValueError, KeyError):
        return -1


def _pct(xs: list[float], p: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, round(p / 100 * (len(s) - 1)))]


def _wait(cond: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {what} within {timeout_s:.0f} s")
        time.sleep(0.005)  # a polling pace on another thread's state


def main(sizes: list[int], slots: int = 1, trials: int = 10, json_path: str | None = None) -> int:
    import tempfile

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in sizes:
            row = measure(n, slots, trials, Path(tmp))
            rows.append(row)
            print(f"{n:5d} hosts x {slots}: host loss -> new generation at every survivor p50 "
                  f"{row['every_agent_p50_s'] * 1000:7.1f} ms, p99 {row['every_agent_p99_s'] * 1000:7.1f} ms "
                  f"(median agent {row['median_agent_p50_s'] * 1000:6.1f} ms); silent host (no FIN) p50 "
                  f"{row['silent_every_agent_p50_s'] * 1000:7.1f} ms, "
                  f"p99 {row['silent_every_agent_p99_s'] * 1000:7.1f} ms; coordinator CPU at rest "
                  f"{row['rest_cpu_share']:.2f} core, recovering {row['recovering_cpu_share']:.2f}; store "
                  f"{row['rest_store_rps']:.0f} req/s at rest; start {row['start_s']:.1f} s; hosts lost falsely "
                  f"{row['hosts_lost_falsely']}", flush=True)
    if json_path:
        Path(json_path).write_text(json.dumps({"heartbeat_s": HEARTBEAT_S, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    if sys.argv[1] == "--serve":
        serve(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
