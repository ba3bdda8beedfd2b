"""The SLO machinery: admission control, deadline steps, the step-cost model and its priming."""
