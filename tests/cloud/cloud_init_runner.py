"""What cloud-init and systemd do with a TrainMover bootstrap document, on a network-namespace host (a test helper).

`python cloud_init_runner.py boot DOCUMENT SANDBOX` runs inside the host's network namespace and a mount namespace
of its own (`unshare --mount`), as root. It gives the "instance" a fresh view of what the document writes (`/etc`
under an overlay, so `useradd` and the units land there and not on this machine; `/opt` and `/run` as tmpfs), then
does what cloud-init does with the document, unmodified: `write_files` (content, permissions, owner), then each
`runcmd` entry in order, failing on the first that fails. Its `systemctl` (this file, called under that name from
a directory first on PATH) does what systemd would for the units the document enables: `enable --now UNIT` and
`start UNIT` start the unit's `ExecStart` as its `User=`, in its `WorkingDirectory=`, with its `Environment=`,
`RuntimeDirectory=` (made for the user, mode as given, exported as RUNTIME_DIRECTORY) and `UMask=`, detached, its
output in SANDBOX/logs/UNIT.log; `daemon-reload` is a no-op. The instance's own environment (what its identity
provides: here the AWS endpoint and credentials moto accepts) passes through.
"""

from __future__ import annotations

import json
import os
import pwd
import subprocess
import sys
from pathlib import Path

UNIT_DIR = Path("/etc/systemd/system")


def _mount_sandbox(sandbox: Path) -> None:
    scratch = sandbox / "scratch"
    scratch.mkdir(parents=True, exist_ok=True)
    # An overlay's upper directory cannot live on an overlay (a container's root): a tmpfs of its own.
    subprocess.run(["mount", "-t", "tmpfs", "tmpfs", str(scratch)], check=True)
    (scratch / "upper").mkdir()
    (scratch / "work").mkdir()
    subprocess.run(["mount", "-t", "overlay", "overlay", "-o",
                    f"lowerdir=/etc,upperdir={scratch / 'upper'},workdir={scratch / 'work'}", "/etc"], check=True)
    for where in ("/opt", "/run"):
        subprocess.run(["mount", "-t", "tmpfs", "tmpfs", where], check=True)
    _expose(Path(sys.base_prefix), scratch)


def _expose(path: Path, scratch: Path) -> None:
    """An image gives its Python to every user; this machine's may sit under a directory only root may enter
    (pyenv under /root). In this mount namespace such a directory becomes a tmpfs that holds only the way to the
    interpreter, bound from the original: nothing else of it shows."""
    for depth, ancestor in enumerate(reversed(path.parents)):
        if ancestor == Path("/") or os.stat(ancestor).st_mode & 0o001:
            continue
        child = path.parents[len(path.parents) - depth - 2] if depth + 1 < len(path.parents) else path
        keep = scratch / f"exposed{depth}"
        keep.mkdir()
        subprocess.run(["mount", "--bind", str(child), str(keep)], check=True)
        subprocess.run(["mount", "-t", "tmpfs", "-o", "mode=0755", "tmpfs", str(ancestor)], check=True)
        child.mkdir()
        subprocess.run(["mount", "--bind", str(keep), str(child)], check=True)


def boot(document_path: Path, sandbox: Path) -> int:
    text = document_path.read_text()
    if not text.startswith("#cloud-config\n"):
        print("not a cloud-config document", file=sys.stderr)
        return 2
    doc = json.loads(text.removeprefix("#cloud-config\n"))
    _mount_sandbox(sandbox)
    bin_dir = sandbox / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    systemctl = bin_dir / "systemctl"
    systemctl.write_text(f"#!/bin/sh\nexec {sys.executable} {Path(__file__).resolve()} systemctl {sandbox} \"$@\"\n")
    systemctl.chmod(0o755)
    for f in doc.get("write_files", []):
        path = Path(f["path"])
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f["content"])
        path.chmod(int(f.get("permissions", "0644"), 8))
        user, _, group = f.get("owner", "root:root").partition(":")
        os.chown(path, pwd.getpwnam(user).pw_uid, pwd.getpwnam(group or user).pw_gid)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    for argv in doc.get("runcmd", []):
        done = subprocess.run(argv, env=env, check=False)
        if done.returncode != 0:
            print(f"runcmd {argv} exited {done.returncode}", file=sys.stderr)
            return 1
    return 0


def _unit(name: str) -> dict[str, list[str]]:
    service: dict[str, list[str]] = {}
    section = ""
    for line in (UNIT_DIR / name).read_text().splitlines():
        if line.startswith("["):
            section = line.strip("[]")
        elif "=" in line and section == "Service":
            key, _, value = line.partition("=")
            service.setdefault(key, []).append(value)
    return service


def systemctl(sandbox: Path, args: list[str]) -> int:
    verbs = [a for a in args if not a.startswith("--")]
    if not verbs or verbs[0] == "daemon-reload":
        return 0
    if verbs[0] not in ("enable", "start") or len(verbs) != 2:
        print(f"systemctl {' '.join(args)}: not simulated", file=sys.stderr)
        return 1
    if verbs[0] == "enable" and "--now" not in args:
        return 0
    name = verbs[1]
    unit = _unit(name)
    user = pwd.getpwnam(unit.get("User", ["root"])[0])
    env = {k: v for k, v in os.environ.items() if k.startswith(("AWS_", "PYTHON", "NO_PROXY", "no_proxy"))}
    env.update({"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "HOME": user.pw_dir,
                "USER": user.pw_name})
    for value in unit.get("Environment", []):
        k, _, v = value.partition("=")
        env[k] = v
    for directory in unit.get("RuntimeDirectory", []):
        path = Path("/run") / directory
        path.mkdir(parents=True, exist_ok=True)
        os.chown(path, user.pw_uid, user.pw_gid)
        path.chmod(int(unit.get("RuntimeDirectoryMode", ["0755"])[0], 8))
        env["RUNTIME_DIRECTORY"] = str(path)
    umask = int(unit.get("UMask", ["0022"])[0], 8)
    logs = sandbox / "logs"
    logs.mkdir(exist_ok=True)
    out = open(logs / f"{name}.log", "ab")  # noqa: SIM115 - the unit's process keeps it
    cwd = unit.get("WorkingDirectory", ["/"])[0]

    def as_user() -> None:
        os.setsid()
        os.umask(umask)
        os.setgroups([])
        os.setgid(user.pw_gid)
        os.setuid(user.pw_uid)

    subprocess.Popen(unit["ExecStart"][0].split(), env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=out,
                     stderr=out, preexec_fn=as_user)
    return 0


if __name__ == "__main__":
    if sys.argv[1] == "boot":
        raise SystemExit(boot(Path(sys.argv[2]), Path(sys.argv[3])))
    raise SystemExit(systemctl(Path(sys.argv[2]), sys.argv[3:]))
