"""The SLO machinery: admission control, deadline steps, the step-cost model (the engine primes it)."""
