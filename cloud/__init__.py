"""cloud/: the instances a job runs on, behind one small `Provider` interface (see docs/cloud.md).

- `cloud.base`: the contract: typed records (`Instance`, `Notice`, `LaunchRequest`, `JobNetwork`, `Capabilities`,
  `CheckResult`), the `Provider` and `NoticeSource` interfaces, the `CloudError` hierarchy and retry budgets.
- `cloud.local`: slots on this machine, with failure injection (the demo's and the tests' default).
- `cloud.aws`, `cloud.azure`: EC2 and Azure VMs; their SDKs are imported only when such a provider is made.
  `cloud.aws_network`: a job's own EC2 security group and cluster placement group; `cloud.aws_notices`: AWS notices
  from instance metadata and (checked) EventBridge events.
- `cloud.iam`: the least-privilege AWS IAM policy and Azure custom role of one job (`trainmover cloud policy`).
- `cloud.capacity`: the capacity fallback order for waking or launching a standby (other zone, type, on-demand).
- `cloud.registry.make_provider(name, **options)`: a provider by name; `cloud.notices.NoticeWatcher`: polls every
  notice channel on a thread and de-duplicates.

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
