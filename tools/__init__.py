"""Maintainer scripts, run from the repository root as `python -m tools.NAME`: the built-in model's
training (train_default) and evaluation (eval_default)."""
