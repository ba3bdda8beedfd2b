"""The scheduler: which tokens of which requests run in each step (plain Python, no torch)."""
