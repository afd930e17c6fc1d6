"""`trainmover cloud ...`: check a provider's credentials and permissions, list a job's instances, release them.

    trainmover cloud check --provider aws --region eu-west-1     # what would fail, before a job finds out
    trainmover cloud describe --provider azure --resource-group rg --location eastus --job JOB
    trainmover cloud release --provider aws --job JOB            # delete every resource of JOB, and say what
    trainmover cloud policy --provider aws --job JOB --region us-east-1 --image ami-... --instance-type p5.48xlarge

The dispatcher calls `add_cloud_parser(subparsers)` and then `cloud_command(namespace)`. Exit codes: 0 success
(every check passed, every resource of a released job deleted), 1 some check failed or some deletion of a release
failed (the others still ran), 2 a `CloudError` (missing credentials, unknown region, missing SDK), printed as one
line on stderr without a traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from cloud.base import JOB_ID_RULE, CheckResult, CloudError, Instance, InvalidRequestError, Provider, validate_job_id
from cloud.registry import PROVIDER_NAMES, make_provider
from trainmover.cli import part_main

_EXIT_FAILED_CHECK = 1
_EXIT_USAGE = 2


def add_cloud_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("cloud", help="cloud providers: check permissions, list or release a job's instances")
    actions = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    check = actions.add_parser("check", help="verify credentials and permissions without creating anything")
    _add_provider_options(check)
    check.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    check.add_argument("--job", help="AWS: dry-run as this job (a per-job policy allows only its own tag)")
    check.add_argument("--instance-type", help="AWS: the type the launch dry run asks for (default t3.micro)")
    check.add_argument("--node-role-arn", metavar="ARN",
                       help="AWS: the instances' role, which a launch passes: adds iam:PassRole to the simulation")
    check.add_argument("--artifact-bucket", metavar="BUCKET",
                       help="AWS: where the flows stage the job's files: adds S3 to the simulation")
    job_help = f"the job id (tag trainmover:job), matched exactly: {JOB_ID_RULE}"
    describe = actions.add_parser("describe", help="list the instances tagged with a job")
    _add_provider_options(describe)
    describe.add_argument("--job", required=True, help=job_help)
    release = actions.add_parser(
        "release", help="delete every resource of a job (instances, network, notice queue, secret); prints each"
    )
    _add_provider_options(release)
    release.add_argument("--job", required=True, help=job_help)
    release.add_argument(
        "--key-vault-url", metavar="URL",
        help="Azure: the vault of the job's secret, deleted too (default: $AZURE_KEY_VAULT_URL)",
    )
    release.add_argument(
        "--key-vault-resource-id", metavar="ID",
        help="Azure: that vault's resource id, where the VMs' read grants on the secret are removed too "
             "(default: $AZURE_KEY_VAULT_RESOURCE_ID)",
    )
    policy = actions.add_parser(
        "policy", help="print the least-privilege IAM policy (AWS) or custom role (Azure) for one job, as JSON"
    )
    policy.add_argument("--provider", required=True, choices=("aws", "azure"), help="which cloud")
    policy.add_argument("--job", help=f"AWS: {job_help}")
    policy.add_argument("--region", action="append", default=[], help="AWS: a region the job may use (repeatable)")
    policy.add_argument("--image", action="append", default=[], help="AWS: an AMI id it may launch (repeatable)")
    policy.add_argument(
        "--instance-type", action="append", default=[], help="AWS: an instance type it may launch (repeatable)"
    )
    policy.add_argument("--account", default="*", help="AWS: the 12-digit account id (default: any)")
    policy.add_argument("--node-role", metavar="ARN", help="AWS: the instances' IAM role, the only one it may pass")
    policy.add_argument(
        "--kms-key", action="append", default=[], metavar="ARN", help="AWS: a CMK of the EBS volumes (repeatable)"
    )
    policy.add_argument(
        "--no-notice-wiring", action="store_true", help="AWS: an administrator creates the notice queue and rules"
    )
    policy.add_argument("--artifact-bucket", metavar="BUCKET",
                        help="AWS: the bucket the flows stage the job's wheel and script in (run.artifact_bucket)")
    policy.add_argument("--artifact-prefix", metavar="PREFIX", default=None,
                        help="AWS: the key prefix there (run.artifact_prefix; default: the flows' own)")
    policy.add_argument("--subscription", metavar="ID", help="Azure subscription id (default: $AZURE_SUBSCRIPTION_ID)")
    policy.add_argument(
        "--resource-group", metavar="RG", help="Azure: the dedicated resource group (default: $AZURE_RESOURCE_GROUP)"
    )


def _add_provider_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--provider", required=True, choices=PROVIDER_NAMES, help="which cloud")
    p.add_argument("--region", help="AWS region (default: $AWS_REGION, then $AWS_DEFAULT_REGION)")
    p.add_argument("--endpoint-url", metavar="URL", help="another API endpoint (a local test server, a proxy)")
    p.add_argument("--subscription", metavar="ID", help="Azure subscription id (default: $AZURE_SUBSCRIPTION_ID)")
    p.add_argument("--resource-group", metavar="RG", help="Azure resource group (default: $AZURE_RESOURCE_GROUP)")
    p.add_argument("--location", metavar="L", help="Azure location, e.g. eastus (default: $AZURE_LOCATION)")
    p.add_argument("--image", help="AMI id or Azure image reference: lets `check` dry-run a complete launch")
    p.add_argument("--notice-queue-url", metavar="URL", help="AWS: the SQS queue of EventBridge notices to check")


def _env(*names: str) -> str | None:
    for name in names:
        value = os.environ.get(name, "").strip()
        if value:
            return value
    return None


def provider_options(ns: argparse.Namespace) -> dict[str, Any]:
    """The keyword arguments of `make_provider` that the command line (and its environment) gives."""
    if ns.provider == "local":
        return {}
    if ns.provider == "aws":
        region = ns.region or _env("AWS_REGION", "AWS_DEFAULT_REGION")
        if region is None:
            raise InvalidRequestError("no AWS region: pass --region or set AWS_REGION", provider="aws")
        # AwsProvider itself refuses an unknown region (botocore's bundled region list, no network needed).
        return _given(region=region, endpoint_url=ns.endpoint_url, image=ns.image,
                      notice_queue_url=ns.notice_queue_url)
    missing = []
    subscription = ns.subscription or _env("AZURE_SUBSCRIPTION_ID")
    resource_group = ns.resource_group or _env("AZURE_RESOURCE_GROUP")
    location = ns.location or _env("AZURE_LOCATION")
    if subscription is None:
        missing.append("--subscription (or AZURE_SUBSCRIPTION_ID)")
    if resource_group is None:
        missing.append("--resource-group (or AZURE_RESOURCE_GROUP)")
    if location is None:
        missing.append("--location (or AZURE_LOCATION)")
    if missing:
        raise InvalidRequestError(f"the azure provider needs {', '.join(missing)}", provider="azure")
    options = _given(subscription_id=subscription, resource_group=resource_group, location=location,
                     base_url=ns.endpoint_url, image=ns.image)
    key_vault_url = getattr(ns, "key_vault_url", None) or _env("AZURE_KEY_VAULT_URL")
    if key_vault_url is not None:
        from cloud.azure.secrets import AzureKeyVaultStore

        options["key_vault"] = AzureKeyVaultStore(key_vault_url)
    vault_id = getattr(ns, "key_vault_resource_id", None)
    if vault_id is not None:  # else the provider reads $AZURE_KEY_VAULT_RESOURCE_ID itself
        options["key_vault_resource_id"] = vault_id
    return options


def _given(**options: Any) -> dict[str, Any]:
    # Options left out keep the provider's own defaults.
    return {k: v for k, v in options.items() if v is not None}


def _provider(ns: argparse.Namespace) -> Provider:
    return make_provider(ns.provider, **provider_options(ns))


def format_checks(provider: str, results: Sequence[CheckResult]) -> str:
    """One line per check, then the verdict."""
    width = max((len(r.name) for r in results), default=0)
    lines = [f"  {'ok  ' if r.ok else 'FAIL'}  {r.name:<{width}}  {r.detail}".rstrip() for r in results]
    failed = [r.name for r in results if not r.ok]
    if not results:
        lines.append(f"{provider}: no checks ran")
    elif failed:
        lines.append(f"{provider}: {len(failed)} of {len(results)} checks failed: {', '.join(failed)}")
    else:
        lines.append(f"{provider}: all {len(results)} checks passed")
    return "\n".join(lines)


def format_instances(instances: Sequence[Instance]) -> str:
    """A fixed-width table of instances."""
    header = ("instance", "role", "type", "market", "state", "health", "zone", "private ip")
    rows = [
        (i.instance_id, i.role, i.instance_type, i.market, i.state, i.health, i.zone or "-", i.private_ip or "-")
        for i in instances
    ]
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows, strict=False)]
    return "\n".join("  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
                     for row in (header, *rows))


def _check(ns: argparse.Namespace) -> int:
    provider = _provider(ns)
    options: dict[str, Any] = {}
    aws_only = _given(job_id=ns.job, instance_type=ns.instance_type, node_role_arn=ns.node_role_arn,
                      artifact_bucket=ns.artifact_bucket)
    if aws_only:
        if ns.provider != "aws":
            raise InvalidRequestError(
                "--job, --instance-type, --node-role-arn and --artifact-bucket apply to `cloud check --provider aws` "
                "only")
        options = aws_only
    results = provider.check(**options)
    print(format_checks(provider.name, results))
    if ns.json:
        payload = {
            "provider": provider.name,
            "ok": all(r.ok for r in results),
            "checks": [{"name": r.name, "ok": r.ok, "detail": r.detail} for r in results],
        }
        try:
            Path(ns.json).write_text(json.dumps(payload, indent=2) + "\n", encoding="utf-8")
        except OSError as exc:
            raise InvalidRequestError(f"--json {ns.json}: cannot write ({exc.strerror})") from None
    return 0 if results and all(r.ok for r in results) else _EXIT_FAILED_CHECK


def _describe(ns: argparse.Namespace) -> int:
    validate_job_id(ns.job, provider=ns.provider)  # before building the provider: no credentials needed to refuse
    provider = _provider(ns)
    instances = provider.describe(job_id=ns.job)
    if instances:
        print(format_instances(instances))
    print(f"{provider.name}: {len(instances)} instance(s) of job {ns.job}")
    return 0


def _release(ns: argparse.Namespace) -> int:
    validate_job_id(ns.job, provider=ns.provider)
    return release_job_resources(_provider(ns), ns.job)


def release_job_resources(provider: Provider, job_id: str) -> int:
    """`trainmover cloud release` once the provider is made: `provider.release_all(job_id)`, then one line on
    stdout per deleted resource ("instance i-0123...", "security group sg-...", "SQS queue ..."), and on stderr
    the summary, what could not be looked for, and one line naming every deletion that failed. 0 when nothing
    failed (nothing left to delete included), 1 otherwise."""
    report = provider.release_all(job_id)
    for instance_id in report.instances:
        print(f"instance {instance_id}")
    for resource in report.deleted:
        print(resource)
    print(report.summary(), file=sys.stderr)
    for note in report.not_looked_for:
        print(f"{provider.name}: job {job_id}: not looked for: {note}", file=sys.stderr)
    if not report.complete:
        print(f"trainmover cloud release: error: {report.failure()}", file=sys.stderr)
        return _EXIT_FAILED_CHECK
    return 0


def _policy(ns: argparse.Namespace) -> int:
    from cloud.aws.iam import AwsJobScope, aws_job_policy
    from cloud.azure.iam import azure_job_role

    if ns.provider == "aws":
        if ns.job is None:
            raise InvalidRequestError("the AWS policy is per job: pass --job", provider="aws")
        scope = AwsJobScope(
            job_id=ns.job,
            regions=tuple(ns.region or filter(None, [_env("AWS_REGION", "AWS_DEFAULT_REGION")])),
            images=tuple(ns.image),
            instance_types=tuple(ns.instance_type),
            account_id=ns.account,
            node_role_arn=ns.node_role,
            kms_key_arns=tuple(ns.kms_key),
            notice_wiring=not ns.no_notice_wiring,
            artifact_bucket=ns.artifact_bucket,
            **({"artifact_prefix": ns.artifact_prefix} if ns.artifact_prefix is not None else {}),
        )
        document = aws_job_policy(scope)
    else:
        subscription = ns.subscription or _env("AZURE_SUBSCRIPTION_ID")
        resource_group = ns.resource_group or _env("AZURE_RESOURCE_GROUP")
        if subscription is None or resource_group is None:
            raise InvalidRequestError(
                "the Azure role is assignable on one dedicated resource group: pass --subscription and "
                "--resource-group (or set AZURE_SUBSCRIPTION_ID and AZURE_RESOURCE_GROUP)",
                provider="azure",
            )
        document = azure_job_role(subscription, resource_group)
    print(json.dumps(document, indent=2))
    return 0


@contextlib.contextmanager
def _sdk_logs_quiet() -> Iterator[None]:
    # azure-identity logs every credential it tried (a dozen lines) at WARNING before raising; the provider turns
    # that error into one CredentialsError line that says what to set, so the log would only repeat it, worse.
    logger = logging.getLogger("azure.identity")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def cloud_command(ns: argparse.Namespace) -> int:
    """Run `trainmover cloud ACTION`; 0 on success, 1 when a check failed, 2 with one line on stderr for a
    `CloudError`."""
    handlers = {"check": _check, "describe": _describe, "release": _release, "policy": _policy}
    try:
        with _sdk_logs_quiet():
            return handlers[ns.action](ns)
    except CloudError as exc:
        # One line, whatever the SDK put in its message.
        print(f"trainmover cloud {ns.action}: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return _EXIT_USAGE


def main(argv: list[str] | None = None) -> int:
    """Stand-alone entry (`python -m cloud.cli ...`), the same as `trainmover cloud ...`."""
    return part_main("cloud", add_cloud_parser, cloud_command, argv)


if __name__ == "__main__":
    raise SystemExit(main())
