"""policy/: failure traces, failure prediction and standby decisions (numpy, scikit-learn, pydantic; never torch).

Built so far (issue 3 is in progress):
- `traces`: the InfiniteHBD fault trace shipped in `policy/data/` (Apache-2.0), a documented CSV format for a
  fleet's own history, and the statistics that calibrate a policy;
- `telemetry`, `synthetic`: the per-node telemetry schema and a synthetic fleet calibrated to the trace;
- `features`, `predictor`: rolling-window features and `FailurePredictor`, a calibrated scikit-learn estimator
  (passes the estimator checks; skops persistence with explicit trusted types; evaluation against baselines);
- `costs`, `decision`: prices and the Poisson-binomial tiered standby rule, with hysteresis, minimum hold, budget;
- `simulator`: event-driven replay of a trace against standby policies (ETTR, cost per useful hour). Known
  defect: its window oracle is not yet a lower bound (an xfail test records it).
- `tuning`, `cli`: the cost/ETTR sweep, frontier and recommendation, and `trainmover policy simulate|tune|generate`.
Still to come: `train`/`evaluate` subcommands and the held-out comparison for the 15% target. Install with
`pip install -e '.[policy]'` (scikit-learn, skops, matplotlib): the training image does not need them.
"""
