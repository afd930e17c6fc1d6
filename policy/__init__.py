"""policy/: failure prediction and standby decisions (scikit-learn). Not built yet: see the open issues."""
