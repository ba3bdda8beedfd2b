"""Speculative decoding: proposers of draft tokens and their greedy verification (plain Python)."""
