"""AWS early warnings as `Notice` records: on the node from instance metadata (IMDSv2), fleet-wide from EventBridge.

`ImdsNoticeSource` runs on an instance and polls its own metadata service (stdlib `urllib` only, so the training
image needs no SDK; never through a proxy). `parse_event` turns one EventBridge event, as EventBridge delivers it to
an SQS queue, into a `NoticeEvent`: its envelope (source, account, region) and its notices. `event_refusal` says why
an event must not move anything (a source, account or region other than the job's). The AWS provider's
`poll_notices` reads the queue, applies it, and keeps only the notices of the job's own instances.
`ensure_notice_queue` / `delete_notice_queue` (one `NoticeQueue`) make and remove that SQS queue and its
EventBridge rules.

AWS documents the shapes parsed here:
- spot interruption: https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/spot-instance-termination-notices.html
- rebalance recommendation: https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/rebalance-recommendations.html
- IMDSv2: https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/configuring-instance-metadata-service.html
- AWS Health events: https://docs.aws.amazon.com/health/latest/ug/aws-health-events-eventbridge-schema.html
"""

from __future__ import annotations

import json
import logging
import re
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime
from typing import TYPE_CHECKING, Any, Literal, Required, TypedDict, Unpack

from cloud.aws.client import AwsApi
from cloud.base import (
    JOB_TAG,
    MUTATE,
    CloudError,
    NotFoundError,
    Notice,
    NoticeSource,
    ReleaseSteps,
    RetryBudget,
    ServiceUnavailableError,
    UnsupportedError,
    validate_job_id,
)
from cloud.notices import IMDS_URL, SeenOnce, imds_opener

if TYPE_CHECKING:
    import boto3

log = logging.getLogger(__name__)

SPOT_NOTICE_S = 120.0  # AWS gives two minutes between the interruption warning and the action
SPOT_INTERRUPTION = "EC2 Spot Instance Interruption Warning"
REBALANCE_RECOMMENDATION = "EC2 Instance Rebalance Recommendation"
HEALTH_EVENT = "AWS Health Event"

# Which AWS service sends each event we act on. EventBridge refuses PutEvents with an "aws." source from anyone but
# AWS, so a message whose source is right came from EventBridge's own delivery, not from a caller's put_events.
SOURCE_OF: Mapping[str, str] = {
    SPOT_INTERRUPTION: "aws.ec2",
    REBALANCE_RECOMMENDATION: "aws.ec2",
    HEALTH_EVENT: "aws.health",
}

_TOKEN_PATH = "/latest/api/token"
SPOT_ACTION_PATH = "/latest/meta-data/spot/instance-action"
REBALANCE_PATH = "/latest/meta-data/events/recommendations/rebalance"
# Refresh the token this long before AWS would expire it, so that a poll never races the expiry.
_TOKEN_MARGIN_S = 30.0
_SEEN_MAX = 1024


def parse_time(text: str) -> float:
    """Epoch seconds of an AWS timestamp: ISO 8601 ("2026-01-01T00:00:00Z") or RFC 2822 (AWS Health's
    "Sat, 05 Jun 2021 15:10:09 GMT"). ValueError when it is neither."""
    text = text.strip()
    try:
        moment = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        try:
            moment = parsedate_to_datetime(text)
        except (TypeError, ValueError, IndexError) as err:
            raise ValueError(f"not an ISO 8601 or RFC 2822 time: {text!r}") from err
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return moment.timestamp()


def _instance_id_of(resource: str) -> str:
    """`i-0abc` from `arn:aws:ec2:us-east-1a:instance/i-0abc` (EventBridge `resources`) or `i-0abc` itself."""
    return resource.rsplit("/", 1)[-1]


# ------------------------------------------------------------------------------------------------ EventBridge


@dataclass(frozen=True, slots=True)
class NoticeEvent:
    """One EventBridge event as it arrived: who sent it and from where (checked before it moves anything), and the
    notices it carries (none for an event of a kind we do not act on)."""

    event_id: str | None
    source: str
    account: str
    region: str
    detail_type: str
    notices: tuple[Notice, ...]


def parse_event(body: str, *, received_at: float) -> NoticeEvent:
    """The event in one SQS message body. ValueError when the body is not such an event (the error names what is
    wrong, never quotes the body: a body is not ours to log)."""
    try:
        event = json.loads(body)
    except json.JSONDecodeError as err:
        raise ValueError(f"not JSON: {err.msg} at character {err.pos}") from err
    if not isinstance(event, dict) or not isinstance(event.get("detail"), dict):
        raise ValueError("not an EventBridge event: no 'detail' object")
    detail_type = event.get("detail-type")
    detail: dict[str, Any] = event["detail"]
    event_id = str(event.get("id") or "")
    notices: list[Notice] = []
    if detail_type in (SPOT_INTERRUPTION, REBALANCE_RECOMMENDATION):
        instance_id = detail.get("instance-id") or next(
            (_instance_id_of(r) for r in event.get("resources") or [] if isinstance(r, str)), None
        )
        if not isinstance(instance_id, str) or not instance_id:
            raise ValueError(f"{detail_type} without an instance id")
        if detail_type == REBALANCE_RECOMMENDATION:
            notices = [
                Notice("rebalance_recommendation", instance_id, received_at, "eventbridge", None, event_id or None)
            ]
        else:
            notices = [
                Notice(
                    "spot_interruption",
                    instance_id,
                    received_at,
                    "eventbridge",
                    _spot_deadline(event, detail, received_at),
                    event_id or None,
                    f"instance-action={detail.get('instance-action', 'terminate')}",
                )
            ]
    elif detail_type == HEALTH_EVENT:
        notices = _health_notices(event, detail, event_id, received_at)
    return NoticeEvent(
        event_id=event_id or None,
        source=_text(event.get("source")),
        account=_text(event.get("account")),
        region=_text(event.get("region")),
        detail_type=_text(detail_type),
        notices=tuple(notices),
    )


def _text(value: object) -> str:
    return value if isinstance(value, str) else ""


def _shown(value: str) -> str:
    """A value from a message, short enough for a log line."""
    return repr(value if len(value) <= 40 else f"{value[:37]}...")


Check = Literal["malformed", "kind", "source", "account", "region", "instance"]


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why a queue message moved nothing: the check it failed, and a detail fit for a log line (never the body)."""

    check: Check
    detail: str


def event_refusal(event: NoticeEvent, *, account_id: str, region: str) -> Refusal | None:
    """Why `event` must not move anything, or None when its envelope is the job's: a kind we act on, sent by the
    AWS service that sends that kind, for `account_id`, in `region`. (Whether its instances are the job's is the
    provider's check: it needs EC2.)"""
    expected_source = SOURCE_OF.get(event.detail_type)
    if expected_source is None or not event.notices:
        return Refusal("kind", f"not a notice we act on (detail-type {_shown(event.detail_type)})")
    if event.source != expected_source:
        return Refusal("source", f"source {_shown(event.source)} is not {expected_source!r} for {event.detail_type}")
    if event.account != account_id:
        # Account ids are not secrets, but a log line needs only enough of one to tell accounts apart.
        return Refusal("account", f"account ...{event.account[-4:]} is not the job's account ...{account_id[-4:]}")
    if event.region != region:
        return Refusal("region", f"region {_shown(event.region)} is not the provider's region {region!r}")
    return None


def notices_from_event(body: str, *, received_at: float) -> list[Notice]:
    """The notices in one EventBridge event (an SQS message body), unchecked: an event of another kind gives []; a
    body that is not such an event raises ValueError. Use `parse_event` and `event_refusal` to act on a queue."""
    return list(parse_event(body, received_at=received_at).notices)


def _spot_deadline(event: Mapping[str, Any], detail: Mapping[str, Any], received_at: float) -> float:
    # EventBridge's detail carries only the action ("terminate"/"stop"/"hibernate"); the instance metadata carries
    # its time. Prefer an explicit time if one is there, else the event's time plus AWS's fixed two minutes.
    for key in ("instance-action-time", "time"):
        value = detail.get(key)
        if isinstance(value, str):
            return parse_time(value)
    when = event.get("time")
    return (parse_time(when) if isinstance(when, str) else received_at) + SPOT_NOTICE_S


def _health_notices(
    event: Mapping[str, Any], detail: Mapping[str, Any], event_id: str, received_at: float
) -> list[Notice]:
    if str(detail.get("service", "")).upper() != "EC2" or detail.get("eventTypeCategory") != "scheduledChange":
        return []
    instance_ids = [
        str(entity["entityValue"])
        for entity in detail.get("affectedEntities") or []
        if isinstance(entity, dict) and str(entity.get("entityValue", "")).startswith("i-")
    ] or [_instance_id_of(r) for r in event.get("resources") or [] if isinstance(r, str) and "i-" in r]
    if not instance_ids:
        raise ValueError("AWS Health EC2 event without an affected instance")
    start = detail.get("startTime")
    deadline = parse_time(start) if isinstance(start, str) else None
    code = str(detail.get("eventTypeCode", ""))
    return [
        Notice(
            "scheduled_maintenance",
            instance_id,
            received_at,
            "eventbridge",
            deadline,
            f"{event_id}:{instance_id}" if event_id else None,
            code,
        )
        for instance_id in instance_ids
    ]


# ------------------------------------------------------------------------------------------------ IMDS


class ImdsNoticeSource(NoticeSource):
    """The spot interruption and rebalance notices of the instance it runs on, from IMDSv2.

    Each `poll` makes at most three requests (token when needed, two metadata paths), each bounded by
    `timeout_s`. A notice is returned once: polling again while it is still posted returns nothing new.
    """

    def __init__(
        self,
        instance_id: str,
        *,
        endpoint: str = IMDS_URL,
        timeout_s: float = 1.0,
        token_ttl_s: int = 21600,
    ) -> None:
        if not 1 <= token_ttl_s <= 21600:
            # IMDSv2 refuses a TTL outside 1 s .. 6 h with 400.
            raise ValueError(f"token_ttl_s must be within 1..21600, got {token_ttl_s}")
        self.instance_id = instance_id
        self.endpoint = endpoint.rstrip("/")
        self.timeout_s = timeout_s
        self.token_ttl_s = token_ttl_s
        self._token: str | None = None
        self._token_expires_at = 0.0  # time.monotonic()
        self._opener = imds_opener()  # never through a proxy: it must never see the token
        self._seen: SeenOnce[str] = SeenOnce(_SEEN_MAX)

    def __repr__(self) -> str:  # never show the token
        return f"ImdsNoticeSource(instance_id={self.instance_id!r}, endpoint={self.endpoint!r})"

    def _unreachable(self, err: BaseException) -> ServiceUnavailableError:
        return ServiceUnavailableError(
            f"instance metadata at {self.endpoint} unreachable ({err}); on EC2 check that the metadata service "
            "is enabled and, in a container, that the hop limit is at least 2",
            provider="aws",
        )

    def poll(self) -> list[Notice]:
        notices: list[Notice] = []
        spot = self._get_json(SPOT_ACTION_PATH)
        if spot is not None:
            notices += self._new(self._spot_notice(spot))
        rebalance = self._get_json(REBALANCE_PATH)
        if rebalance is not None:
            notices += self._new(self._rebalance_notice(rebalance))
        return notices

    def _new(self, notice: Notice | None) -> list[Notice]:
        if notice is None or not self._seen.first_time(notice.event_id or ""):
            return []
        return [notice]

    def _spot_notice(self, body: Mapping[str, Any]) -> Notice | None:
        action, when = body.get("action"), body.get("time")
        if not isinstance(when, str):
            log.warning("IMDS spot/instance-action without a time, ignored: %r", body)
            return None
        try:
            deadline = parse_time(when)
        except ValueError:
            log.warning("IMDS spot/instance-action with an unreadable time, ignored: %r", body)
            return None
        return Notice(
            "spot_interruption",
            self.instance_id,
            time.time(),
            "imds",
            deadline,
            f"imds:spot:{action}:{when}",
            f"instance-action={action}",
        )

    def _rebalance_notice(self, body: Mapping[str, Any]) -> Notice | None:
        when = body.get("noticeTime")
        if not isinstance(when, str):
            log.warning("IMDS rebalance recommendation without noticeTime, ignored: %r", body)
            return None
        return Notice("rebalance_recommendation", self.instance_id, time.time(), "imds", None, f"imds:rebalance:{when}")

    # HTTP ----------------------------------------------------------------------------------------------------

    def _get_json(self, path: str) -> dict[str, Any] | None:
        """The JSON object at `path`, or None when IMDS answers 404 (nothing posted)."""
        for attempt in range(2):
            request = urllib.request.Request(
                self.endpoint + path, headers={"X-aws-ec2-metadata-token": self._current_token()}
            )
            try:
                with self._opener.open(request, timeout=self.timeout_s) as response:
                    raw = response.read()
            except urllib.error.HTTPError as err:
                if err.code == 404:
                    return None
                if err.code == 401 and attempt == 0:
                    # The token expired or IMDS restarted: fetch a new one and ask once more.
                    self._token = None
                    continue
                raise ServiceUnavailableError(
                    f"instance metadata answered {err.code} for {path}", provider="aws", code=str(err.code)
                ) from err
            except (urllib.error.URLError, TimeoutError, OSError) as err:
                raise self._unreachable(err) from err
            try:
                body = json.loads(raw)
            except json.JSONDecodeError:
                log.warning("IMDS %s is not JSON, ignored", path)
                return None
            return body if isinstance(body, dict) else None
        raise ServiceUnavailableError(f"instance metadata refused a fresh token for {path} (401)", provider="aws")

    def _current_token(self) -> str:
        if self._token is not None and time.monotonic() < self._token_expires_at:
            return self._token
        request = urllib.request.Request(
            self.endpoint + _TOKEN_PATH,
            method="PUT",
            headers={"X-aws-ec2-metadata-token-ttl-seconds": str(self.token_ttl_s)},
        )
        try:
            with self._opener.open(request, timeout=self.timeout_s) as response:
                token: str = response.read().decode("ascii").strip()
        except urllib.error.HTTPError as err:
            if err.code == 403:
                raise UnsupportedError(
                    "instance metadata is disabled on this instance (token request refused with 403): enable it "
                    "with `aws ec2 modify-instance-metadata-options --http-endpoint enabled`",
                    provider="aws",
                    code="403",
                ) from err
            raise ServiceUnavailableError(
                f"instance metadata token request failed ({err.code})", provider="aws", code=str(err.code)
            ) from err
        except (urllib.error.URLError, TimeoutError, OSError) as err:
            raise self._unreachable(err) from err
        self._token = token
        self._token_expires_at = time.monotonic() + max(1.0, self.token_ttl_s - _TOKEN_MARGIN_S)
        return token


# ------------------------------------------------------------------------------------------------ notice queue

_NOTICE_PATTERNS: Mapping[str, dict[str, Any]] = {
    "spot": {"source": ["aws.ec2"], "detail-type": [SPOT_INTERRUPTION]},
    "rebalance": {"source": ["aws.ec2"], "detail-type": [REBALANCE_RECOMMENDATION]},
    "health": {
        "source": ["aws.health"],
        "detail-type": [HEALTH_EVENT],
        "detail": {"service": ["EC2"], "eventTypeCategory": ["scheduledChange"]},
    },
}
_TARGET_ID = "trainmover-sqs"


def notice_resource_names(job_id: str) -> tuple[str, dict[str, str]]:
    """The SQS queue name and the EventBridge rule names (by kind) used for `job_id`'s notices."""
    validate_job_id(job_id, provider="aws")
    safe = re.sub(r"[^A-Za-z0-9_-]", "-", job_id)
    if safe != job_id or len(safe) > 32:
        # Keep names distinct when sanitizing or truncating would make two job ids collide.
        safe = f"{safe[:23]}-{uuid.uuid5(uuid.NAMESPACE_URL, job_id).hex[:8]}"
    # Queue names: 80 characters of [A-Za-z0-9_-]; rule names: 64 of [.-_A-Za-z0-9].
    return f"trainmover-notices-{safe}", {kind: f"trainmover-{safe}-{kind}" for kind in _NOTICE_PATTERNS}


class QueueWhere(TypedDict, total=False):
    """Where a job's notice queue is: the keyword arguments of `ensure_notice_queue` and `delete_notice_queue`."""

    region: Required[str]
    session: boto3.Session | None
    endpoint_url: str | None
    budget: RetryBudget


class NoticeQueue:
    """The SQS queue and EventBridge rules that deliver one job's notices (`ensure_notice_queue` makes them,
    `delete_notice_queue` removes them)."""

    def __init__(
        self,
        job_id: str,
        *,
        region: str,
        session: boto3.Session | None = None,
        endpoint_url: str | None = None,
        budget: RetryBudget = MUTATE,
    ) -> None:
        self.job_id = job_id
        self.budget = budget
        self.api = AwsApi(region, session, endpoint_url)
        self.queue_name, self.rule_names = notice_resource_names(job_id)

    def ensure(self) -> str:
        """Create (or update, idempotently) the queue and rules; returns the queue URL."""
        queue_url = str(
            self.api.call(
                "sqs",
                "create_queue",
                self.budget,
                QueueName=self.queue_name,
                # A notice older than a day is history; the same attributes every time keep CreateQueue idempotent.
                Attributes={"MessageRetentionPeriod": "86400"},
                tags={JOB_TAG: self.job_id},
            )["QueueUrl"]
        )
        attributes = self.api.call(
            "sqs", "get_queue_attributes", self.budget, QueueUrl=queue_url, AttributeNames=["QueueArn"]
        )
        queue_arn = attributes["Attributes"]["QueueArn"]
        rule_arns = []
        for kind, rule_name in self.rule_names.items():
            rule = self.api.call(
                "events",
                "put_rule",
                self.budget,
                Name=rule_name,
                EventPattern=json.dumps(_NOTICE_PATTERNS[kind]),
                State="ENABLED",
                Description=f"TrainMover notices ({kind}) for job {self.job_id}",
                Tags=[{"Key": JOB_TAG, "Value": self.job_id}],
            )
            rule_arns.append(rule["RuleArn"])
            self.api.call(
                "events", "put_targets", self.budget, Rule=rule_name, Targets=[{"Id": _TARGET_ID, "Arn": queue_arn}]
            )
        # EventBridge needs the queue's permission to send, and only from these rules.
        # https://docs.aws.amazon.com/eventbridge/latest/userguide/eb-use-resource-based.html#eb-sqs-permissions
        policy = {
            "Version": "2012-10-17",
            "Statement": [
                {
                    "Sid": "TrainMoverNotices",
                    "Effect": "Allow",
                    "Principal": {"Service": "events.amazonaws.com"},
                    "Action": "sqs:SendMessage",
                    "Resource": queue_arn,
                    "Condition": {"ArnEquals": {"aws:SourceArn": rule_arns}},
                }
            ],
        }
        self.api.call(
            "sqs", "set_queue_attributes", self.budget, QueueUrl=queue_url, Attributes={"Policy": json.dumps(policy)}
        )
        return queue_url

    def delete(self) -> None:
        """Remove the queue and rules; what is already gone is not an error. A CloudError names every deletion that
        failed (the others still happened)."""
        steps = ReleaseSteps()
        self.release(steps, denied_is_failure=True)
        if steps.failed:
            raise CloudError(f"aws: could not delete {'; '.join(steps.failed)}", provider="aws")

    def release(self, steps: ReleaseSteps, *, denied_is_failure: bool = False) -> None:
        """Delete the rules, then the queue, each recorded in `steps` ("EventBridge rule NAME", "SQS queue NAME").
        A permission denied is recorded as not looked for unless `denied_is_failure`: the per-job policy made with
        --no-notice-wiring lets the job's credentials read the queue only, since an administrator manages it."""
        denied = None if denied_is_failure else "an administrator manages the job's notice queue and rules"
        for rule_name in self.rule_names.values():
            steps.run(f"EventBridge rule {rule_name}", lambda rule_name=rule_name: self._delete_rule(rule_name),  # type: ignore[misc]
                      if_denied=denied)
        steps.run(f"SQS queue {self.queue_name}", self._delete_queue, if_denied=denied)

    def _delete_rule(self, rule_name: str) -> bool:
        try:
            # EventBridge deletes only a rule without targets; RemoveTargets also tells a rule that is not there
            # (DeleteRule succeeds either way).
            self.api.call("events", "remove_targets", self.budget, Rule=rule_name, Ids=[_TARGET_ID])
        except NotFoundError:
            return False
        self.api.call("events", "delete_rule", self.budget, Name=rule_name)
        return True

    def _delete_queue(self) -> bool:
        try:
            queue_url = self.api.call("sqs", "get_queue_url", self.budget, QueueName=self.queue_name)["QueueUrl"]
            self.api.call("sqs", "delete_queue", self.budget, QueueUrl=queue_url)
        except NotFoundError:
            return False
        return True


def ensure_notice_queue(job_id: str, **where: Unpack[QueueWhere]) -> str:
    """Create (or update, idempotently) the SQS queue and EventBridge rules that deliver `job_id`'s notices;
    returns the queue URL for `AwsProvider(notice_queue_url=...)`. `where`: `region=` (required), `session=`,
    `endpoint_url=`, `budget=` (default MUTATE).

    Rules: spot interruption warnings, rebalance recommendations, and AWS Health scheduled changes for EC2. They
    match every instance of the account in `region` (EventBridge cannot filter these events by tag); consumers
    pick their own instance ids.
    """
    return NoticeQueue(job_id, **where).ensure()


def delete_notice_queue(job_id: str, **where: Unpack[QueueWhere]) -> None:
    """Remove what `ensure_notice_queue` made for `job_id` (the same `where`); what is already gone is not an error."""
    NoticeQueue(job_id, **where).delete()
