"""`trainmover demo`: the main job, on this machine, with Prefect's ephemeral mode (no server to configure).

It runs `resilient_training` on the local provider with real processes: 2 workers train examples/train_mlp.py
(priced as a 512-node p5.48xlarge job, so the policy weighs real stakes), telemetry runs a day in about 25 s, one
node degrades (corrected ECC climbing, then XID 48), the policy pre-warms a standby, the drill SIGKILLs that node's
worker and the runtime swaps the standby in; then a second, unpredicted worker is killed and the parked (stopped)
standby covers it from a cold start. It prints what happened and the same run's cost under checkpoint-restart.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any


def _prefect_env() -> None:
    # FACTS.md: without these the ephemeral server prints telemetry tracebacks or times out on its first start.
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")


def demo_run(steps: int = 1500) -> Any:
    import examples.train_mlp
    from flows.models import StandbyLimits, TrainingRun

    return TrainingRun(
        job_id="trainmover-demo",
        provider="local",
        instance_type="p5.48xlarge",
        workers=2,
        job_nodes=512,
        standby=StandbyLimits(min_warm=0, max_warm=2, max_stopped=1),
        script=str(Path(examples.train_mlp.__file__)),
        # At least 12 ms a step (18 s for 1,500): on an idle machine the tiny model trains faster than the drill's
        # wall-clock telemetry degrades a node, and the second kill found training already over.
        script_args=("--min-step-ms", "12"),
        steps=steps,
    )


def run_demo(steps: int = 1500) -> int:
    _prefect_env()
    from flows.training import resilient_training

    run = demo_run(steps)
    print(
        "TrainMover demo: the resilient_training flow on this machine (Prefect ephemeral mode), 2 workers of "
        f"examples/train_mlp.py for {steps} steps, priced as a 512-node job; telemetry: 1 s = 1 h."
    )
    t0 = time.time()
    summary = resilient_training(run=run, drill=True, time_scale=3600.0, policy_every_s=0.5, max_wall_s=170.0)
    print()
    for line in summary.get("drill", []):
        print(f"drill: {line}")
    for i in summary["interruptions"]:
        print(
            f"interruption: rank {i['rank']} ({i['cause']}) -> {i['new_process']} [{i['tier']}], "
            f"{'predicted' if i['predicted'] else 'unpredicted'}: lost {i['lost_time_s']:.2f} s "
            f"(detect {i['detect_s']:.3f}, reconfigure {i['reconfigure_s']:.3f}, handoff {i['handoff_s']:.3f}, "
            f"replay {i['replay_s']:.3f})"
        )
    n = len(summary["interruptions"])
    print(
        f"\n{n} interruption(s): {summary['downtime_s']:.2f} s of downtime ({summary['downtime_cost_usd']:.2f} USD), "
        f"standbys {summary['standby_cost_usd']:.2f} USD; ETTR {summary['ettr']:.5f}.\n"
        f"Under checkpoint-restart the same failures would have cost {summary['restart_downtime_s']:.0f} s "
        f"({summary['restart_cost_usd']:.2f} USD), ETTR {summary['restart_ettr']:.5f}."
    )
    print(
        "(The demo's telemetry clock runs 1 s = 1 h, so standby hours and ETTR are on that clock; downtimes are "
        "the real seconds measured.)"
    )
    print(f"final state digest {str(summary.get('final_digest'))[:12]}; demo took {time.time() - t0:.0f} s")
    return 0 if n >= 1 else 1
