"""A launched instance goes from boot to a joined agent by its bootstrap document alone, run for real.

The document `render_cloud_init` renders for a launch, unmodified, is run on a host of its own: a Linux network
namespace on a bridge, with a mount namespace whose /etc (an overlay), /opt and /run are the instance's
(tests/cloud/cloud_init_runner.py does what cloud-init and systemd do with it). The host installs the TrainMover
wheel this test built and staged, checked against its digest, with no index; fetches the staged training script;
creates the service user; fetches the job's secret from SSM (moto, on the bridge) with the instance's identity;
and starts `trainmover agent` as that user, which joins the job's coordinator (a HostPool on the bridge address,
in this process). Needs root, `ip`, `unshare`, overlayfs (CI has them); skipped otherwise, saying why."""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import boto3
import pytest

from cloud.artifacts import build_wheel, stage_local
from cloud.bootstrap import AgentBootstrap, render_cloud_init
from cloud.local.hosts import Bridge, namespaces_unavailable
from cloud.secrets import AwsParameterStore
from runtime.control.hosts import HostPool, HostTiming
from runtime.wire.auth import new_token
from tests.cloud.aws_servers import moto_server

pytestmark = pytest.mark.slow

RUNNER = Path(__file__).with_name("cloud_init_runner.py")
VENV_BIN = Path(sys.executable).parent
REGION = "us-east-1"


def _unavailable() -> str | None:
    why = namespaces_unavailable()
    if why is None and shutil.which("unshare") is None:
        why = "needs `unshare` (util-linux) for the instance's own mount namespace"
    if why is None and shutil.which("useradd") is None:
        why = "needs `useradd` (the bootstrap creates the service user)"
    return why


@pytest.fixture(scope="module")
def bridge() -> Iterator[Bridge]:
    if (why := _unavailable()) is not None:
        pytest.skip(why)
    b = Bridge()
    try:
        yield b
    finally:
        b.close()
        assert b.leftovers() == []


def _joined(pool: HostPool, bridge: Bridge, host: int, log: Path, timeout_s: float) -> None:
    """Until the host's agent joined the pool, or nothing runs on the host any more (its unit failed): then its
    log says why."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            pool.wait_for_hosts(1, 1.0)
            return
        except TimeoutError:
            if not bridge.pids(host) or time.monotonic() > deadline:
                text = log.read_text(errors="replace") if log.exists() else "(no log)"
                pytest.fail(f"no agent joined; the agent unit's log:\n{text[-4000:]}")


def test_the_rendered_user_data_unmodified_boots_a_host_whose_agent_joins_the_job(bridge: Bridge,
                                                                                 tmp_path: Path) -> None:
    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    host = bridge.add_host()
    job, secret = "boot-ns", new_token()
    script = tmp_path / "train.py"
    script.write_text("print('the job')\n")
    staged = tmp_path / "staged"
    wheel, train = stage_local([build_wheel(tmp_path / "dist"), script], staged)
    for p in (tmp_path, staged):  # the instance reads the staged files as any user (file:// here, https on a cloud)
        p.chmod(0o755)
    listener = socket.socket()
    listener.bind((bridge.coordinator_ip, 0))
    listener.listen(16)
    pool = HostPool(listener, secret, job, [], {}, HostTiming())
    sandbox = tmp_path / "instance"
    sandbox.mkdir()
    with moto_server(bridge.coordinator_ip) as moto:
        creds = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": REGION}
        session = boto3.Session(aws_access_key_id="testing", aws_secret_access_key="testing", region_name=REGION)
        ref = AwsParameterStore(REGION, session=session, endpoint_url=moto).put(job, secret)
        spec = AgentBootstrap(job_id=job, coordinator_host=bridge.coordinator_ip,
                              agent_port=listener.getsockname()[1], slots=2, source="trainmover==0.1.0", secret=ref,
                              script="/opt/job/train.py", wheel=wheel, script_file=train)
        document = tmp_path / "user-data"
        document.write_text(render_cloud_init(spec))
        env = {"PATH": f"{VENV_BIN}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
               "AWS_ENDPOINT_URL": moto, **creds}
        try:
            done = subprocess.run(
                ["ip", "netns", "exec", bridge.ns(host), "unshare", "--mount", "--propagation", "private",
                 sys.executable, str(RUNNER), "boot", str(document), str(sandbox)],
                env=env, capture_output=True, text=True, timeout=300, check=False)
            assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
            log = sandbox / "logs" / "trainmover-agent.service.log"
            _joined(pool, bridge, host, log, 120.0)
            (joined,) = [h for h in pool.hosts if h.lost is None]
            assert joined.slots == 2 and joined.address == bridge.address(host)
            # What ran it: the service user, the staged wheel's TrainMover, the staged script at its path.
            agent = next(p for p in bridge.pids(host) if b"agent" in Path(f"/proc/{p}/cmdline").read_bytes())
            status = Path(f"/proc/{agent}/status").read_text()
            uid = int(next(line for line in status.splitlines() if line.startswith("Uid:")).split()[1])
            assert uid != 0, "the agent runs as the unprivileged service user"
            cmdline = Path(f"/proc/{agent}/cmdline").read_bytes().split(b"\0")
            assert any(part.startswith(b"/opt/trainmover/venv/") for part in cmdline), cmdline
            root = f"/proc/{agent}/root"
            assert Path(f"{root}/opt/job/train.py").read_text() == script.read_text()
            assert secret not in json.dumps(os.environ.copy())
        finally:
            pool.close()
            bridge.kill_host(host)
