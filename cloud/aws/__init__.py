"""AWS: EC2 instances behind the `cloud.base.Provider` interface (docs/cloud-aws.md).

- `cloud.aws.provider`: `AwsProvider`, standbys as tagged EC2 instances, parked by stop/start;
- `cloud.aws.client`: `AwsApi`, the one boto3 adapter (every AWS call, and the translation of botocore errors);
- `cloud.aws.network`: a job's own security group and cluster placement group;
- `cloud.aws.notices`: notices from instance metadata (`ImdsNoticeSource`) and EventBridge, and the job's notice
  queue (`ensure_notice_queue`, `delete_notice_queue`);
- `cloud.aws.iam`: the least-privilege IAM policy of one job (`aws_job_policy`);
- `cloud.aws.secrets`: the job's secret in Secrets Manager or SSM Parameter Store.

Importing it loads no SDK: boto3 is imported when an `AwsApi` is made.
"""

from cloud.aws.client import POLICY_DOC, one_attempt_config
from cloud.aws.notices import delete_notice_queue, ensure_notice_queue, notice_resource_names
from cloud.aws.provider import METADATA_OPTIONS, ON_DEMAND_USD_PER_H, TAG_LIMITS, AwsProvider

__all__ = [
    "METADATA_OPTIONS",
    "ON_DEMAND_USD_PER_H",
    "POLICY_DOC",
    "TAG_LIMITS",
    "AwsProvider",
    "delete_notice_queue",
    "ensure_notice_queue",
    "notice_resource_names",
    "one_attempt_config",
]
