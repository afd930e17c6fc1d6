"""flows/: Prefect flows that run a resilient training end to end. Not built yet: see the open issues."""
