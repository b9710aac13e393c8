"""Training: the Trainer with vlfit's device stage and data-wait accounting, and the train/eval entry points."""
