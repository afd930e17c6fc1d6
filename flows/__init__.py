"""flows/: Prefect flows that run a resilient training end to end, train the failure model and tune the policy.

- `models`: `TrainingRun`, the validated parameters of a run (the form the Prefect UI renders);
- `supervisor`: one job's life without Prefect: provision, start, steer standbys by the policy, report, release;
- `training`: the `resilient_training` flow around the supervisor (events, artifacts, logs);
- `ownership`: one owner per job (a Prefect global concurrency limit keyed by the job id);
- `endings`: how a run that does not finish says so (failed, cancelled, crashed) and its crash hook;
- `holdings`: the record of what a job holds now, which the crash hook reads;
- `policy_flows`: `train_failure_model` and `tune_standby_policy`;
- `drill`, `demo`: the scripted telemetry and kills of `trainmover demo`.
"""
