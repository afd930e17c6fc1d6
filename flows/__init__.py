"""flows/: Prefect flows that run a resilient training end to end (issue 5, in progress).

Built so far: `models.TrainingRun`, the validated parameters of a run (the form the Prefect UI renders). The flows
themselves (`resilient_training`, `train_failure_model`, `tune_standby_policy`) and `prefect.yaml` are to come.
"""
