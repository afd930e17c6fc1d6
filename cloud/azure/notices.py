"""Azure Scheduled Events on the VM itself: `ScheduledEventsSource` turns them into `Notice`s and approves them.

Azure tells a VM what will happen to it through the instance metadata service (IMDS), not through a fleet-wide
queue: https://learn.microsoft.com/azure/virtual-machines/linux/scheduled-events. Lead times (`NotBefore`):

| EventType | what happens | notice | our kind |
| --- | --- | --- | --- |
| Preempt | spot eviction | at least 30 s | eviction |
| Terminate | the VM is deleted (scale-in, user) | configurable, 5-15 min | eviction |
| Freeze | paused for seconds (host maintenance) | 15 min | scheduled_maintenance |
| Reboot | rebooted | 15 min | scheduled_maintenance |
| Redeploy | moved to another host (local disk lost) | 10 min | scheduled_maintenance |

Approving an event (`acknowledge`) lets Azure act before `NotBefore`: useful once our planned move is done. IMDS is
only reachable from the VM, over plain http on a link-local address, with the header `Metadata: true`. Only the
standard library is used: this runs on training nodes, which carry no cloud SDK.
"""

from __future__ import annotations

import email.utils
import json
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from typing import Any

from cloud.base import Notice, NoticeKind, NoticeSource, ServiceUnavailableError
from cloud.notices import IMDS_URL, SeenOnce, imds_opener

API_VERSION = "2020-07-01"
SOURCE = "scheduled-events"
PREEMPT_NOTICE_S = 30.0  # Azure's documented minimum for spot evictions, used when NotBefore is empty

_KINDS: Mapping[str, NoticeKind] = {
    "preempt": "eviction",
    "terminate": "eviction",
    "freeze": "scheduled_maintenance",
    "reboot": "scheduled_maintenance",
    "redeploy": "scheduled_maintenance",
}


class ScheduledEventsSource(NoticeSource):
    """Polls this VM's Scheduled Events and reports each event that concerns `vm_name` once (by EventId).

    `vm_name` is the VM's name as Azure knows it (the instance id of `AzureProvider`); events for other VMs of the
    same availability set or scale set appear in the same document and are ignored.
    """

    def __init__(self, vm_name: str, *, endpoint: str = IMDS_URL, timeout_s: float = 1.0) -> None:
        self.vm_name = vm_name
        self.endpoint = endpoint.rstrip("/")
        self.timeout_s = timeout_s
        self._seen: SeenOnce[str] = SeenOnce()
        self._opener = imds_opener()  # IMDS must be reached directly: Azure refuses proxied IMDS calls

    def __repr__(self) -> str:
        return f"ScheduledEventsSource(vm_name={self.vm_name!r}, endpoint={self.endpoint!r})"

    @property
    def url(self) -> str:
        return f"{self.endpoint}/metadata/scheduledevents?api-version={API_VERSION}"

    def poll(self) -> list[Notice]:
        document = self._request("GET")
        received_at = time.time()
        notices: list[Notice] = []
        for event in document.get("Events") or []:
            event_id = str(event.get("EventId") or "")
            resources = {str(r).lower() for r in event.get("Resources") or []}
            if not event_id or self.vm_name.lower() not in resources or not self._seen.first_time(event_id):
                continue
            event_type = str(event.get("EventType") or "")
            kind = _KINDS.get(event_type.lower(), "scheduled_maintenance")
            deadline_at = _parse_not_before(str(event.get("NotBefore") or ""))
            if deadline_at is None and event_type.lower() == "preempt":
                deadline_at = received_at + PREEMPT_NOTICE_S
            notices.append(
                Notice(
                    kind=kind,
                    instance_id=self.vm_name,
                    received_at=received_at,
                    source=SOURCE,
                    deadline_at=deadline_at,
                    event_id=event_id,
                    detail=f"{event_type} ({event.get('EventStatus', '')}) {event.get('Description', '')}".strip(),
                )
            )
        return notices

    def acknowledge(self, event_id: str) -> None:
        """Approve `event_id` so that Azure may act now rather than at NotBefore."""
        self._request("POST", {"StartRequests": [{"EventId": event_id}]})

    def _request(self, method: str, payload: Mapping[str, Any] | None = None) -> dict[str, Any]:
        data = None if payload is None else json.dumps(payload).encode()
        headers = {"Metadata": "true"}
        if data is not None:
            headers["Content-Type"] = "application/json"
        request = urllib.request.Request(self.url, data=data, headers=headers, method=method)
        try:
            with self._opener.open(request, timeout=self.timeout_s) as response:
                raw = response.read()
        except (urllib.error.URLError, TimeoutError, OSError) as err:
            raise ServiceUnavailableError(
                f"azure: Scheduled Events at {self.endpoint} did not answer {method} ({err}); this works only on an "
                "Azure VM, and the first call after boot can take up to 2 minutes while the service starts",
                provider="azure",
                code="ScheduledEventsUnavailable",
            ) from err
        if not raw:
            return {}
        try:
            document = json.loads(raw)
        except ValueError as err:
            raise ServiceUnavailableError(
                f"azure: Scheduled Events answered {method} with something that is not JSON", provider="azure"
            ) from err
        return document if isinstance(document, dict) else {}


def _parse_not_before(text: str) -> float | None:
    """NotBefore is an RFC 1123 date ("Mon, 19 Sep 2016 18:29:47 GMT"), or empty once the event has started."""
    if not text:
        return None
    try:
        return email.utils.parsedate_to_datetime(text).timestamp()
    except (TypeError, ValueError):
        return None
