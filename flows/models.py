"""The parameters of a resilient training run: the form Prefect renders in its UI, validated before anything starts.

`TrainingRun` is a pydantic model, so a Prefect deployment shows every field with its description and limits,
and a bad value (a negative count, an unknown provider, a script that does not exist, a cloud run without its
region) is refused with one message that names the field before any instance is launched. It imports neither
Prefect nor a cloud SDK: the flows, the CLI and the tests all validate with it.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

if TYPE_CHECKING:
    from cloud.capacity import Fallbacks

from cloud.artifacts import S3_PREFIX, parse_container_url, validate_s3_location
from policy.costs import LEAD_TIME_H, NODE_PRICE_USD_PER_H, RESTART_DOWNTIME_S, StandbyCosts, default_tiers
from runtime.fault_grammar import PLAN_PATTERN as FAULT_PLAN_PATTERN
from runtime.fault_grammar import plan_mistake

BLOCK_NAME_PATTERN = r"^[a-z0-9][a-z0-9-]*$"  # Prefect's block-name slug rule
_JOB_ID = re.compile(r"^[a-z0-9][a-z0-9-]{0,38}[a-z0-9]$")


class StandbyLimits(BaseModel):
    """How many standbys the policy may hold in each tier (see DESIGN.md: stopped, warm, hot)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    min_warm: int = Field(default=1, ge=0, le=1024, description="Warm standbys held whatever the policy says.")
    max_warm: int = Field(default=4, ge=0, le=1024, description="Most warm standbys the policy may hold.")
    max_hot: int = Field(default=0, ge=0, le=1024, description="Most hot standbys (state mirrored every step).")
    max_stopped: int = Field(default=4, ge=0, le=1024, description="Most parked (stopped/deallocated) standbys.")

    @model_validator(mode="after")
    def _ordered(self) -> StandbyLimits:
        if self.min_warm > self.max_warm:
            raise ValueError(f"min_warm={self.min_warm} exceeds max_warm={self.max_warm}; raise max_warm or lower it")
        return self


class TrainingRun(BaseModel):
    """One resilient training job: where it runs, what it trains, its standbys and the prices behind them."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    job_id: str = Field(
        default="trainmover-demo",
        description="Name of the job; tags every instance it launches (lower-case letters, digits, dashes).",
    )
    provider: Literal["local", "aws", "azure"] = Field(
        default="local", description="Where instances come from: this machine, AWS EC2 or Azure VMs."
    )
    region: str | None = Field(
        default=None, description="AWS region or Azure location (required for aws and azure), e.g. us-east-1."
    )
    azure_subscription_id: str | None = Field(default=None, description="Azure subscription (azure only).")
    azure_resource_group: str | None = Field(default=None, description="Azure resource group (azure only).")
    instance_type: str = Field(
        default="p5.48xlarge", min_length=1, description="Instance type / VM size of workers and standbys."
    )
    market: Literal["on-demand", "spot"] = Field(default="on-demand", description="On-demand or spot workers.")
    workers: int = Field(default=2, ge=1, le=4096, description="Training ranks, one process each: on instances that "
                         "run the job, one per accelerator, so they take ceil(workers / accelerators per instance) "
                         "instances.")
    job_nodes: int | None = Field(
        default=None,
        ge=1,
        le=100_000,
        description="Price the job as this many nodes (default: its worker instances); a drill on a few local "
        "processes can stand for a large job so the policy weighs real stakes.",
    )
    standby: StandbyLimits = Field(default_factory=StandbyLimits, description="Standby limits per tier.")
    script: str = Field(
        default="examples/train_mlp.py", min_length=1, description="The training script that uses `runtime`."
    )
    script_args: tuple[str, ...] = Field(default=(), description="Arguments passed to the training script.")
    steps: int | None = Field(
        default=None, ge=1, le=100_000_000, description="Total training steps, passed to the script as --steps."
    )
    backend: Literal["gloo", "nccl"] = Field(default="gloo", description="gloo (CPU) or nccl (one GPU a process).")
    node_price_usd_per_h: float = Field(
        default=NODE_PRICE_USD_PER_H, gt=0, le=10_000, description="Hourly price of one instance, USD."
    )
    restart_downtime_s: float = Field(
        default=RESTART_DOWNTIME_S,
        gt=0,
        le=604_800,
        description="Downtime of a failure no standby covers (checkpoint-restart + lost work), seconds.",
    )
    lead_time_h: float = Field(default=LEAD_TIME_H, gt=0, le=168, description="Hours to obtain a fresh instance.")
    budget_usd_per_h: float | None = Field(default=None, ge=0, description="Cap on all standbys' hourly cost.")
    max_instances: int | None = Field(
        default=None, ge=1, le=100_000,
        description="Most instances the job may hold at once: workers, standbys of every tier (parked ones too) and "
        "replacements together. A launch or wake-up that would pass it is refused (event "
        "trainmover.job.cap_reached) and the run goes on with what it holds; empty: no cap.",
    )
    max_spend_usd: float | None = Field(
        default=None, gt=0, le=1e9,
        description="Most the run may spend on instances in all, USD, at node_price_usd_per_h and the standby tiers' "
        "prices: a launch or wake-up is refused when the spend so far plus one hour of the fleet it would then hold "
        "passes it (running instances are not stopped); empty: no cap.",
    )
    policy_model: str | None = Field(
        default=None,
        description="The failure predictor: 'latest' (the last one the train-failure-model flow stored), a stored "
        "model's key (failure-model/v<time>-<digest>.skops), or a skops file; none: the XID/ECC rule.",
    )
    model_storage_block: str | None = Field(
        default=None, pattern=BLOCK_NAME_PATTERN, max_length=128,
        description="The Prefect storage block the models are kept in (as train-failure-model's storage_block); "
        "none: the worker host's disk.",
    )
    hazard_multiplier: float = Field(
        default=1.0, gt=0, le=100, description="Scales predicted failure probabilities: above 1 is more cautious."
    )
    faults: str | None = Field(
        default=None,
        description="Failures to inject: `;`-separated `ACTION:key=value,...` items, e.g. 'kill:rank=1,step=8' "
        "(SIGKILL rank 1 at step 8). The grammar is runtime/faults.py's; its parser checks the plan before anything "
        "launches.",
        # In the schema only, so the API and the form refuse a malformed plan before a run exists; the model's own
        # check is the parser's, whose message says what is wrong.
        json_schema_extra={"pattern": FAULT_PLAN_PATTERN},
    )

    hosts: Literal["orchestrator", "processes", "namespaces"] = Field(
        default="orchestrator",
        description="Local provider: where the job's processes run. 'orchestrator': one launcher on the flow's "
        "machine, the instances are bookkeeping; 'processes': every instance runs `trainmover agent` as a process "
        "of its own here; 'namespaces': every instance is a host of its own, a network namespace running the agent "
        "(needs root). AWS and Azure instances always run the job: each boots the agent (cloud.bootstrap).",
    )
    hosts_wait_s: float = Field(
        default=300.0, ge=5, le=3600,
        description="Seconds the coordinator waits for every launched instance's agent to join before it gives up.",
    )
    coordinator_address: str | None = Field(
        default=None,
        description="AWS/Azure: the flow's machine's private address, which the instances reach it at (the "
        "coordinator listens there; the job's security group admits only the job's hosts).",
    )
    image: str | None = Field(
        default=None,
        description="AWS: the AMI id; Azure: the image 'publisher:offer:sku:version'. Its stack must follow "
        "cloud.bootstrap.IMAGE_CONTRACT (same driver, CUDA, NCCL, torch on every host).",
    )
    subnet: str | None = Field(default=None, description="AWS subnet id, or Azure subnet resource id.")
    security_groups: tuple[str, ...] = Field(
        default=(), description="AWS: extra security groups (the job's own group is created and added)."
    )
    instance_profile: str | None = Field(
        default=None,
        description="AWS: the instance profile (name or ARN) whose role may read the job's secret (docs/cloud-aws.md).",
    )
    cluster_placement: bool = Field(
        default=True, description="Launch every host into the job's own cluster placement group (AWS) or proximity "
        "placement group (Azure), made with its security group and deleted at the release."
    )
    notice_queue: bool = Field(
        default=True,
        description="AWS: deliver spot interruptions, rebalance recommendations and scheduled maintenance to the flow "
        "through EventBridge rules and an SQS queue of the job's own (made at the start, deleted at the release); "
        "each becomes a planned move of that host's ranks.",
    )
    efa: bool = Field(
        default=False,
        description="AWS: an Elastic Fabric Adapter on every network card of each host (p5.48xlarge: 32), and the "
        "agents run with FI_PROVIDER=efa; a type without EFA is refused before launching.",
    )
    capacity_reservation: str | None = Field(
        default=None,
        description="Launch into reserved capacity: AWS a reservation id (cr-...) or a capacity reservation group "
        "ARN; Azure a capacity reservation group id. Fallbacks launch outside it.",
    )
    capacity_block: bool = Field(
        default=False, description="AWS: capacity_reservation is a Capacity Block for ML (the capacity-block market)."
    )
    fallback_zones: tuple[str, ...] = Field(
        default=(),
        description="When a launch or a wake-up finds no capacity: other zones of the region to try, in order "
        "(leave empty with a cluster placement group, which holds one zone).",
    )
    fallback_instance_types: tuple[str, ...] = Field(
        default=(),
        description="Then: other instance types with the same accelerator, in order (e.g. p5e.48xlarge).",
    )
    fallback_on_demand: bool = Field(
        default=True, description="Last: an on-demand launch of instance_type (spot ends on on-demand)."
    )
    key_vault_url: str | None = Field(
        default=None, description="Azure: the Key Vault that holds the job's secret, https://VAULT.vault.azure.net."
    )
    key_vault_resource_id: str | None = Field(
        default=None,
        description="Azure: that vault's ARM resource id (/subscriptions/.../providers/Microsoft.KeyVault/vaults/"
        "VAULT): each VM's identity is granted read access to the job's secret there, and the grant removed at "
        "release (docs/cloud-azure.md).",
    )
    trainmover_source: str | None = Field(
        default=None,
        description="The pinned TrainMover every host installs ('trainmover==0.1.0' or 'trainmover @ "
        "git+https://...@<40-hex commit>'); default: this machine's version.",
    )
    artifact_bucket: str | None = Field(
        default=None,
        description="AWS: an S3 bucket of yours, in the run's region, where the job stages this orchestrator's own "
        "TrainMover wheel and the training script for its hosts (presigned URLs with their SHA-256, under "
        "artifact_prefix/job_id/, deleted at the release); each host installs that wheel with no package index. "
        "Empty: every host installs trainmover_source from the package index.",
    )
    artifact_container: str | None = Field(
        default=None,
        description="Azure: the URL of a blob container of yours (https://ACCOUNT.blob.core.windows.net/CONTAINER) "
        "where the job stages this orchestrator's own TrainMover wheel and the training script for its hosts "
        "(read-only SAS URLs with their SHA-256, as blobs artifact_prefix/job_id/NAME, deleted at the release); each "
        "host installs that wheel with no package index. Empty: every host installs trainmover_source from the "
        "package index.",
    )
    artifact_prefix: str = Field(
        default=S3_PREFIX, min_length=1, max_length=200,
        description="The key (AWS) or blob name (Azure) prefix in artifact_bucket or artifact_container; the job's "
        "files go under PREFIX/JOB_ID/.",
    )

    @field_validator("job_id")
    @classmethod
    def _job_id(cls, v: str) -> str:
        if not _JOB_ID.match(v):
            raise ValueError(
                f"job_id {v!r} must be 2-40 lower-case letters, digits or dashes, starting and ending with a letter "
                "or digit (it becomes a cloud tag and part of instance names)"
            )
        return v

    @field_validator("faults")
    @classmethod
    def _faults(cls, v: str | None) -> str | None:
        if v is None or not v.strip():
            return None
        # The grammar's own sentence first (the wrong item and part, and a plan written right), rather than the
        # parser's first stumble (a bare int() error); then the runtime's parser for its cross-checks, so a plan the
        # job would refuse 60 s later is refused here, before any launch.
        if (mistake := plan_mistake(v)) is not None:
            raise ValueError(mistake)
        # Imported here: runtime.faults pulls in torch, which a run without faults never needs.
        from runtime.faults import parse_plan

        parse_plan(v)  # FaultPlanError is a ValueError: pydantic reports it under `faults`
        return v

    @model_validator(mode="after")
    def _consistent(self) -> TrainingRun:
        if self.provider in ("aws", "azure") and not self.region:
            raise ValueError(f"provider {self.provider!r} needs a region (e.g. us-east-1 or eastus)")
        if self.provider == "azure" and not (self.azure_subscription_id and self.azure_resource_group):
            raise ValueError("provider 'azure' needs azure_subscription_id and azure_resource_group")
        if self.provider == "aws" and self.market == "spot" and self.standby.max_stopped > 0:
            raise ValueError(
                "AWS cannot park (stop) one-time spot instances: set standby.max_stopped to 0 or use on-demand"
            )
        if self.hosts != "orchestrator" and self.provider != "local":
            raise ValueError(f"hosts={self.hosts!r} is for the local provider; {self.provider} instances always run "
                             "the job (leave hosts at 'orchestrator')")
        if self.capacity_block and (self.provider != "aws" or not self.capacity_reservation):
            raise ValueError("capacity_block is for AWS, with capacity_reservation=<the block's cr-... id>")
        if self.efa and self.provider != "aws":
            raise ValueError("efa is an AWS adapter: set it only with provider 'aws' (docs/cloud-azure.md says what "
                             "Azure's InfiniBand needs)")
        if self.provider in ("aws", "azure"):
            needed = ["coordinator_address", "image"] + (
                ["instance_profile"] if self.provider == "aws" else ["key_vault_url", "key_vault_resource_id"])
            missing = [name for name in needed if not getattr(self, name)]
            if missing:
                raise ValueError(f"provider {self.provider!r} launches instances that run the job and needs "
                                 f"{', '.join(missing)} (see docs/cloud-{self.provider}.md)")
        if self.trainmover_source is not None:
            from cloud.base import CloudError
            from cloud.bootstrap import validate_pinned_source

            try:
                validate_pinned_source(self.trainmover_source)
            except CloudError as exc:
                raise ValueError(f"trainmover_source: {exc}") from None
        if self.artifact_bucket is not None:
            if self.provider != "aws":
                raise ValueError("artifact_bucket is an S3 bucket: set it only with provider 'aws'")
            from cloud.base import CloudError

            try:
                validate_s3_location(self.artifact_bucket, self.artifact_prefix)
            except CloudError as exc:
                raise ValueError(f"artifact_bucket/artifact_prefix: {exc}") from None
        if self.artifact_container is not None:
            if self.provider != "azure":
                raise ValueError("artifact_container is an Azure blob container: set it only with provider 'azure'")
            from cloud.base import CloudError

            try:
                parse_container_url(self.artifact_container, self.artifact_prefix)
            except CloudError as exc:
                raise ValueError(f"artifact_container/artifact_prefix: {exc}") from None
        if self.faults is not None:
            from runtime.faults import parse_plan

            beyond = sorted({f.rank for f in parse_plan(self.faults) if f.rank is not None and f.rank >= self.workers})
            if beyond:
                raise ValueError(
                    f"faults name rank(s) {beyond}, but the job has ranks 0-{self.workers - 1} only: such a fault "
                    "would never fire; lower the rank or raise workers"
                )
        if (why := self._caps_refusal()) is not None:
            raise ValueError(why)
        from flows.model_store import is_model_key

        if self.policy_model is not None and not is_model_key(self.policy_model) \
                and not Path(self.policy_model).is_file():
            raise ValueError(
                f"policy_model {self.policy_model!r} does not exist; name a stored model ('latest' or its key) or "
                "train one with the train-failure-model flow or `trainmover policy train`"
            )
        return self

    def _caps_refusal(self) -> str | None:
        """Why max_instances or max_spend_usd cannot hold what the run needs from its start (its worker instances
        and standby.min_warm warm standbys), or None. On instances the hosts' slots are known at provisioning only:
        here the fewest worker hosts they could take (the flow checks the exact count before launching)."""
        if self.max_instances is None and self.max_spend_usd is None:
            return None
        from cloud.bootstrap import MAX_SLOTS
        from flows.actions import Caps, Held, cap_refusal

        hosts = -(-self.workers // MAX_SLOTS) if self.on_instances else self.workers
        warm = self.standby.min_warm
        refusal = cap_refusal(
            Caps(self.max_instances, self.max_spend_usd), Held(), instances=hosts + warm,
            usd_per_h=hosts * self.node_price_usd_per_h + warm * self.tier_prices()["warm"],
            what=f"the run's own minimum, {'at least ' if self.on_instances else ''}{hosts} worker instance(s) and "
            f"standby.min_warm={warm} warm standby(s)",
            also="lower workers or standby.min_warm",
        )
        return None if refusal is None else refusal.message.replace("; nothing was launched for it", "")

    def fallbacks(self) -> Fallbacks:
        """What the run allows when the cloud has no capacity for its first choice (cloud.capacity)."""
        from cloud.capacity import Fallbacks

        return Fallbacks(zones=self.fallback_zones, instance_types=self.fallback_instance_types,
                         on_demand=self.fallback_on_demand)

    @property
    def on_instances(self) -> bool:
        """Whether the job's processes run on the instances it launches (each booted into a host of the job)."""
        return self.provider != "local" or self.hosts != "orchestrator"

    def check_script(self, root: str | Path = ".") -> Path:
        """The training script as a path, or ValueError if it does not exist (checked before anything launches)."""
        path = Path(root) / self.script
        if not path.is_file():
            raise ValueError(
                f"script {self.script!r} does not exist under {Path(root).resolve()}; pass a path to a file"
            )
        return path

    def tier_prices(self) -> dict[str, float]:
        """USD per hour of one standby in each tier, for this run's instances (offered or not: for the bill)."""
        return {t: c.price_usd_per_h for t, c in default_tiers(self.node_price_usd_per_h).items()}

    def costs(self, nodes: int | None = None) -> StandbyCosts:
        """The policy's prices for this job: the whole job costs its nodes x the node price per hour (`job_nodes`,
        else `nodes`: the worker instances the job takes, else one per worker)."""
        tiers = default_tiers(self.node_price_usd_per_h)
        offered = {
            t: c
            for t, c in tiers.items()
            if {"stopped": self.standby.max_stopped, "warm": self.standby.max_warm, "hot": self.standby.max_hot}[t] > 0
        } or {"warm": tiers["warm"]}
        return StandbyCosts(
            job_price_usd_per_h=(self.job_nodes or nodes or self.workers) * self.node_price_usd_per_h,
            restart_downtime_s=self.restart_downtime_s,
            lead_time_h=self.lead_time_h,
            tiers=offered,
            budget_usd_per_h=self.budget_usd_per_h,
        )


def describe_error(exc: ValidationError) -> str:
    """One line per problem, each naming the field, for the UI and the CLI."""
    lines = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err["loc"]) or "run"
        msg = str(err["msg"]).removeprefix("Value error, ")
        lines.append(f"{where}: {msg}")
    return "; ".join(lines)
