"""policy/: failure traces, failure prediction and standby decisions (numpy, scikit-learn, pydantic; never torch).

Built so far: `traces` (the InfiniteHBD fault trace shipped in `policy/data/`, a documented CSV format for a
fleet's own history, and the statistics that calibrate a policy) and `decision` (the Poisson-binomial tiered
standby rule of docs, with hysteresis, a minimum hold time and a budget cap; costs in `costs`).
The predictor, the fleet simulator, tuning and the `trainmover policy` CLI are still to come.
"""
