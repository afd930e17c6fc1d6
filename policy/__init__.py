"""policy/: failure traces, failure prediction and standby decisions (numpy, scikit-learn, pydantic; never torch).

- `traces`: the InfiniteHBD and LANL system 20 fault traces shipped in `policy/data/`, a documented CSV format for
  a fleet's own history (raw exports: duplicates, overlaps, byte-order mark), and the statistics that calibrate a
  policy, burst curves included;
- `telemetry`, `synthetic`: the per-node telemetry schema and a synthetic fleet calibrated to the trace (bursts
  and hazard shifts optional);
- `features`, `predictor`: rolling-window features and `FailurePredictor`, a calibrated scikit-learn estimator
  (passes the estimator checks; skops persistence with explicit trusted types; evaluation against baselines);
- `costs`, `decision`: prices (spot standbys and their reclaim rate included) and the Poisson-binomial tiered
  standby rule, with hysteresis, minimum hold, budget;
- `simulator`: event-driven replay of a trace against standby policies (ETTR, cost per useful hour), mixed-tier
  static pools among them, with a perfect-foresight oracle that is a lower bound for every policy;
- `bursts`: a compound Poisson count fitted to history, the burst-aware pool it sizes, and the burst-aware learned
  policy (per-node hazards plus the cluster tail);
- `history`: `evaluate --trace`: history-only candidates fitted on the first part of a trace, kept only with an
  edge there, else a fall-back to the static chosen there;
- `verdict`: a candidate against the static chosen on training data, judged on test data, with the frontier;
- `learned`, `pipeline`: the predictor's scores as the decision's hazards, and the train / evaluate sequence;
- `tuning`, `cli`: the cost/ETTR sweep, frontier and recommendation, and `trainmover policy ...`.

The decision itself needs only numpy and pydantic (`from policy import decide_standby`); the predictor needs
`pip install -e '.[policy]'` (scikit-learn, skops, matplotlib), which the training image does not.
"""

from policy.costs import StandbyCosts, TierCosts
from policy.decision import FleetState, NodeHazards, StandbyPlan, decide_standby

__all__ = ["FleetState", "NodeHazards", "StandbyCosts", "StandbyPlan", "TierCosts", "decide_standby"]
