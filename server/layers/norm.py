"""RMSNorm, computed exactly as transformers' LlamaRMSNorm (float32 statistics, weight last)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * (x / sqrt(mean(x^2) + eps)), statistics in float32."""
    dtype = x.dtype
    if dtype == torch.float32:  # one fused kernel; the same arithmetic when nothing is downcast
        return F.rms_norm(x, weight.shape, weight, eps)
    xf = x.float()
    variance = xf.pow(2).mean(-1, keepdim=True)
    return weight * (xf * torch.rsqrt(variance + eps)).to(dtype)
