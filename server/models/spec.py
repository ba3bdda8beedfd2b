"""What sloserve needs from a checkpoint's config.json, read once and checked with clear errors."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from sloserve.errors import CheckpointError
from sloserve.layers.rope import ROPE_TYPES, RopeSpec

# architecture name in config.json -> family (which weight names and MLP layout it uses)
ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2_moe",
}


def supported() -> str:
    return ", ".join(ARCHITECTURES)


@dataclass(slots=True, frozen=True)
class ModelSpec:
    """Shapes and options of one decoder-only checkpoint (the executor's only view of config.json)."""

    architecture: str
    family: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope: RopeSpec
    max_position_embeddings: int
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    tie_word_embeddings: bool = False
    sliding_window: int | None = None
    moe_layers: tuple[int, ...] = ()
    num_experts: int = 0
    top_k: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    renormalize: bool = True
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    checkpoint_dtype: str | None = None

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def context_limit(self) -> int:
        """Longest sequence this executor computes exactly (a sliding window caps it)."""
        if self.sliding_window:
            return min(self.max_position_embeddings, self.sliding_window)
        return self.max_position_embeddings


def read_json(path: Path) -> dict:
    """A JSON object from `path`, or CheckpointError naming the file."""
    if not path.is_file():
        raise CheckpointError(
            f"{path} is missing: a model folder needs config.json, *.safetensors and tokenizer.json"
        )
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} must hold a JSON object")
    return data


def load_spec(folder: Path) -> ModelSpec:
    """Parse `folder/config.json` (+ generation_config.json for EOS ids)."""
    path = Path(folder) / "config.json"
    cfg = read_json(path)
    archs = cfg.get("architectures") or []
    arch = next((a for a in archs if a in ARCHITECTURES), None)
    if arch is None:
        raise CheckpointError(
            f"{path}: architecture {archs or cfg.get('model_type')!r} is not supported; "
            f"sloserve runs {supported()}"
        )
    family = ARCHITECTURES[arch]

    def need(key: str, kind: type = int):
        if key not in cfg or cfg[key] is None:
            raise CheckpointError(f"{path}: {arch} config lacks {key!r}")
        try:
            return kind(cfg[key])
        except (TypeError, ValueError) as exc:
            raise CheckpointError(
                f"{path}: {key!r} must be a {kind.__name__}, got {cfg[key]!r}"
            ) from exc

    hidden, heads = need("hidden_size"), need("num_attention_heads")
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    if heads % kv_heads:
        raise CheckpointError(
            f"{path}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}"
        )
    act = cfg.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise CheckpointError(
            f"{path}: hidden_act {act!r} is not supported (sloserve implements silu)"
        )
    kw: dict = {}
    if family == "mixtral":
        kw.update(
            num_experts=need("num_local_experts"),
            top_k=need("num_experts_per_tok"),
            moe_intermediate_size=need("intermediate_size"),
            renormalize=True,
        )
        kw["moe_layers"] = tuple(range(need("num_hidden_layers")))
    elif family == "qwen2_moe":
        num_layers, step = need("num_hidden_layers"), int(cfg.get("decoder_sparse_step", 1) or 1)
        mlp_only = set(cfg.get("mlp_only_layers") or [])
        experts = need("num_experts")
        kw.update(
            num_experts=experts,
            top_k=need("num_experts_per_tok"),
            moe_intermediate_size=need("moe_intermediate_size"),
            shared_expert_intermediate_size=int(cfg.get("shared_expert_intermediate_size") or 0),
            renormalize=bool(cfg.get("norm_topk_prob", False)),
        )
        kw["moe_layers"] = tuple(
            i
            for i in range(num_layers)
            if i not in mlp_only and experts > 0 and (i + 1) % step == 0
        )
    if kw.get("top_k", 0) > kw.get("num_experts", 0):
        raise CheckpointError(f"{path}: num_experts_per_tok exceeds the number of experts")
    return ModelSpec(
        architecture=arch,
        family=family,
        vocab_size=need("vocab_size"),
        hidden_size=hidden,
        num_layers=need("num_hidden_layers"),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=need("intermediate_size"),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope=_rope(cfg, path, head_dim),
        max_position_embeddings=need("max_position_embeddings"),
        qkv_bias=bool(cfg.get("qkv_bias", True))
        if family in ("qwen2", "qwen2_moe")
        else bool(cfg.get("attention_bias")),
        o_bias=bool(cfg.get("attention_bias")) and family == "llama",
        mlp_bias=bool(cfg.get("mlp_bias")) and family == "llama",
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        sliding_window=_sliding_window(cfg, family),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=_eos_ids(cfg, Path(folder)),
        checkpoint_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
        **kw,
    )


def _rope(cfg: dict, path: Path, head_dim: int) -> RopeSpec:
    """RoPE settings from either transformers 5's `rope_parameters` or the older rope_theta + rope_scaling."""
    params = dict(cfg.get("rope_parameters") or {})
    scaling = cfg.get("rope_scaling") or {}
    params = {**scaling, **params}
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise CheckpointError(
            f"{path}: rope type {kind!r} is not supported; sloserve implements {', '.join(ROPE_TYPES)}"
        )
    if float(params.get("partial_rotary_factor", 1.0)) != 1.0:
        raise CheckpointError(
            f"{path}: partial_rotary_factor is not supported (rotary over the whole head only)"
        )
    if head_dim % 2:
        raise CheckpointError(f"{path}: head_dim {head_dim} must be even for rotary embeddings")
    if kind == "default":
        return RopeSpec(theta=theta)
    try:
        factor = float(params["factor"])
        if kind == "linear":
            return RopeSpec(theta=theta, type=kind, factor=factor)
        return RopeSpec(
            theta=theta,
            type=kind,
            factor=factor,
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_position_embeddings=int(params["original_max_position_embeddings"]),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"{path}: rope scaling {kind!r} lacks or mangles {exc}") from exc


def _sliding_window(cfg: dict, family: str) -> int | None:
    window = cfg.get("sliding_window")
    if not window:
        return None
    if family in ("qwen2", "qwen2_moe"):
        layer_types = cfg.get("layer_types") or []
        if not cfg.get("use_sliding_window") and "sliding_attention" not in layer_types:
            return None
    return int(window)


def _eos_ids(cfg: dict, folder: Path) -> tuple[int, ...]:
    """EOS ids from generation_config.json when present (it wins, as in transformers), else config.json."""
    value = cfg.get("eos_token_id")
    gen_path = folder / "generation_config.json"
    if gen_path.is_file():
        gen = read_json(gen_path)
        value = gen.get("eos_token_id", value)
    if value is None:
        return ()
    ids = value if isinstance(value, list) else [value]
    return tuple(int(i) for i in ids)
