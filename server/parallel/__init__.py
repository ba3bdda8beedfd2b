"""Tensor parallelism over torch.distributed: ranks in processes of their own, rank 0 drives (see runner.py)."""
