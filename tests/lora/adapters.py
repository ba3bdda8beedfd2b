"""PEFT adapters for tests, with random non-zero A and B, and transformers' tokens through them."""

from __future__ import annotations

import functools
from pathlib import Path

ALL_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_adapter(
    base: Path,
    out: Path,
    *,
    rank: int,
    seed: int,
    targets: tuple[str, ...] = ALL_MODULES,
    rslora: bool = False,
    alpha: float | None = None,
    saved: tuple[str, ...] = (),
) -> Path:
    """Save a PEFT LoRA adapter of `base` in `out` (built once): A and B drawn at random, since
    PEFT's own init leaves B at zero and the adapter would change nothing; `saved` are its
    modules_to_save (embed_tokens, lm_head), their copies moved off the base's values."""
    if (out / "adapter_model.safetensors").is_file():
        return out
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    # NOTE: alpha 2r gives LoRA's scale 2 and rsLoRA's 2 sqrt(r): a wrong formula changes tokens
    config = LoraConfig(
        r=rank,
        lora_alpha=2 * rank if alpha is None else alpha,
        target_modules=list(targets),
        use_rslora=rslora,
        lora_dropout=0.0,
        modules_to_save=list(saved) or None,
    )
    peft_model = get_peft_model(model, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            scale = config.lora_alpha / (rank**0.5 if rslora else rank)
            if "lora_A" in name:
                param.copy_(torch.randn(param.shape, generator=gen) / param.shape[1] ** 0.5)
            elif "lora_embedding_A" in name:  # [r, V]: a token picks a column
                param.copy_(torch.randn(param.shape, generator=gen))
            elif "lora_B" in name or "lora_embedding_B" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.3 / (scale * rank**0.5))
            elif "modules_to_save" in name:
                param.add_(torch.randn(param.shape, generator=gen) * 0.05)
    peft_model.save_pretrained(out, safe_serialization=True)
    return out


@functools.cache
def merged_greedy(
    base: Path, adapter: Path | None, prompts: tuple[tuple[int, ...], ...], new_tokens: int
) -> list[list[int]]:
    """transformers' greedy tokens (float32) of `base` with PEFT's merge_and_unload() of `adapter`
    (None: the base model)."""
    from peft import PeftModel

    from tests.checkpoints import hf_greedy, load_hf_model

    model = load_hf_model(base)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter).merge_and_unload().eval()
    return hf_greedy(model, [list(p) for p in prompts], new_tokens)
