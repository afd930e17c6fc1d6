"""cloud/: the instances a job runs on, behind one small `Provider` interface (see docs/cloud.md).

- `cloud.base`: the contract: typed records (`Instance`, `Notice`, `LaunchRequest`, `JobNetwork`, `Capabilities`,
  `CheckResult`), the `Provider` and `NoticeSource` interfaces, the `CloudError` hierarchy and retry budgets. It
  imports nothing else of `cloud`.
- One folder per cloud, each behind that interface: `cloud.local` (slots on this machine, with failure injection:
  the demo's and the tests' default), `cloud.aws` (EC2; `cloud.aws.client` is its one boto3 adapter) and
  `cloud.azure` (VMs); each holds its provider, network, notices, IAM policy and secret store. Their SDKs are
  imported only when such a provider is made.
- Shared by the clouds: `cloud.bootstrap` (the cloud-init document that makes an instance a host),
  `cloud.secret_store` (`SecretRef`, the `JobSecretStore` interface), `cloud.notices` (`NoticeWatcher`, which
  polls every notice channel on a thread and de-duplicates, and the instance-metadata helpers).
- In front: `cloud.registry.make_provider(name, **options)` (a provider by name), `cloud.capacity` (the capacity
  fallback order for waking or launching a standby), `cloud.secrets` (every secret store, and the host's
  `python -m cloud.secrets fetch`), `cloud.cli` (`trainmover cloud ...`).

Importing this package loads no cloud SDK.
"""

from cloud.base import (
    Capabilities,
    CapacityError,
    CheckResult,
    CloudError,
    CredentialsError,
    Instance,
    InvalidRequestError,
    JobNetwork,
    LaunchRequest,
    NotFoundError,
    Notice,
    NoticeSource,
    PermissionDeniedError,
    Provider,
    QuotaError,
    ServiceUnavailableError,
    ThrottledError,
    UnsupportedError,
)

__all__ = [
    "Capabilities",
    "CapacityError",
    "CheckResult",
    "CloudError",
    "CredentialsError",
    "Instance",
    "InvalidRequestError",
    "JobNetwork",
    "LaunchRequest",
    "NotFoundError",
    "Notice",
    "NoticeSource",
    "PermissionDeniedError",
    "Provider",
    "QuotaError",
    "ServiceUnavailableError",
    "ThrottledError",
    "UnsupportedError",
]
