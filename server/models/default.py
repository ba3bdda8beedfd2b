"""Built-in models, no download needed: one trained checkpoint that ships, and random-weight ones.

'default' is a 3.1M-parameter Llama trained on ARC-AGI-2 grids (``tools/train_default.py``); its
folder ships inside the package (``weights/default``). 'default-random' is a ~40M-parameter Llama
(hidden 512, 8 layers, GQA 8/2) and 'default-moe' a small Mixtral (8 experts, top-2), both with
deterministic random weights: pure architectures for tests and benchmarks. All use the byte-level
tokenizer (one token per byte, so one per ARC digit). Random folders are built on first use,
cached under $XDG_CACHE_HOME/sloserve (or ~/.cache/sloserve) and written atomically: built in a
temporary folder beside the target, then renamed into place.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file
from sloserve.tokenizer import save_byte_level_tokenizer

_VERSION = "v2"  # v2: the folders carry chat_template.jinja
TRAINED = "default"
TRAINED_DIR = Path(__file__).resolve().parent / "weights" / TRAINED
_COMMON = {
    "vocab_size": 264,
    "bos_token_id": 256,
    "eos_token_id": 257,
    "pad_token_id": 258,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "max_position_embeddings": 16384,
    "initializer_range": 0.02,
    "torch_dtype": "float32",
}
MODELS: dict[str, dict] = {  # the random-weight models
    "default-random": {
        **_COMMON,
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 512,
        "intermediate_size": 2816,
        "num_hidden_layers": 8,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 64,
    },
    "default-moe": {
        **_COMMON,
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "sliding_window": None,
    },
}


def cache_root() -> Path:
    """$XDG_CACHE_HOME/sloserve, else ~/.cache/sloserve."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "sloserve"


BUILTIN_MODELS = (TRAINED, "default-moe", "default-random")


def ensure_default_model(name: str = "default", cache_dir: Path | None = None) -> Path:
    """The folder of built-in model `name`: the shipped one, or a random one built once (atomically)."""
    if name == TRAINED:
        if not (TRAINED_DIR / "model.safetensors").is_file():
            raise FileNotFoundError(
                f"the trained default model is missing from {TRAINED_DIR}: reinstall "
                "sloserve, or run tools/train_default.py in a checkout"
            )
        return TRAINED_DIR
    if name not in MODELS:
        raise ValueError(
            f"unknown built-in model {name!r}; choose one of {', '.join(BUILTIN_MODELS)}"
        )
    root = Path(cache_dir) if cache_dir is not None else cache_root()
    folder = root / f"{name}-{_VERSION}"
    if (folder / "config.json").is_file():
        return folder
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=root))
    try:
        _write(staging, MODELS[name], seed=0)
        for path in staging.iterdir():
            path.chmod(0o644)
        staging.chmod(0o755)  # mkdtemp makes it private
        try:
            os.rename(staging, folder)
        except OSError:  # another process finished first: keep its folder
            if not (folder / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return folder


def _shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape in Hugging Face naming for the Llama or Mixtral config `cfg`."""
    h, v, inter = cfg["hidden_size"], cfg["vocab_size"], cfg["intermediate_size"]
    q, kv = (
        cfg["num_attention_heads"] * cfg["head_dim"],
        cfg["num_key_value_heads"] * cfg["head_dim"],
    )
    shapes = {
        "model.embed_tokens.weight": (v, h),
        "model.norm.weight": (h,),
        "lm_head.weight": (v, h),
    }
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, q),
        }
        if "num_local_experts" in cfg:
            moe = p + "block_sparse_moe."
            shapes[moe + "gate.weight"] = (cfg["num_local_experts"], h)
            for e in range(cfg["num_local_experts"]):
                shapes |= {
                    moe + f"experts.{e}.w1.weight": (inter, h),
                    moe + f"experts.{e}.w3.weight": (inter, h),
                    moe + f"experts.{e}.w2.weight": (h, inter),
                }
        else:
            shapes |= {
                p + "mlp.gate_proj.weight": (inter, h),
                p + "mlp.up_proj.weight": (inter, h),
                p + "mlp.down_proj.weight": (h, inter),
            }
    return shapes


def _write(folder: Path, cfg: dict, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, shape in sorted(_shapes(cfg).items()):
        if name.endswith("norm.weight"):
            tensors[name] = torch.ones(shape)
        else:
            tensors[name] = torch.empty(shape).normal_(0.0, cfg["initializer_range"], generator=gen)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    write_tokenizer_files(folder, cfg)


def write_tokenizer_files(folder: Path, cfg: dict) -> None:
    """generation_config.json, the byte-level tokenizer files and the chat template of a built-in model."""
    generation = {
        "bos_token_id": cfg["bos_token_id"],
        "eos_token_id": cfg["eos_token_id"],
        "pad_token_id": cfg["pad_token_id"],
    }
    (folder / "generation_config.json").write_text(json.dumps(generation, indent=2))
    save_byte_level_tokenizer(folder, cfg["max_position_embeddings"])
    (folder / "chat_template.jinja").write_text(CHAT_TEMPLATE)


# The chat template of the built-in models: a chat is the ARC prompt they were trained on
# (tools/train_default.py): <s>, then each user turn a grid as "Input:\n<rows>\nOutput:\n" (the
# labels added when the user left them out), each assistant turn the answer grid and the blank line
# that separates few-shot pairs. The model then writes the next grid and stops with </s>. A system
# prompt is not rendered: the model knows no instructions, only grids.
CHAT_TEMPLATE = r"""{{- bos_token -}}
{%- for message in messages -%}
{%- set text = (message.content if message.content is string else '') | trim -%}
{%- if message.role == 'user' -%}
{%- if not text.startswith('Input:') %}{% set text = 'Input:\n' + text %}{% endif -%}
{%- if not text.endswith('Output:') %}{% set text = text + '\nOutput:' %}{% endif -%}
{{- text + '\n' -}}
{%- elif message.role == 'assistant' -%}
{%- generation %}{{ text + '\n' }}{% endgeneration -%}
{%- if not loop.last %}{{ '\n' }}{% endif -%}
{%- elif message.role != 'system' -%}
{{- raise_exception("the built-in model takes system, user and assistant messages, not " + message.role) -}}
{%- endif -%}
{%- endfor -%}
"""
