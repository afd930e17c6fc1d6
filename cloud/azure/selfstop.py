"""The Azure half of a host's dead-man's switch: a VM whose agent gave up on its job deallocates itself.

An OS poweroff leaves an Azure VM stopped but allocated, which still bills its compute. So when the agent exits with
its dead-man's status (no coordinator of its job reachable for `orphan_timeout_s`), the unit's stop step runs this
module as root before powering off: it reads the VM's own resource id from the instance metadata service, gets an
ARM token for the VM's system-assigned identity there, and asks ARM to deallocate the VM
(`POST {resource id}/deallocate`). The launch let that identity do so on its own VM only
(`cloud.azure.identities.SelfDeallocation`). Standard library only; never through a proxy (metadata is link-local).

    python -m cloud.azure.selfstop [--imds URL] [--arm URL] [--attempts N]

Exit status 0 when ARM accepted the request (the platform then shuts the VM down and releases its compute), 1
otherwise, saying why on stderr (the unit powers off either way).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

IMDS = "http://169.254.169.254"
ARM = "https://management.azure.com"
IMDS_API = "2021-02-01"
TOKEN_API = "2018-02-01"
COMPUTE_API = "2024-07-01"
"""The Compute API version the request names (the provider's own, `cloud.azure.client`)."""
TIMEOUT_S = 10.0

_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _request(url: str, *, headers: dict[str, str], method: str = "GET") -> tuple[int, bytes]:
    request = urllib.request.Request(url, headers=headers, method=method, data=b"" if method == "POST" else None)
    try:
        with _DIRECT.open(request, timeout=TIMEOUT_S) as answer:
            return int(answer.status), answer.read()
    except urllib.error.HTTPError as err:
        return int(err.code), err.read()


def own_resource_id(imds: str = IMDS) -> str:
    """This VM's ARM resource id, from the instance metadata service."""
    status, body = _request(f"{imds}/metadata/instance/compute/resourceId?api-version={IMDS_API}&format=text",
                            headers={"Metadata": "true"})
    rid = body.decode(errors="replace").strip()
    if status != 200 or not rid.startswith("/subscriptions/") or "/virtualMachines/" not in rid:
        raise RuntimeError(f"the instance metadata service gave no VM resource id (HTTP {status})")
    return rid


def arm_token(imds: str = IMDS, arm: str = ARM) -> str:
    """An ARM access token for this VM's system-assigned identity, from the instance metadata service."""
    resource = urllib.parse.quote(arm.rstrip("/") + "/", safe="")
    status, body = _request(f"{imds}/metadata/identity/oauth2/token?api-version={TOKEN_API}&resource={resource}",
                            headers={"Metadata": "true"})
    try:
        token: Any = json.loads(body)["access_token"]
    except (ValueError, KeyError, TypeError):
        token = None
    if status != 200 or not isinstance(token, str) or not token:
        raise RuntimeError(f"no token for the VM's identity (HTTP {status}): does the VM have a system-assigned "
                           "identity?")
    return token


def deallocate(resource_id: str, token: str, arm: str = ARM) -> int:
    """Ask ARM to deallocate the VM; ARM's HTTP status (200 or 202: accepted)."""
    status, _ = _request(f"{arm.rstrip('/')}{resource_id}/deallocate?api-version={COMPUTE_API}",
                         headers={"Authorization": f"Bearer {token}"}, method="POST")
    return status


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m cloud.azure.selfstop",
                                description="Deallocate this Azure VM through its own managed identity.")
    p.add_argument("--imds", default=IMDS, help="the instance metadata service (default: %(default)s)")
    p.add_argument("--arm", default=ARM, help="Azure Resource Manager (default: %(default)s)")
    p.add_argument("--attempts", type=int, default=3, help="tries, 5 s apart (default: %(default)s)")
    ns = p.parse_args(argv)
    why = "nothing tried"
    for attempt in range(1, max(ns.attempts, 1) + 1):
        try:
            rid = own_resource_id(ns.imds)
            status = deallocate(rid, arm_token(ns.imds, ns.arm), ns.arm)
            if status in (200, 202):
                print(f"trainmover: asked Azure to deallocate {rid.rsplit('/', 1)[-1]} (HTTP {status})",
                      file=sys.stderr)
                return 0
            why = f"ARM refused the deallocation (HTTP {status})" + (
                ": the VM's identity lacks Microsoft.Compute/virtualMachines/deallocate/action on the VM "
                "(the launch grants it: docs/cloud-azure.md)" if status in (401, 403) else "")
        except (OSError, RuntimeError) as exc:
            why = str(exc)
        if attempt < ns.attempts:
            time.sleep(5)  # metadata or ARM busy: a few tries, bounded
    print(f"trainmover: could not deallocate this VM: {why}; it powers off and stays allocated (billed) until the "
          "job is released", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
