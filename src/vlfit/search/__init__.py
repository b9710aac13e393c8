"""``vlfit search``: the search space, the Optuna study, one trial as one training run, and the reports."""
