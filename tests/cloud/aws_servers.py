"""Local servers the AWS tests talk to over HTTP: moto's server, a fault-injecting proxy in front of it, and a
fake instance metadata service (IMDSv2).

moto answers the EC2/SQS/EventBridge/STS calls but never throttles or runs out of capacity, so `FaultProxy`
answers chosen actions itself (with EC2's own XML error format and status code) a set number of times and
forwards everything else. It also records each request's action and parameters, so a test can see what the
provider actually sent. moto 5.2.5 has no placement groups at all: `PlacementGroups` emulates the three calls the
provider makes, behind the same proxy.
"""

from __future__ import annotations

import fnmatch
import http.client
import json
import threading
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from typing import Any
from urllib.parse import parse_qs, urlsplit

from moto.server import ThreadedMotoServer

from tests.cloud.loopback import LoopbackServer, QuietHandler, StartedOnDemand, send_reply

_HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "te", "trailer", "upgrade"}


@contextmanager
def moto_server(ip_address: str = "127.0.0.1") -> Iterator[str]:
    """moto's server on a free port of `ip_address`, in this process; yields its URL and stops it afterwards."""
    server = ThreadedMotoServer(ip_address=ip_address, port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        yield f"http://{host}:{port}"
    finally:
        server.stop()


def _error_xml(root: str, error: str, request_id_tag: str) -> bytes:
    """An XML error body: `error` and a fresh request id (in `request_id_tag`) inside `root`."""
    request_id = f"<{request_id_tag}>{uuid.uuid4()}</{request_id_tag}>"
    return f'<?xml version="1.0" encoding="UTF-8"?>\n<{root}>{error}{request_id}</{root}>'.encode()


def ec2_error_xml(code: str, message: str) -> bytes:
    """An error body exactly as EC2 sends it (https://docs.aws.amazon.com/AWSEC2/latest/APIReference/errors-overview.html)."""
    error = f"<Errors><Error><Code>{code}</Code><Message>{message}</Message></Error></Errors>"
    return _error_xml("Response", error, "RequestID")


def query_error_xml(code: str, message: str) -> bytes:
    """An error body of the other query-protocol services (STS)."""
    error = f"<Error><Type>Sender</Type><Code>{code}</Code><Message>{message}</Message></Error>"
    return _error_xml("ErrorResponse", error, "RequestId")


@dataclass
class _Rule:
    action: str
    status: int
    body: bytes
    times: int
    dry_run: bool | None  # None: any request; True/False: only requests with/without DryRun=true
    when: Callable[[dict[str, Any]], bool] | None = None  # only requests whose parameters satisfy this


@dataclass
class Seen:
    """One request that reached the proxy."""

    service: str
    action: str
    params: dict[str, Any]
    answered_by_proxy: bool

    @property
    def dry_run(self) -> bool:
        return str(self.params.get("DryRun", "")).lower() == "true"


@dataclass
class FaultProxy(StartedOnDemand):
    """An HTTP proxy in front of `upstream` that answers chosen actions itself and forwards the rest."""

    upstream: str
    _rules: list[_Rule] = field(default_factory=list)
    _seen: list[Seen] = field(default_factory=list)
    # Actions the proxy always answers itself (what moto lacks); kept across `reset`.
    _emulated: dict[str, Callable[[dict[str, Any]], tuple[int, bytes]]] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _server: LoopbackServer | None = None

    @property
    def url(self) -> str:
        return self._url()

    def fail(
        self,
        action: str,
        code: str,
        *,
        status: int,
        times: int = 1,
        dry_run: bool | None = None,
        when: Callable[[dict[str, Any]], bool] | None = None,
    ) -> None:
        """Answer the next `times` requests for `action` (whose parameters satisfy `when`, if given) with the AWS
        error `code` and HTTP `status`."""
        body = ec2_error_xml(code, f"Injected {code}")
        with self._lock:
            self._rules.append(_Rule(action, status, body, times, dry_run, when))

    def answer(self, action: str, body: str, *, times: int = 1) -> None:
        """Answer the next `times` requests for `action` with `body` (HTTP 200)."""
        with self._lock:
            self._rules.append(_Rule(action, 200, body.encode(), times, None))

    def emulate(self, action: str, handler: Callable[[dict[str, Any]], tuple[int, bytes]]) -> None:
        """Answer every request for `action` with `handler(params)` -> (HTTP status, body), instead of moto."""
        with self._lock:
            self._emulated[action] = handler

    def seen(self, action: str | None = None) -> list[Seen]:
        with self._lock:
            return [s for s in self._seen if action is None or s.action == action]

    def reset(self) -> None:
        with self._lock:
            self._rules.clear()
            self._seen.clear()

    def start(self) -> None:
        proxy = self

        class Handler(QuietHandler):
            def do_POST(self) -> None:
                proxy._handle(self)

            def do_GET(self) -> None:
                proxy._handle(self)

            def do_PUT(self) -> None:
                proxy._handle(self)

            def do_DELETE(self) -> None:
                proxy._handle(self)

        self._server = LoopbackServer(Handler, "fault-proxy").start()

    # request handling ---------------------------------------------------------------------------------------

    def _handle(self, handler: BaseHTTPRequestHandler) -> None:
        length = int(handler.headers.get("Content-Length") or 0)
        body = handler.rfile.read(length) if length else b""
        service, action, params = _describe_request(handler, body)
        rule = self._take_rule(action, params)
        with self._lock:
            emulated = self._emulated.get(action) if rule is None else None
            self._seen.append(Seen(service, action, params, rule is not None or emulated is not None))
        if emulated is not None:
            status, payload = emulated(params)
            self._reply(handler, status, {"Content-Type": "text/xml"}, payload)
            return
        if rule is not None:
            payload = rule.body
            if rule.status >= 400 and service != "ec2":
                payload = query_error_xml(*_code_and_message(rule.body))
            self._reply(handler, rule.status, {"Content-Type": "text/xml"}, payload)
            return
        target = urlsplit(self.upstream)
        connection = http.client.HTTPConnection(target.hostname or "127.0.0.1", target.port, timeout=60)
        try:
            headers = {k: v for k, v in handler.headers.items() if k.lower() not in _HOP_BY_HOP}
            connection.request(handler.command, handler.path, body=body, headers=headers)
            response = connection.getresponse()
            payload = response.read()
            out_headers = {k: v for k, v in response.getheaders() if k.lower() not in _HOP_BY_HOP}
            self._reply(handler, response.status, out_headers, payload)
        finally:
            connection.close()

    def _take_rule(self, action: str, params: dict[str, Any]) -> _Rule | None:
        dry_run = str(params.get("DryRun", "")).lower() == "true"
        with self._lock:
            for rule in self._rules:
                if (
                    rule.action == action
                    and rule.times > 0
                    and rule.dry_run in (None, dry_run)
                    and (rule.when is None or rule.when(params))
                ):
                    rule.times -= 1
                    return rule
        return None

    @staticmethod
    def _reply(handler: BaseHTTPRequestHandler, status: int, headers: dict[str, str], payload: bytes) -> None:
        send_reply(handler, status, payload, {**headers, "Connection": "close"})


def _code_and_message(ec2_body: bytes) -> tuple[str, str]:
    text = ec2_body.decode()
    code = text.split("<Code>", 1)[1].split("</Code>", 1)[0]
    message = text.split("<Message>", 1)[1].split("</Message>", 1)[0]
    return code, message


def _describe_request(handler: BaseHTTPRequestHandler, body: bytes) -> tuple[str, str, dict[str, Any]]:
    """(service, action, parameters) of an AWS request: query protocol (EC2, STS) or JSON protocol (SQS, events)."""
    authorization = handler.headers.get("Authorization", "")
    service = ""
    if "Credential=" in authorization:
        # Credential=AKID/20260101/us-east-1/ec2/aws4_request
        scope = authorization.split("Credential=", 1)[1].split(",", 1)[0].split("/")
        service = scope[3] if len(scope) > 3 else ""
    target = handler.headers.get("X-Amz-Target")
    if target:
        try:
            params = json.loads(body or b"{}")
        except json.JSONDecodeError:
            params = {}
        return service, target.rsplit(".", 1)[-1], params if isinstance(params, dict) else {}
    query = parse_qs(body.decode("utf-8", "replace"), keep_blank_values=True)
    query.update(parse_qs(urlsplit(handler.path).query, keep_blank_values=True))
    params = {key: values[-1] for key, values in query.items()}
    return service, str(params.get("Action", "")), params


_EC2_NS = "http://ec2.amazonaws.com/doc/2016-11-15/"


def _numbered(params: dict[str, Any], prefix: str) -> list[str]:
    """The values of `prefix.1`, `prefix.2`, ... in a flattened query."""
    values, n = [], 1
    while f"{prefix}.{n}" in params:
        values.append(str(params[f"{prefix}.{n}"]))
        n += 1
    return values


class PlacementGroups:
    """EC2 placement groups as CreatePlacementGroup, DescribePlacementGroups (GroupName.N, Filter group-name and
    tag:KEY) and DeletePlacementGroup answer, in EC2's XML; moto 5.2.5 implements none of them. Like moto, it does
    not refuse to delete a group that instances are still in."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.groups: dict[str, dict[str, Any]] = {}  # name -> {"id", "strategy", "tags"}

    def install(self, proxy: FaultProxy) -> None:
        proxy.emulate("CreatePlacementGroup", self._create)
        proxy.emulate("DescribePlacementGroups", self._describe)
        proxy.emulate("DeletePlacementGroup", self._delete)

    def _item(self, name: str) -> str:
        group = self.groups[name]
        tags = "".join(f"<item><key>{k}</key><value>{v}</value></item>" for k, v in group["tags"].items())
        return (
            f"<groupName>{name}</groupName><state>available</state><strategy>{group['strategy']}</strategy>"
            f"<groupId>{group['id']}</groupId><tagSet>{tags}</tagSet>"
        )

    def _create(self, params: dict[str, Any]) -> tuple[int, bytes]:
        name = str(params.get("GroupName", ""))
        tags: dict[str, str] = {}
        for n in range(1, 10):
            if params.get(f"TagSpecification.{n}.ResourceType") == "placement-group":
                m = 1
                while f"TagSpecification.{n}.Tag.{m}.Key" in params:
                    tags[params[f"TagSpecification.{n}.Tag.{m}.Key"]] = params[f"TagSpecification.{n}.Tag.{m}.Value"]
                    m += 1
        with self._lock:
            if name in self.groups:
                return 400, ec2_error_xml("InvalidPlacementGroup.Duplicate", f"The group '{name}' already exists.")
            self.groups[name] = {"id": f"pg-{uuid.uuid4().hex[:17]}", "strategy": params.get("Strategy"), "tags": tags}
            item = self._item(name)
        return 200, (
            f'<CreatePlacementGroupResponse xmlns="{_EC2_NS}"><requestId>{uuid.uuid4()}</requestId>'
            f"<placementGroup>{item}</placementGroup></CreatePlacementGroupResponse>"
        ).encode()

    def _describe(self, params: dict[str, Any]) -> tuple[int, bytes]:
        wanted_names = set(_numbered(params, "GroupName"))
        filters = {
            str(params[f"Filter.{n}.Name"]): set(_numbered(params, f"Filter.{n}.Value"))
            for n in range(1, 10)
            if f"Filter.{n}.Name" in params
        }
        with self._lock:
            items = []
            for name, group in self.groups.items():
                if wanted_names and name not in wanted_names:
                    continue
                if "group-name" in filters and name not in filters["group-name"]:
                    continue
                tag_filters = {k[len("tag:"):]: v for k, v in filters.items() if k.startswith("tag:")}
                if any(group["tags"].get(key) not in values for key, values in tag_filters.items()):
                    continue
                items.append(f"<item>{self._item(name)}</item>")
        return 200, (
            f'<DescribePlacementGroupsResponse xmlns="{_EC2_NS}"><requestId>{uuid.uuid4()}</requestId>'
            f"<placementGroupSet>{''.join(items)}</placementGroupSet></DescribePlacementGroupsResponse>"
        ).encode()

    def _delete(self, params: dict[str, Any]) -> tuple[int, bytes]:
        name = str(params.get("GroupName", ""))
        with self._lock:
            if self.groups.pop(name, None) is None:
                return 400, ec2_error_xml("InvalidPlacementGroup.Unknown", f"The Placement Group '{name}' is unknown.")
        return 200, (
            f'<DeletePlacementGroupResponse xmlns="{_EC2_NS}"><requestId>{uuid.uuid4()}</requestId>'
            "<return>true</return></DeletePlacementGroupResponse>"
        ).encode()


_IAM_NS = "https://iam.amazonaws.com/doc/2010-05-08/"


class IamSimulator:
    """IAM's SimulatePrincipalPolicy (moto 5.2.5 lacks it), evaluating the principal's policy as IAM does for what
    job policies use: Action and Resource patterns with `*` and `?`, the condition operators StringEquals,
    StringLike, ArnEquals, ArnLike, Bool and ForAllValues:StringEquals over the request's context entries (a key
    the request does not carry fails a condition, but passes ForAllValues), an explicit Deny over any Allow.
    `policy` None allows everything (a principal with AdministratorAccess, as moto behaves). It also answers STS's
    GetCallerIdentity with `caller_arn`, an assumed role's session by default (moto names its caller in a form AWS
    never returns, `arn:aws:sts::ACCOUNT:user/moto`)."""

    ACCOUNT = "123456789012"  # moto's

    def __init__(self, page_size: int = 1000,
                 caller_arn: str = f"arn:aws:sts::{ACCOUNT}:assumed-role/trainmover-orchestrator/check") -> None:
        self.policy: dict[str, Any] | None = None
        self.page_size = page_size
        self.caller_arn = caller_arn
        self.requests: list[dict[str, Any]] = []

    def install(self, proxy: FaultProxy) -> None:
        proxy.emulate("SimulatePrincipalPolicy", self._simulate)
        proxy.emulate("GetCallerIdentity", self._caller)

    def reset(self) -> None:
        self.policy = None
        self.requests.clear()

    def _caller(self, params: dict[str, Any]) -> tuple[int, bytes]:
        return 200, (
            '<GetCallerIdentityResponse xmlns="https://sts.amazonaws.com/doc/2011-06-15/"><GetCallerIdentityResult>'
            f"<Arn>{self.caller_arn}</Arn><UserId>AROAEXAMPLE:check</UserId><Account>{self.ACCOUNT}</Account>"
            f"</GetCallerIdentityResult><ResponseMetadata><RequestId>{uuid.uuid4()}</RequestId></ResponseMetadata>"
            "</GetCallerIdentityResponse>"
        ).encode()

    def _simulate(self, params: dict[str, Any]) -> tuple[int, bytes]:
        actions = _members(params, "ActionNames")
        resources = _members(params, "ResourceArns") or ["*"]
        context: dict[str, list[str]] = {}
        n = 1
        while f"ContextEntries.member.{n}.ContextKeyName" in params:
            key = str(params[f"ContextEntries.member.{n}.ContextKeyName"]).lower()
            context[key] = _members(params, f"ContextEntries.member.{n}.ContextKeyValues")
            n += 1
        self.requests.append({"principal": params.get("PolicySourceArn"), "actions": actions,
                              "resources": resources, "context": context})
        rows = [(a, [(r, self._decide(a, r, context)) for r in resources]) for a in actions]
        start = int(params.get("Marker") or 0)
        page = rows[start:start + self.page_size]
        more = start + self.page_size < len(rows)
        members = "".join(
            "<member>"
            f"<EvalActionName>{action}</EvalActionName><EvalResourceName>*</EvalResourceName>"
            f"<EvalDecision>{_overall(decisions)}</EvalDecision>"
            "<ResourceSpecificResults>" + "".join(
                f"<member><EvalResourceName>{r}</EvalResourceName><EvalResourceDecision>{d}</EvalResourceDecision>"
                "</member>" for r, d in decisions) + "</ResourceSpecificResults>"
            "</member>"
            for action, decisions in page
        )
        marker = f"<Marker>{start + self.page_size}</Marker>" if more else ""
        return 200, (
            f'<SimulatePrincipalPolicyResponse xmlns="{_IAM_NS}"><SimulatePrincipalPolicyResult>'
            f"<IsTruncated>{str(more).lower()}</IsTruncated>{marker}<EvaluationResults>{members}</EvaluationResults>"
            "</SimulatePrincipalPolicyResult>"
            f"<ResponseMetadata><RequestId>{uuid.uuid4()}</RequestId></ResponseMetadata>"
            "</SimulatePrincipalPolicyResponse>"
        ).encode()

    def _decide(self, action: str, resource: str, context: dict[str, list[str]]) -> str:
        if self.policy is None:
            return "allowed"
        allowed = False
        for statement in self.policy["Statement"]:
            if not (_any_match(statement["Action"], action, fold=True)
                    and _any_match(statement.get("Resource", "*"), resource)
                    and _conditions_hold(statement.get("Condition", {}), context)):
                continue
            if statement["Effect"] == "Deny":
                return "explicitDeny"
            allowed = True
        return "allowed" if allowed else "implicitDeny"


def _members(params: dict[str, Any], prefix: str) -> list[str]:
    return _numbered(params, f"{prefix}.member")


def _overall(decisions: list[tuple[str, str]]) -> str:
    for worst in ("explicitDeny", "implicitDeny"):
        if any(d == worst for _, d in decisions):
            return worst
    return "allowed"


def _any_match(patterns: str | list[str], value: str, *, fold: bool = False) -> bool:
    for pattern in [patterns] if isinstance(patterns, str) else patterns:
        p, v = (pattern.lower(), value.lower()) if fold else (pattern, value)
        if fnmatch.fnmatchcase(v, p.replace("[", "[[]")):
            return True
    return False


def _conditions_hold(condition: dict[str, dict[str, Any]], context: dict[str, list[str]]) -> bool:
    for operator, keys in condition.items():
        for key, allowed in keys.items():
            wanted = [allowed] if isinstance(allowed, str) else list(allowed)
            given = context.get(key.lower())
            if operator.startswith("ForAllValues:"):
                if given is not None and not all(v in wanted for v in given):
                    return False
                continue
            if not given:
                return False
            if operator in ("StringEquals", "ArnEquals"):
                ok = any(v in wanted for v in given)
            elif operator in ("StringLike", "ArnLike"):
                ok = any(_any_match(wanted, v) for v in given)
            elif operator == "Bool":
                ok = any(v.lower() in [w.lower() for w in wanted] for v in given)
            else:
                raise ValueError(f"IamSimulator: condition operator {operator} is not emulated")
            if not ok:
                return False
    return True


@contextmanager
def fault_proxy(upstream: str) -> Iterator[FaultProxy]:
    proxy = FaultProxy(upstream)
    proxy.start()
    try:
        yield proxy
    finally:
        proxy.stop()


# ------------------------------------------------------------------------------------------------ IMDS


class ImdsServer(StartedOnDemand):
    """A fake EC2 instance metadata service with IMDSv2 tokens; the test sets what it posts."""

    def __init__(self) -> None:
        self.spot_action: dict[str, str] | None = None
        self.rebalance: dict[str, str] | None = None
        self.token_requests: list[int] = []  # the TTL each token request asked for
        self._tokens: set[str] = set()
        self._gets: dict[str, int] = {}
        self._cond = threading.Condition()

    @property
    def url(self) -> str:
        return self._url()

    def post_spot_action(self, action: str, when: str) -> None:
        with self._cond:
            self.spot_action = {"action": action, "time": when}

    def post_rebalance(self, notice_time: str) -> None:
        with self._cond:
            self.rebalance = {"noticeTime": notice_time}

    def revoke_tokens(self) -> None:
        """As if every token expired: the next request with one gets 401."""
        with self._cond:
            self._tokens.clear()

    def gets(self, path: str) -> int:
        with self._cond:
            return self._gets.get(path, 0)

    def wait_for_gets(self, path: str, count: int, timeout_s: float) -> bool:
        """Wait until `path` was answered at least `count` times; False after `timeout_s`."""
        with self._cond:
            return self._cond.wait_for(lambda: self._gets.get(path, 0) >= count, timeout=timeout_s)

    def start(self) -> None:
        imds = self

        class Handler(QuietHandler):
            def do_PUT(self) -> None:
                ttl = self.headers.get("X-aws-ec2-metadata-token-ttl-seconds")
                if self.path != "/latest/api/token" or ttl is None or not ttl.isdigit():
                    self._send(400, b"")
                    return
                token = uuid.uuid4().hex
                with imds._cond:
                    imds._tokens.add(token)
                    imds.token_requests.append(int(ttl))
                self._send(200, token.encode())

            def do_GET(self) -> None:
                with imds._cond:
                    # Counted as it arrives: a client polls one path after another, so once a path has been asked
                    # for n times, the client has finished n - 1 polls.
                    imds._gets[self.path] = imds._gets.get(self.path, 0) + 1
                    imds._cond.notify_all()
                    if self.headers.get("X-aws-ec2-metadata-token") not in imds._tokens:
                        status, body = 401, b""
                    elif self.path == "/latest/meta-data/spot/instance-action" and imds.spot_action:
                        status, body = 200, json.dumps(imds.spot_action).encode()
                    elif self.path == "/latest/meta-data/events/recommendations/rebalance" and imds.rebalance:
                        status, body = 200, json.dumps(imds.rebalance).encode()
                    else:
                        status, body = 404, b""
                self._send(status, body)

            def _send(self, status: int, body: bytes) -> None:
                send_reply(self, status, body)

        self._server = LoopbackServer(Handler, "imds").start()


@contextmanager
def imds_server() -> Iterator[ImdsServer]:
    server = ImdsServer()
    server.start()
    try:
        yield server
    finally:
        server.stop()
