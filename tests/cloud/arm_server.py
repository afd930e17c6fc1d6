"""Local stand-ins for the Azure endpoints the provider talks to, so the real SDK runs against real HTTP.

`ArmServer` speaks exactly the ARM REST routes `cloud.azure.AzureProvider` calls (VM PUT/GET/DELETE/list, tag
updates (PATCH), start, deallocate, powerOff (only to prove it is never called), VM sizes, resource SKUs (GPU counts),
effective permissions at a resource group or a resource, role assignments at any scope: PUT/GET/DELETE of one and the
list with ARM's `$filter`s) over HTTPS with a throw-away CA, including real long-running-operation behaviour: 201/202
answers that carry `Azure-AsyncOperation` and `Location` headers, which the SDK polls until the operation reports
Succeeded or Failed. Faults are injected per operation (`inject`). A VM created with a system-assigned identity gets a
principal id (a GUID: `principal_id(vm)`), and customData is never returned, as on ARM. A VM's NICs and OS disk are
stored as resources of their own, deleted with the VM when their deleteOption says so (`resources(kind)` lists them).
No Azure compute emulator exists, hence this server.

`ImdsServer` serves the instance metadata Scheduled Events document over plain http, as 169.254.169.254 does.

Why HTTPS: azure-core's bearer-token policy refuses to send a token over plain http. Serving TLS with a CA that
the test hands to the client (`connection_verify=<ca file>`) keeps the SDK's pipeline exactly as in production;
no `enforce_https=False` per call, no custom authentication policy, no swapped transport.
"""

from __future__ import annotations

import datetime
import ipaddress
import json
import re
import ssl
import threading
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

from tests.cloud.loopback import LoopbackServer, MadeWithServer, QuietHandler, send_reply

# ------------------------------------------------------------------------------------------------------ TLS


def make_tls_files(directory: Path) -> tuple[Path, Path, Path]:
    """A CA and a 127.0.0.1 server certificate it signed: (ca_pem, cert_pem, key_pem), valid for one day."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "trainmover test CA")])
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    ca_path, cert_path, key_path = directory / "ca.pem", directory / "server.pem", directory / "server-key.pem"
    ca_path.write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return ca_path, cert_path, key_path


# ------------------------------------------------------------------------------------------------------ records


@dataclass(frozen=True, slots=True)
class Recorded:
    """One request the server received."""

    method: str
    path: str
    query: Mapping[str, str]
    body: Any
    headers: Mapping[str, str]


@dataclass(slots=True)
class Fault:
    """An injected failure of one operation: `skip` matching calls pass first, then `times` calls fail.

    `in_operation`: the initial call is accepted and the long-running operation ends Failed with this error
    (how ARM reports AllocationFailed); otherwise the initial call itself answers `status`. The op `poll` (any
    operation) or `poll:<kind>` (e.g. `poll:create`) fails the status polls of long-running operations instead,
    as a busy ARM answers 429 with Retry-After to a poll while the operation goes on. Role assignments fail with
    `put:roleAssignments`, `delete:roleAssignments` and `list:roleAssignments`.
    """

    op: str
    code: str
    status: int = 400
    message: str = "injected by the test"
    times: int = 1
    skip: int = 0
    retry_after_s: int | None = None
    in_operation: bool = False


@dataclass(slots=True)
class _Vm:
    name: str
    location: str
    tags: dict[str, str]
    zones: list[str] | None
    properties: dict[str, Any]
    identity: dict[str, Any] | None = None
    provisioning: str = "Creating"
    power: str | None = "starting"
    created_at: str = field(default_factory=lambda: datetime.datetime.now(datetime.UTC).isoformat())
    vm_id: str = field(default_factory=lambda: str(uuid.uuid4()))


@dataclass(slots=True)
class _Operation:
    op_id: str
    vm: str
    kind: str  # create | update | start | deallocate | powerOff | delete
    polls_left: int
    error: dict[str, str] | None = None
    status: str = "InProgress"


# ------------------------------------------------------------------------------------------------------ ARM server


class ArmServer(MadeWithServer):
    """A threaded HTTPS server for one subscription, its resource groups and locations.

    `locations` maps a location to the VM sizes offered there. `permissions` is the effective-permissions answer
    (`[{"actions": [...], "notActions": [...]}]`), full access by default. Each long-running operation reports
    InProgress for `polls_per_operation` status polls before it finishes.
    """

    scheme = "https"

    def __init__(
        self,
        tls_dir: Path,
        *,
        subscription_id: str,
        resource_groups: Sequence[str],
        locations: Mapping[str, Sequence[str]],
        polls_per_operation: int = 2,
    ) -> None:
        self.subscription_id = subscription_id
        self.resource_groups = {rg.lower() for rg in resource_groups}
        self.locations = {loc.lower(): list(sizes) for loc, sizes in locations.items()}
        self.polls_per_operation = polls_per_operation
        self.permissions: list[dict[str, list[str]]] = [{"actions": ["*"], "notActions": []}]
        # The effective permissions at other scopes (a Key Vault's resource id, lower case); `permissions` otherwise.
        self.scope_permissions: dict[str, list[dict[str, list[str]]]] = {}
        self.requests: list[Recorded] = []
        self.faults: list[Fault] = []
        self._vms: dict[tuple[str, str], _Vm] = {}  # (resource group, vm name), lower case
        # Network security groups, application security groups, proximity placement groups:
        # (resource group, type, name), lower case -> the resource as stored
        self._resources: dict[tuple[str, str, str], dict[str, Any]] = {}
        self._operations: dict[str, _Operation] = {}
        # Role assignments: assignment name (a GUID, lower case) -> the assignment as ARM returns it.
        self._role_assignments: dict[str, dict[str, Any]] = {}
        self._lock = threading.Lock()
        self.ca_path, cert_path, key_path = make_tls_files(tls_dir)
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(cert_path, key_path)
        self._server = LoopbackServer(_make_handler(self), "arm-server", tls=context)

    # ---------------------------------------------------------------------------------- test-side helpers

    def inject(self, fault: Fault) -> None:
        with self._lock:
            self.faults.append(fault)

    def vm_names(self, resource_group: str | None = None) -> list[str]:
        with self._lock:
            return sorted(vm.name for (rg, _), vm in self._vms.items() if resource_group in (None, rg))

    def vm(self, name: str, resource_group: str) -> dict[str, Any]:
        """The VM as stored: tags, properties as PUT, provisioning and power state."""
        with self._lock:
            record = self._vms[(resource_group.lower(), name.lower())]
            return {
                "tags": dict(record.tags),
                "zones": record.zones,
                "properties": json.loads(json.dumps(record.properties)),
                "provisioning": record.provisioning,
                "power": record.power,
                "identity": record.identity,
            }

    def principal_id(self, name: str, resource_group: str) -> str:
        """The principal id (a GUID) of the VM's system-assigned identity."""
        identity = self.vm(name, resource_group)["identity"] or {}
        return str(identity["principalId"])

    def role_assignments(self, scope_prefix: str = "") -> list[dict[str, Any]]:
        """The stored role assignments whose scope starts with `scope_prefix` (any case), as ARM answers them."""
        with self._lock:
            found = [json.loads(json.dumps(a)) for a in self._role_assignments.values()]
        return [a for a in found if a["properties"]["scope"].lower().startswith(scope_prefix.lower())]

    def calls(self, method: str | None = None, pattern: str = "") -> list[Recorded]:
        """The recorded requests with this method whose path matches the regex `pattern` (case-insensitive)."""
        with self._lock:
            found = list(self.requests)
        return [r for r in found if method in (None, r.method) and re.search(pattern, r.path, re.IGNORECASE)]

    # ---------------------------------------------------------------------------------- request handling

    def handle(self, method: str, raw_path: str, headers: Mapping[str, str], body: Any) -> _Reply:
        parts = urlsplit(raw_path)
        query = {k: v[0] for k, v in parse_qs(parts.query).items()}
        with self._lock:
            self.requests.append(Recorded(method, parts.path, query, body, dict(headers)))
            if not headers.get("authorization", "").startswith("Bearer "):
                return _error(401, "AuthenticationFailed", "no bearer token")
            if "api-version" not in query:
                return _error(400, "MissingApiVersionParameter", "api-version is required")
            return self._route(method, parts.path, query, body)

    def _route(self, method: str, path: str, query: Mapping[str, str], body: Any) -> _Reply:
        sub = re.escape(self.subscription_id)
        path = "/" + path.lstrip("/")  # "/{scope}/providers/..." with a scope given as "/subscriptions/...", as ARM
        m = re.fullmatch(r"(/subscriptions/.+)/providers/Microsoft\.Authorization/roleAssignments(?:/([^/]+))?", path,
                         re.I)
        if m:
            return self._role_assignment(method, m.group(1), m.group(2), query, body)
        m = re.fullmatch(r"(/subscriptions/.+/providers/.+)/providers/Microsoft\.Authorization/permissions", path, re.I)
        if m and method == "GET":  # at a resource (a Key Vault): the resource-group route below has its own
            fault = self._fault("permissions")
            if fault is not None:
                return _fault_reply(fault)
            if query.get("api-version") != "2022-04-01":
                return _error(400, "InvalidApiVersionParameter", query.get("api-version", ""))
            return _Reply(200, {"value": self.scope_permissions.get(m.group(1).lower(), self.permissions)})
        m = re.fullmatch(rf"/subscriptions/{sub}/providers/Microsoft\.Compute/locations/([^/]+)/vmSizes", path, re.I)
        if m and method == "GET":
            return self._sizes(m.group(1))
        if re.fullmatch(rf"/subscriptions/{sub}/providers/Microsoft\.Compute/skus", path, re.I) and method == "GET":
            return self._skus(query.get("$filter"))
        m = re.fullmatch(
            rf"/subscriptions/{sub}/providers/Microsoft\.Compute/locations/[^/]+/(operations|operationResults)/([^/]+)",
            path,
            re.I,
        )
        if m and method == "GET":
            return self._operation(m.group(2), result=m.group(1).lower() == "operationresults")
        m = re.fullmatch(rf"/subscriptions/{sub}/resourceGroups/([^/]+)/providers/(.+)", path, re.I)
        if not m:
            return _error(404, "NoRouteInTestServer", f"{method} {path}")
        rg, rest = m.group(1).lower(), m.group(2)
        if rg not in self.resource_groups:
            return _error(404, "ResourceGroupNotFound", f"Resource group '{m.group(1)}' could not be found.")
        if re.fullmatch(r"Microsoft\.Authorization/permissions", rest, re.I) and method == "GET":
            fault = self._fault("permissions")
            if fault is not None:
                return _fault_reply(fault)
            if query.get("api-version") != "2022-04-01":
                return _error(400, "InvalidApiVersionParameter", query.get("api-version", ""))
            return _Reply(200, {"value": self.permissions})
        if re.fullmatch(r"Microsoft\.Compute/virtualMachines", rest, re.I) and method == "GET":
            fault = self._fault("list")
            if fault is not None:
                return _fault_reply(fault)
            vms = [self._vm_json(rg, vm, expand=False) for (g, _), vm in self._vms.items() if g == rg]
            return _Reply(200, {"value": vms})
        m = re.fullmatch(_OTHER_RESOURCES, rest, re.I)
        if m:
            return self._resource(method, rg, m.group(1), m.group(2), body)
        m = re.fullmatch(r"Microsoft\.Compute/virtualMachines/([^/]+)(?:/(start|deallocate|powerOff))?", rest, re.I)
        if not m:
            return _error(404, "NoRouteInTestServer", f"{method} {path}")
        name, verb = m.group(1), (m.group(2) or "")
        key = (rg, name.lower())
        if verb and method == "POST":
            return self._power_action(key, verb.lower())
        if not verb and method == "PUT":
            return self._put(rg, name, body)
        if not verb and method == "PATCH":
            return self._patch(rg, key, body)
        if not verb and method == "GET":
            fault = self._fault("get")
            if fault is not None:
                return _fault_reply(fault)
            vm = self._vms.get(key)
            if vm is None:
                return _not_found(name)
            return _Reply(200, self._vm_json(rg, vm, expand=query.get("$expand") == "instanceView"))
        if not verb and method == "DELETE":
            return self._delete(key)
        return _error(405, "MethodNotAllowed", f"{method} {path}")

    def resources(self, kind: str) -> dict[str, dict[str, Any]]:
        """The stored resources of `kind` (e.g. "Microsoft.Network/networkSecurityGroups") by name."""
        with self._lock:
            return {name: json.loads(json.dumps(r)) for (_, t, name), r in self._resources.items()
                    if t == kind.lower()}

    def _resource(self, method: str, rg: str, kind: str, name: str, body: Any) -> _Reply:
        """PUT (synchronous, as ARM answers a resource that provisions at once), GET and DELETE of an NSG, an ASG or
        a proximity placement group; a DELETE of one that a VM still references is refused, as ARM does."""
        key = (rg, kind.lower(), name.lower())
        rid = f"/subscriptions/{self.subscription_id}/resourceGroups/{rg}/providers/{kind}/{name}"
        if method == "PUT":
            fault = self._fault(f"put:{kind.rsplit('/', 1)[-1]}")
            if fault is not None:
                return _fault_reply(fault)
            if str((body or {}).get("location", "")).lower() not in self.locations:
                return _error(400, "LocationNotAvailableForResourceType", str((body or {}).get("location")))
            created = key not in self._resources
            props = {**dict((body or {}).get("properties") or {}), "provisioningState": "Succeeded"}
            self._resources[key] = {"id": rid, "name": name, "type": kind, "location": body["location"],
                                    "tags": dict(body.get("tags") or {}), "properties": props}
            return _Reply(201 if created else 200, self._resources[key])
        if method == "GET":
            found = self._resources.get(key)
            return _Reply(200, found) if found is not None else _error(404, "ResourceNotFound", f"{kind}/{name}")
        if method == "DELETE":
            if key not in self._resources:
                return _Reply(204, None)
            users = [vm.name for vm in self._vms.values() if rid.lower() in json.dumps(vm.properties).lower()]
            if users:
                return _error(400, f"InUse{kind.rsplit('/', 1)[-1][:-1]}CannotBeDeleted",
                              f"{kind}/{name} is in use by {', '.join(sorted(users))}")
            del self._resources[key]
            return _Reply(200, None)
        return _error(405, "MethodNotAllowed", f"{method} {kind}/{name}")

    def _role_assignment(self, method: str, scope: str, name: str | None, query: Mapping[str, str], body: Any
                         ) -> _Reply:
        """Role assignments as ARM's Microsoft.Authorization RP keeps them (api-version 2022-04-01): a PUT of an
        identical assignment answers it again, a PUT that would change one is refused
        (RoleAssignmentUpdateNotPermitted), and one for a principal, role and scope that another name already assigns
        is refused (RoleAssignmentExists);
        a DELETE of one that is gone answers 204. The list answers assignments at, above and below `scope`, or with
        `$filter=atScope()` at or above it, `principalId eq '<id>'` / `assignedTo('<id>')` for one principal, or both
        joined by `and`. https://learn.microsoft.com/rest/api/authorization/role-assignments"""
        if query.get("api-version") != ROLE_ASSIGNMENTS_API_VERSION:
            return _error(400, "InvalidApiVersionParameter",
                          f"The api-version '{query.get('api-version')}' is invalid for roleAssignments.")
        if name is None:
            if method != "GET":
                return _error(405, "MethodNotAllowed", f"{method} roleAssignments")
            fault = self._fault("list:roleAssignments")
            if fault is not None:
                return _fault_reply(fault)
            return self._list_role_assignments(scope, query.get("$filter"))
        if not _GUID.fullmatch(name):
            return _error(400, "InvalidRoleAssignmentId", f"The role assignment ID '{name}' is not valid. The role "
                          "assignment ID must be a GUID.")
        key = name.lower()
        found = self._role_assignments.get(key)
        if found is not None and found["properties"]["scope"].lower() != scope.lower():
            found = None if method != "PUT" else found
        if method == "GET":
            return _Reply(200, found) if found is not None else _error(
                404, "RoleAssignmentNotFound", f"The role assignment '{name}' is not found.")
        if method == "DELETE":
            fault = self._fault("delete:roleAssignments")
            if fault is not None:
                return _fault_reply(fault)
            if found is None:
                return _Reply(204, None)
            del self._role_assignments[key]
            return _Reply(200, found)
        if method != "PUT":
            return _error(405, "MethodNotAllowed", f"{method} roleAssignments/{name}")
        fault = self._fault("put:roleAssignments")
        if fault is not None:
            return _fault_reply(fault)
        props = dict((body or {}).get("properties") or {})
        principal, role = str(props.get("principalId") or ""), str(props.get("roleDefinitionId") or "")
        if not _GUID.fullmatch(principal) or not role:
            return _error(400, "InvalidRoleAssignmentRequest", "principalId (a GUID) and roleDefinitionId are required")
        wanted = {"roleDefinitionId": role, "principalId": principal,
                  "principalType": props.get("principalType") or "User", "description": props.get("description"),
                  "scope": scope}
        if found is not None:
            same = all(str(found["properties"].get(k) or "").lower() == str(v or "").lower()
                       for k, v in wanted.items())
            if not same:
                return _error(409, "RoleAssignmentUpdateNotPermitted", "Tenant ID, application ID, principal ID, and "
                              "scope are not allowed to be updated.")
            return _Reply(201, found)
        for other in self._role_assignments.values():
            p = other["properties"]
            if (p["scope"].lower(), p["principalId"].lower(), p["roleDefinitionId"].lower()) == (
                    scope.lower(), principal.lower(), role.lower()):
                return _error(409, "RoleAssignmentExists", "The role assignment already exists.")
        now = datetime.datetime.now(datetime.UTC).isoformat()
        assignment = {
            "id": f"{scope}/providers/Microsoft.Authorization/roleAssignments/{name}",
            "name": name, "type": "Microsoft.Authorization/roleAssignments",
            "properties": {**wanted, "createdOn": now, "updatedOn": now, "condition": None, "conditionVersion": None},
        }
        self._role_assignments[key] = assignment
        return _Reply(201, assignment)

    def _list_role_assignments(self, scope: str, filter_: str | None) -> _Reply:
        at_or_above_only, principal = False, None
        for clause in re.split(r"\s+and\s+", filter_.strip(), flags=re.I) if filter_ else []:
            m = re.fullmatch(r"principalId\s+eq\s+'?([0-9a-fA-F-]{36})'?|assignedTo\('([0-9a-fA-F-]{36})'\)", clause,
                             re.I)
            if re.fullmatch(r"atScope\(\)", clause, re.I):
                at_or_above_only = True
            elif m is not None:
                principal = (m.group(1) or m.group(2)).lower()
            else:
                return _error(400, "InvalidFilterInQueryString", f"unsupported $filter {filter_!r}")
        wanted = scope.lower().rstrip("/")
        value = []
        for assignment in self._role_assignments.values():
            at = assignment["properties"]["scope"].lower().rstrip("/")
            above_or_at = wanted == at or wanted.startswith(at + "/")
            below = at.startswith(wanted + "/")
            if not (above_or_at or (below and not at_or_above_only)):
                continue
            if principal is not None and assignment["properties"]["principalId"].lower() != principal:
                continue
            value.append(assignment)
        return _Reply(200, {"value": value})

    def _fault(self, op: str) -> Fault | None:
        for fault in self.faults:
            if fault.op != op or fault.times <= 0:
                continue
            if fault.skip > 0:
                fault.skip -= 1
                return None
            fault.times -= 1
            return fault
        return None

    def _sizes(self, location: str) -> _Reply:
        fault = self._fault("sizes")
        if fault is not None:
            return _fault_reply(fault)
        sizes = self.locations.get(location.lower())
        if sizes is None:
            # What ARM answers for a location name it does not know.
            return _error(
                400,
                "NoRegisteredProviderFound",
                f"No registered resource provider found for location '{location}' and API version for type "
                "'locations/vmSizes'.",
            )
        return _Reply(200, {"value": [{"name": s, "numberOfCores": 8, "memoryInMB": 32768} for s in sizes]})

    def _skus(self, filter_: str | None) -> _Reply:
        """The compute resource SKUs: every VM size of each location (`VM_SKU_CAPABILITIES`, or a plain CPU size),
        and a disk SKU, as ARM lists those too. ARM's only filter is `location eq '<name>'`; a location it does not
        know lists nothing."""
        fault = self._fault("skus")
        if fault is not None:
            return _fault_reply(fault)
        wanted: str | None = None
        if filter_ is not None:
            m = re.fullmatch(r"\s*location\s+eq\s+'([^']+)'\s*", filter_, re.I)
            if m is None:
                return _error(400, "InvalidFilterInQueryString", f"unsupported $filter {filter_!r}: only location")
            wanted = m.group(1).lower()
        value: list[dict[str, Any]] = []
        for location, sizes in self.locations.items():
            if wanted not in (None, location):
                continue
            value += [_vm_sku(size, location) for size in sizes]
            value.append({"resourceType": "disks", "name": "Premium_LRS", "tier": "Premium", "size": "P1",
                          "locations": [location], "capabilities": [{"name": "MaxSizeGiB", "value": "4"}],
                          "restrictions": []})
        return _Reply(200, {"value": value})

    def _put(self, rg: str, name: str, body: Any) -> _Reply:
        fault = self._fault("create")
        if fault is not None and not fault.in_operation:
            return _fault_reply(fault)
        props = dict(body.get("properties") or {})
        location = str(body.get("location", "")).lower()
        size = (props.get("hardwareProfile") or {}).get("vmSize", "")
        if location not in self.locations:
            return _error(400, "LocationNotAvailableForResourceType", f"location '{location}'")
        if size not in self.locations[location]:
            return _error(409, "SkuNotAvailable", f"The requested VM size {size} is not available in {location}.")
        key = (rg, name.lower())
        existing = self._vms.get(key)
        if existing is not None:
            existing.tags = dict(body.get("tags") or {})
            return _Reply(200, self._vm_json(rg, existing, expand=False))
        vm = _Vm(name, location, dict(body.get("tags") or {}), body.get("zones"), props, _identity(body))
        self._vms[key] = vm
        self._make_vm_parts(rg, vm)
        op = self._new_operation(name, "create", fault)
        return _Reply(201, self._vm_json(rg, vm, expand=False), self._lro_headers(location, op, with_location=False))

    def _patch(self, rg: str, key: tuple[str, str], body: Any) -> _Reply:
        """An update. Only tags are supported, replaced as a whole (ARM's PATCH semantics for `tags`)."""
        fault = self._fault("update")
        if fault is not None and not fault.in_operation:
            return _fault_reply(fault)
        vm = self._vms.get(key)
        if vm is None:
            return _not_found(key[1])
        unsupported = sorted(set(body or {}) - {"tags"})
        if unsupported:
            return _error(400, "NotSupportedInTestServer", f"PATCH of {unsupported}")
        if "tags" in body:
            vm.tags = dict(body["tags"] or {})
        op = self._new_operation(vm.name, "update", fault)
        return _Reply(200, self._vm_json(rg, vm, expand=False), self._lro_headers(vm.location, op, with_location=False))

    def _power_action(self, key: tuple[str, str], verb: str) -> _Reply:
        kind = {"start": "start", "deallocate": "deallocate", "poweroff": "powerOff"}[verb]
        fault = self._fault(kind)
        if fault is not None and not fault.in_operation:
            return _fault_reply(fault)
        vm = self._vms.get(key)
        if vm is None:
            return _not_found(key[1])
        vm.power = {"start": "starting", "deallocate": "deallocating", "powerOff": "stopping"}[kind]
        op = self._new_operation(vm.name, kind, fault)
        return _Reply(202, None, self._lro_headers(vm.location, op, with_location=True))

    def _delete(self, key: tuple[str, str]) -> _Reply:
        fault = self._fault("delete")
        if fault is not None and not fault.in_operation:
            return _fault_reply(fault)
        vm = self._vms.get(key)
        if vm is None:
            return _Reply(204, None)  # ARM: deleting what does not exist succeeds with no content
        vm.provisioning = "Deleting"
        op = self._new_operation(vm.name, "delete", fault)
        return _Reply(202, None, self._lro_headers(vm.location, op, with_location=True))

    def _make_vm_parts(self, rg: str, vm: _Vm) -> None:
        """The NICs (one per `networkInterfaceConfigurations` entry) and the OS disk that ARM creates with a VM,
        stored as resources ("Microsoft.Network/networkInterfaces", "Microsoft.Compute/disks") with their
        deleteOption, so that a test can list what a deleted VM left behind."""
        configs = (vm.properties.get("networkProfile") or {}).get("networkInterfaceConfigurations") or []
        os_disk = (vm.properties.get("storageProfile") or {}).get("osDisk") or {}
        parts = [("Microsoft.Network/networkInterfaces", str(c.get("name")),
                  (c.get("properties") or {}).get("deleteOption", "Detach")) for c in configs]
        parts.append(("Microsoft.Compute/disks", str(os_disk.get("name") or f"{vm.name}_OsDisk_1_{uuid.uuid4().hex}"),
                      os_disk.get("deleteOption", "Detach")))
        for kind, name, delete_option in parts:
            rid = f"/subscriptions/{self.subscription_id}/resourceGroups/{rg}/providers/{kind}/{name}"
            self._resources[(rg, kind.lower(), name.lower())] = {
                "id": rid, "name": name, "type": kind, "location": vm.location, "tags": {},
                "properties": {"provisioningState": "Succeeded", "deleteOption": delete_option, "vm": vm.name},
            }

    def _drop_vm_parts(self, rg: str, vm: _Vm) -> None:
        """What ARM deletes with a VM: its NICs and OS disk whose deleteOption is Delete (the others stay)."""
        for key, resource in list(self._resources.items()):
            props = resource["properties"]
            if key[0] == rg and props.get("vm") == vm.name and props.get("deleteOption") == "Delete":
                del self._resources[key]

    def _new_operation(self, vm_name: str, kind: str, fault: Fault | None) -> _Operation:
        error = {"code": fault.code, "message": fault.message} if fault is not None and fault.in_operation else None
        op = _Operation(str(uuid.uuid4()), vm_name, kind, self.polls_per_operation, error)
        self._operations[op.op_id] = op
        return op

    def _lro_headers(self, location: str, op: _Operation, *, with_location: bool) -> dict[str, str]:
        base = f"{self.url}/subscriptions/{self.subscription_id}/providers/Microsoft.Compute/locations/{location}"
        headers = {"Azure-AsyncOperation": f"{base}/operations/{op.op_id}?api-version=2026-04-01"}
        if with_location:
            headers["Location"] = f"{base}/operationResults/{op.op_id}?api-version=2026-04-01"
        return headers

    def _operation(self, op_id: str, *, result: bool) -> _Reply:
        op = self._operations.get(op_id)
        if op is None:
            return _error(404, "OperationNotFound", op_id)
        fault = self._fault(f"poll:{op.kind}") or self._fault("poll")
        if fault is not None:
            return _fault_reply(fault)  # the operation itself is unaffected: this poll did not count
        if result:
            return _Reply(202 if op.status == "InProgress" else 200, None)
        if op.status == "InProgress":
            op.polls_left -= 1
            if op.polls_left <= 0:
                self._finish(op)
        reply: dict[str, Any] = {"name": op.op_id, "status": op.status}
        if op.error is not None and op.status == "Failed":
            reply["error"] = op.error
        return _Reply(200, reply)

    def _finish(self, op: _Operation) -> None:
        key = next((k for k, vm in self._vms.items() if vm.name == op.vm), None)
        vm = self._vms.get(key) if key is not None else None
        op.status = "Failed" if op.error is not None else "Succeeded"
        if vm is None or key is None:
            return
        if op.kind == "create":
            vm.provisioning, vm.power = ("Failed", "deallocated") if op.error else ("Succeeded", "running")
        elif op.kind == "start":
            vm.power = "deallocated" if op.error else "running"
        elif op.kind == "deallocate":
            vm.power = "deallocated"
        elif op.kind == "powerOff":
            vm.power = "stopped"
        elif op.kind == "delete" and op.error is None:
            del self._vms[key]
            self._drop_vm_parts(key[0], vm)

    def _vm_json(self, rg: str, vm: _Vm, *, expand: bool) -> dict[str, Any]:
        vm_id = (
            f"/subscriptions/{self.subscription_id}/resourceGroups/{rg}/providers/Microsoft.Compute/"
            f"virtualMachines/{vm.name}"
        )
        props = {**vm.properties, "provisioningState": vm.provisioning, "vmId": vm.vm_id, "timeCreated": vm.created_at}
        if isinstance(props.get("osProfile"), dict):
            # ARM never returns customData once the VM exists.
            props["osProfile"] = {k: v for k, v in props["osProfile"].items() if k != "customData"}
        if expand:
            statuses = [{"code": f"ProvisioningState/{vm.provisioning.lower()}", "level": "Info"}]
            if vm.power:
                statuses.append({"code": f"PowerState/{vm.power}", "level": "Info"})
            props["instanceView"] = {"computerName": vm.name, "statuses": statuses}
        reply: dict[str, Any] = {
            "id": vm_id,
            "name": vm.name,
            "type": "Microsoft.Compute/virtualMachines",
            "location": vm.location,
            "tags": vm.tags,
            "properties": props,
        }
        if vm.zones:
            reply["zones"] = vm.zones
        if vm.identity is not None:
            reply["identity"] = vm.identity
        return reply


ROLE_ASSIGNMENTS_API_VERSION = "2022-04-01"
_GUID = re.compile(r"[0-9a-fA-F]{8}-(?:[0-9a-fA-F]{4}-){3}[0-9a-fA-F]{12}")

_OTHER_RESOURCES = (r"(Microsoft\.Network/networkSecurityGroups|Microsoft\.Network/applicationSecurityGroups|"
                    r"Microsoft\.Compute/proximityPlacementGroups)/([^/]+)")


def _identity(body: Any) -> dict[str, Any] | None:
    """A system-assigned identity as ARM creates one: its type plus a new principal id and the tenant."""
    asked = body.get("identity") if isinstance(body, dict) else None
    if not asked:
        return None
    identity = dict(asked)
    if "SystemAssigned" in str(identity.get("type", "")):
        identity["principalId"] = str(uuid.uuid4())
        identity["tenantId"] = "00000000-0000-0000-0000-0000000000aa"
    return identity


@dataclass(frozen=True, slots=True)
class _Reply:
    status: int
    body: Any
    headers: Mapping[str, str] = field(default_factory=dict)


# Capabilities of a few GPU sizes as `az vm list-skus --resource-type virtualMachines` lists them (abridged): ARM
# says `GPUs` for every GPU size and `RdmaEnabled` for the InfiniBand (ND) sizes, and never names the GPU model.
# https://learn.microsoft.com/azure/virtual-machines/sizes/gpu-accelerated/nd-h100-v5-series and its siblings.
VM_SKU_CAPABILITIES: Mapping[str, Mapping[str, str]] = {
    "Standard_ND96isr_H100_v5": {"vCPUs": "96", "MemoryGB": "1900", "GPUs": "8", "RdmaEnabled": "True",
                                 "MaxNetworkInterfaces": "8", "AcceleratedNetworkingEnabled": "True"},
    "Standard_ND96amsr_A100_v4": {"vCPUs": "96", "MemoryGB": "1900", "GPUs": "8", "RdmaEnabled": "True",
                                  "MaxNetworkInterfaces": "8", "AcceleratedNetworkingEnabled": "True"},
    "Standard_ND96asr_v4": {"vCPUs": "96", "MemoryGB": "900", "GPUs": "8", "RdmaEnabled": "True",
                            "MaxNetworkInterfaces": "8", "AcceleratedNetworkingEnabled": "True"},
    "Standard_NC80adis_H100_v5": {"vCPUs": "80", "MemoryGB": "640", "GPUs": "2", "MaxNetworkInterfaces": "4",
                                  "AcceleratedNetworkingEnabled": "True"},
    "Standard_NC40ads_H100_v5": {"vCPUs": "40", "MemoryGB": "320", "GPUs": "1", "MaxNetworkInterfaces": "2",
                                 "AcceleratedNetworkingEnabled": "True"},
    "Standard_NC24ads_A100_v4": {"vCPUs": "24", "MemoryGB": "220", "GPUs": "1", "MaxNetworkInterfaces": "2",
                                 "AcceleratedNetworkingEnabled": "True"},
    "Standard_D2s_v5": {"vCPUs": "2", "MemoryGB": "8", "MaxNetworkInterfaces": "2",
                        "AcceleratedNetworkingEnabled": "True"},
}


def _vm_sku(size: str, location: str) -> dict[str, Any]:
    capabilities = VM_SKU_CAPABILITIES.get(size, {"vCPUs": "8", "MemoryGB": "32"})
    return {
        "resourceType": "virtualMachines", "name": size, "tier": "Standard", "size": size.removeprefix("Standard_"),
        "locations": [location], "locationInfo": [{"location": location, "zones": ["1", "2", "3"]}],
        "capabilities": [{"name": k, "value": v} for k, v in {**capabilities, "HyperVGenerations": "V2"}.items()],
        "restrictions": [],
    }


def _error(status: int, code: str, message: str, headers: Mapping[str, str] | None = None) -> _Reply:
    return _Reply(status, {"error": {"code": code, "message": message}}, headers or {})


def _not_found(name: str) -> _Reply:
    return _error(404, "ResourceNotFound", f"The Resource 'Microsoft.Compute/virtualMachines/{name}' was not found.")


def _fault_reply(fault: Fault) -> _Reply:
    headers = {"Retry-After": str(fault.retry_after_s)} if fault.retry_after_s is not None else {}
    return _error(fault.status, fault.code, fault.message, headers)


def _make_handler(server: ArmServer) -> type[BaseHTTPRequestHandler]:
    class Handler(_JsonHandler):
        def dispatch(self, method: str) -> None:
            self.reply(server.handle(method, self.path, self.lower_headers(), self.read_json()))

    return Handler


class _JsonHandler(QuietHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # headers and body go out as separate writes: avoid 40 ms delayed-ACK stalls

    def dispatch(self, method: str) -> None:
        raise NotImplementedError

    def do_GET(self) -> None:
        self.dispatch("GET")

    def do_PUT(self) -> None:
        self.dispatch("PUT")

    def do_POST(self) -> None:
        self.dispatch("POST")

    def do_DELETE(self) -> None:
        self.dispatch("DELETE")

    def do_PATCH(self) -> None:
        self.dispatch("PATCH")

    def lower_headers(self) -> dict[str, str]:
        return {k.lower(): v for k, v in self.headers.items()}

    def read_json(self) -> Any:
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        try:
            return json.loads(raw) if raw else None
        except ValueError:
            return raw.decode(errors="replace")

    def reply(self, reply: _Reply) -> None:
        payload = b"" if reply.body is None else json.dumps(reply.body).encode()
        content_type = {"Content-Type": "application/json; charset=utf-8"} if payload else {}
        send_reply(self, reply.status, payload, {**reply.headers, **content_type})


# ------------------------------------------------------------------------------------------------------ IMDS


class ImdsServer(MadeWithServer):
    """Plain-http instance metadata with the Scheduled Events document of one VM's view of the world.

    `served` is set after each GET of the document, so a test can change the events between two polls of a
    watcher without sleeping. POSTed approvals land in `acknowledged` and remove the event, as on Azure.
    """

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []
        self.incarnation = 1
        self.acknowledged: list[str] = []
        self.bad_requests: list[str] = []
        self.served = threading.Event()
        self.acked = threading.Event()
        self._lock = threading.Lock()
        outer = self

        class Handler(_JsonHandler):
            def dispatch(self, method: str) -> None:
                self.reply(outer._handle(method, self.path, self.lower_headers(), self.read_json()))

        self._server = LoopbackServer(Handler, "imds-server")

    def add_event(self, event: Mapping[str, Any]) -> None:
        with self._lock:
            self.events.append(dict(event))
            self.incarnation += 1

    def _handle(self, method: str, raw_path: str, headers: Mapping[str, str], body: Any) -> _Reply:
        parts = urlsplit(raw_path)
        query = {k: v[0] for k, v in parse_qs(parts.query).items()}
        if parts.path != "/metadata/scheduledevents" or query.get("api-version") != "2020-07-01":
            return _error(404, "NotFound", raw_path)
        if headers.get("metadata") != "true":
            # IMDS refuses requests without the header, so that a proxied or forwarded request cannot read it.
            with self._lock:
                self.bad_requests.append(raw_path)
            return _Reply(400, {"error": "Bad request. Required metadata header not specified"})
        if method == "GET":
            with self._lock:
                reply = _Reply(200, {"DocumentIncarnation": self.incarnation, "Events": list(self.events)})
            self.served.set()
            return reply
        if method == "POST":
            ids = [str(r.get("EventId")) for r in (body or {}).get("StartRequests", [])]
            with self._lock:
                self.acknowledged.extend(ids)
                self.events = [e for e in self.events if e.get("EventId") not in ids]
                self.incarnation += 1
            self.acked.set()
            return _Reply(200, None)
        return _error(405, "MethodNotAllowed", method)
