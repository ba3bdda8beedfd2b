"""Tiny random-weight Hugging Face checkpoints of the four supported families, built for tests.

Built with transformers' own config classes and `save_pretrained(safe_serialization=True)`, with
the byte-level tokenizer (token id == byte; <s>=256, </s>=257, <pad>=258). transformers is imported
lazily so that test areas which never build a checkpoint do not pay for it.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
from pathlib import Path

ARCHS = ("llama", "qwen2", "mixtral", "qwen2_moe")

_COMMON = dict(
    vocab_size=260,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    rms_norm_eps=1e-6,
    bos_token_id=256,
    eos_token_id=257,
    pad_token_id=258,
    tie_word_embeddings=False,
    # NOTE: a wider init than transformers' 0.02 makes logits and router scores far from ties,
    # so greedy equality checks are not decided by float rounding.
    initializer_range=0.1,
)
_EXTRA = {
    "llama": {},
    "qwen2": {},
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": dict(
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=64,
        norm_topk_prob=False,
        decoder_sparse_step=1,
    ),
}


def tiny_config(arch: str, **overrides):
    """The transformers config object of a tiny `arch` model (overrides win)."""
    import transformers

    classes = {
        "llama": transformers.LlamaConfig,
        "qwen2": transformers.Qwen2Config,
        "mixtral": transformers.MixtralConfig,
        "qwen2_moe": transformers.Qwen2MoeConfig,
    }
    if arch not in classes:
        raise ValueError(f"unknown tiny arch {arch!r}; choose one of {', '.join(ARCHS)}")
    return classes[arch](**{**_COMMON, **_EXTRA[arch], **overrides})


def tiny_checkpoint(
    arch: str, tmp_root: Path, *, seed: int = 0, dtype: str = "float32", **overrides
) -> Path:
    """Folder holding a tiny `arch` checkpoint (built once per distinct arguments under tmp_root),
    saved in `dtype` (the float32 weights rounded to it)."""
    key = [seed, overrides] if dtype == "float32" else [seed, overrides, dtype]
    digest = hashlib.sha1(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:8]
    folder = Path(tmp_root) / f"{arch}-{digest}"
    if (folder / "config.json").is_file():
        return folder
    import torch
    from sloserve.tokenizer import save_byte_level_tokenizer
    from transformers import AutoModelForCausalLM

    config = tiny_config(arch, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # init leaves biases at 0 and norms at 1: make their loading observable
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0.0, 0.1)
            elif "norm" in name:
                param.normal_(1.0, 0.1)
    model.to(getattr(torch, dtype))
    staging = folder.with_name(folder.name + f".tmp{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    model.save_pretrained(staging, safe_serialization=True)
    save_byte_level_tokenizer(staging, config.max_position_embeddings)
    staging.rename(folder)
    return folder


def load_hf_model(folder: Path):
    """The transformers model of a checkpoint folder, float32, eval mode, eager attention."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager"
    )
    return model.eval()


def hf_greedy(model, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers' greedy `generate` on each prompt alone: the new token ids of each."""
    import torch
    from transformers import GenerationConfig

    # NOTE: no EOS handling (and no min_new_tokens, which would mask EOS): plain argmax each step.
    config = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=258)
    model.generation_config.eos_token_id = None
    outputs = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
            assert out.shape[1] == len(prompt) + max_new_tokens, "generate stopped early"
            outputs.append(out[0, len(prompt) :].tolist())
    return outputs


@functools.cache
def hf_log_softmax(folder: Path, tokens: tuple[int, ...]):
    """transformers' float32 log-softmax [T, V] of a checkpoint's logits at every position of `tokens`."""
    import torch

    with torch.no_grad():
        return load_hf_model(folder)(torch.tensor([tokens])).logits[0].float().log_softmax(dim=-1)
