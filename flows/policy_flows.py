"""The cost owner's flows: `train_failure_model` (fit, evaluate and store the predictor) and `tune_standby_policy`
(the simulator's cost/ETTR sweep with its frontier plot and a recommendation).

Both are thin: `policy.pipeline` and `policy.tuning` do the work; the flows add parameters the Prefect UI renders,
artifacts people read, and events automations can hang on. A cost owner's ETTR floor may live in the Prefect
Variable `trainmover-min-ettr`, so changing it needs no redeploy.

Neither writes into the worker's working directory: a model goes, unless a path is given, to a new time-stamped
file under the user's data directory (a scheduled re-training never overwrites the model a running job uses), and
the frontier plot, unless a path is given, lives in a temporary directory only as long as it takes to embed it in
its artifact.
"""

from __future__ import annotations

import tempfile
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE
from prefect.events import emit_event
from prefect.variables import Variable
from pydantic import BaseModel, ConfigDict, Field

from flows.credentials import BLOCK_NAME_PATTERN
from flows.model_store import models_dir, save_model
from flows.timeline import markdown_image
from policy.costs import StandbyCosts

if TYPE_CHECKING:
    from policy.tuning import FrontierPoint

MIN_ETTR_VARIABLE = "trainmover-min-ettr"


def new_model_path(now: datetime | None = None) -> Path:
    """A fresh, time-stamped model file under `models_dir()`: `failure-model-20261201T030000Z.skops`."""
    return models_dir() / f"failure-model-{(now or datetime.now(UTC)):%Y%m%dT%H%M%SZ}.skops"


class TrainingData(BaseModel):
    """Which synthetic fleets to learn from (seeds kept apart from the evaluation seed)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    seeds: tuple[int, ...] = Field(default=(101, 102), min_length=1, description="Fleet seeds to train on.")
    eval_seed: int = Field(default=9001, ge=0, description="A fleet seed never trained on, for evaluation.")
    nodes: int = Field(default=128, ge=8, le=4096, description="Nodes per synthetic fleet.")
    days: float = Field(default=90.0, gt=7, le=3650, description="Days per synthetic fleet.")
    max_iter: int = Field(default=100, ge=1, le=2000, description="Boosting iterations of the predictor.")


@task(cache_policy=NO_CACHE)
def fit_predictor(data: TrainingData) -> tuple[Any, dict[str, Any]]:
    from dataclasses import asdict

    from policy.pipeline import fleet_config, train_predictor
    from policy.predictor import FailurePredictor

    if data.eval_seed in data.seeds:
        raise ValueError(f"eval_seed {data.eval_seed} is also a training seed; evaluate on a fleet never trained on")
    model, report = train_predictor(
        [fleet_config(s, data.nodes, data.days) for s in data.seeds], predictor=FailurePredictor(max_iter=data.max_iter)
    )
    return model, asdict(report)


@task(cache_policy=NO_CACHE)
def evaluate_predictor(model: Any, data: TrainingData) -> dict[str, Any]:
    from policy.pipeline import evaluate_fleet, fleet_config

    return evaluate_fleet(model, fleet_config(data.eval_seed, data.nodes, data.days)).to_dict()


@flow(name="train-failure-model")
def train_failure_model(
    data: TrainingData = TrainingData(),  # noqa: B008 - a pydantic default is how Prefect renders the form
    model_path: str | None = None,
    storage_block: Annotated[str | None, Field(pattern=BLOCK_NAME_PATTERN, max_length=128)] = None,
) -> dict[str, Any]:
    """Fit the FailurePredictor on synthetic fleets, evaluate it and the learned policy on a held-out fleet, save
    it with skops (loadable only with the project's trusted types).

    Args:
        data: Which synthetic fleets to train on, and the held-out one to evaluate on.
        model_path: Where to save the model file too. Empty: a new time-stamped file under
            $XDG_DATA_HOME/trainmover/models (~/.local/share/...), never overwritten.
        storage_block: A Prefect storage block (S3Bucket, RemoteFileSystem, ...) to keep the model in under a
            versioned key, with "latest" pointing at it; a training run finds it by that key or by "latest"
            (`run.policy_model`, `run.model_storage_block`). Empty: the worker host's $XDG_DATA_HOME/trainmover/models.
    """
    logger = get_run_logger()
    model, train = fit_predictor(data)
    logger.info("trained on %d rows (%d positive) in %.1f s", train["rows"], train["positives"], train["fit_s"])
    ev = evaluate_predictor(model, data)
    path = Path(model_path) if model_path else new_model_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    model.save(path)
    model_path = str(path.resolve())
    key = save_model(path, storage_block)
    logger.info("model saved to %s and stored as %s (now 'latest')", model_path, key)
    pred = ev["prediction"]
    rows = [
        {
            "scorer": name,
            "pr_auc": round(pred[name]["pr_auc"], 4),
            "brier": pred[name]["brier"],
            "precision_at_recall": round(pred[name]["precision_at_recall"], 4),
            "mean_lead_h": pred[name]["mean_lead_h"],
        }
        for name in ("predictor", "logistic", "rule")
    ]
    create_table_artifact(rows, key="failure-model-scores", description=f"Held-out fleet seed {data.eval_seed}")
    v = ev["verdict"]
    create_markdown_artifact(
        f"# Learned standby policy, held-out seed {data.eval_seed}\n\n"
        f"Learned: {v['learned_usd_per_useful_h']:.2f} USD per useful hour at ETTR {v['learned_ettr']:.5f}; "
        f"best static ({v['best_static']}): {v['best_static_usd_per_useful_h']:.2f} at ETTR "
        f"{v['best_static_ettr']:.5f}; ratio {v['cost_ratio']:.3f}. Oracle {v['oracle_usd_per_useful_h']:.2f}.\n\n"
        f"Model saved to `{model_path}` and stored as `{key}` in "
        f"{f'the storage block `{storage_block}`' if storage_block else 'the worker host`s model storage'}, now "
        "`latest`: a training run uses it with `run.policy_model: latest` (or that key).",
        key="failure-model-verdict",
    )
    emit_event(
        event="trainmover.model.trained",
        resource={"prefect.resource.id": f"trainmover.model.{Path(model_path).name}"},
        payload={"pr_auc": rows[0]["pr_auc"], "cost_ratio": v["cost_ratio"]},
    )
    return {"train": train, "evaluation": ev, "model_path": model_path, "model_key": key}


@task(cache_policy=NO_CACHE)
def run_sweep(trace_name: str, nodes: int | None, costs: StandbyCosts) -> list[FrontierPoint]:
    from policy.traces import load_csv, load_infinitehbd
    from policy.tuning import sweep

    if trace_name == "infinitehbd":
        trace = load_infinitehbd()
    else:
        if nodes is None:
            raise ValueError("a CSV trace needs `nodes`: the fleet size including nodes that never failed")
        trace = load_csv(trace_name, n_nodes=nodes)
    return sweep(trace, costs)


@flow(name="tune-standby-policy")
def tune_standby_policy(
    trace: str = "infinitehbd",
    nodes: int | None = None,
    job_price_usd_per_h: float = StandbyCosts().job_price_usd_per_h,
    lead_time_h: float = StandbyCosts().lead_time_h,
    restart_downtime_s: float = StandbyCosts().restart_downtime_s,
    min_ettr: float | None = None,
    plot_path: str | None = None,
    output: Literal["artifacts", "none"] = "artifacts",
) -> dict[str, Any]:
    """Sweep standby settings on a fault trace and recommend the cheapest one that keeps ETTR above the floor
    (`min_ettr`, or the Prefect Variable `trainmover-min-ettr` when not given).

    Args:
        plot_path: Where to keep the cost/ETTR frontier as a PNG. Empty: the plot is only embedded in the
            `standby-recommendation` artifact, and its temporary file removed.
    """
    from policy.tuning import plot_frontier, recommend

    logger = get_run_logger()
    if min_ettr is None:
        stored = Variable.get(MIN_ETTR_VARIABLE, default=None)
        min_ettr = float(stored) if isinstance(stored, int | float | str) else None
    costs = StandbyCosts(
        job_price_usd_per_h=job_price_usd_per_h, lead_time_h=lead_time_h, restart_downtime_s=restart_downtime_s
    )
    points = run_sweep(trace, nodes, costs)
    best = recommend(points, min_ettr)
    logger.info(
        "recommended %s: ETTR %.5f, %.2f USD per useful hour", best.setting, best.ettr, best.cost_per_useful_hour
    )
    with tempfile.TemporaryDirectory(prefix="trainmover-frontier-") as scratch:
        plot = Path(plot_path) if plot_path else Path(scratch) / "standby-frontier.png"
        if plot_path or output == "artifacts":
            plot_frontier(points, str(plot), best)
        if output == "artifacts":
            publish_recommendation(points, best, min_ettr, plot)
    emit_event(
        event="trainmover.policy.tuned",
        resource={"prefect.resource.id": f"trainmover.trace.{trace}"},
        payload={"setting": best.setting, "ettr": best.ettr, "usd_per_useful_h": best.cost_per_useful_hour},
    )
    return {"recommended": best.to_dict(), "points": len(points), "plot": plot_path}


def publish_recommendation(
    points: list[FrontierPoint], best: FrontierPoint, min_ettr: float | None, plot: Path
) -> None:
    """The frontier table, and the recommendation with its plot embedded (the artifact outlives any file)."""
    from policy.tuning import frontier_table, pareto_frontier

    frontier = pareto_frontier(points)
    create_table_artifact(
        [p.to_dict() for p in frontier],
        key="standby-frontier",
        description="Settings no other setting beats on both cost and ETTR",
    )
    create_markdown_artifact(
        f"# Standby policy recommendation\n\n**{best.setting}**: ETTR {best.ettr:.5f}, "
        f"{best.cost_per_useful_hour:.2f} USD per useful hour (floor: {min_ettr}).\n\n"
        f"{markdown_image(plot, 'cost/ETTR frontier')}\n\n```\n{frontier_table(points)}\n```",
        key="standby-recommendation",
    )
