"""Read a local Hugging Face folder: config, (sharded) safetensors, into fused per-layer weights.

Weights are fused as they load so a step runs one matmul where transformers runs several:
q/k/v -> qkv[(Hq + 2 Hkv) * D, H]; gate/up -> gate_up[2I, H]; experts -> w13[E, 2I, H], w2[E, H, I].
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from sloserve.errors import CheckpointError
from sloserve.layers.linear import DenseLinear, Linear
from sloserve.models.default import BUILTIN_MODELS, ensure_default_model
from sloserve.models.quant_formats import (
    check_quantized,
    float_weight,
    quantized_projection,
    read_quant_config,
)
from sloserve.models.safetensors_file import CHUNK_BYTES, Entry, SafetensorsFile
from sloserve.models.shard import Shard, local_spec
from sloserve.models.spec import ModelSpec, load_spec, read_json
from sloserve.models.weights import LayerWeights, ModelWeights


def resolve_model_path(path: str | Path) -> Path:
    """A built-in name (see BUILTIN_MODELS) -> its folder; a folder -> itself; else CheckpointError."""
    if str(path) in BUILTIN_MODELS:
        return ensure_default_model(str(path))
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise CheckpointError(
            f"model path {str(path)!r} is not a folder: pass a local Hugging Face folder "
            f"(config.json, *.safetensors, tokenizer.json) or one of {', '.join(BUILTIN_MODELS)}"
        )
    return folder


class TensorSource:
    """Name -> tensor over one or many safetensors files, read without a memory map; errors name the file.

    Each tensor is read into memory of its own (models/safetensors_file.py), so what a load holds
    is the weights it keeps, never the file's pages beside them.
    """

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._files: dict[Path, SafetensorsFile] = {}
        # NOTE: one conversion buffer for the whole load: a fresh one per tensor leaves the
        # allocator's heap fragmented by hundreds of MiB that outlive the load
        self._scratch: torch.Tensor | None = None
        index = folder / "model.safetensors.index.json"
        if index.is_file():
            weight_map = read_json(index).get("weight_map")
            if not isinstance(weight_map, dict):
                raise CheckpointError(f"{index} lacks a 'weight_map' object")
            self._where = {name: folder / file for name, file in weight_map.items()}
        else:
            files = sorted(folder.glob("*.safetensors"))
            if not files:
                raise CheckpointError(
                    f"{folder} holds no *.safetensors file (sloserve loads safetensors only; "
                    "re-save the model with save_pretrained(safe_serialization=True))"
                )
            self._where = {}
            for file in files:
                for name in self._open(file).keys():
                    self._where[name] = file
        for file in sorted(set(self._where.values())):
            if not file.is_file():
                raise CheckpointError(
                    f"shard {file.name} named in {index.name} is missing from {folder}"
                )

    def _open(self, file: Path) -> SafetensorsFile:
        if file in self._files:
            return self._files[file]
        try:
            opened = SafetensorsFile(file)
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"{file} is not a readable safetensors file: {exc}") from exc
        self._files[file] = opened
        return opened

    def has(self, name: str) -> bool:
        return name in self._where

    def entry(self, name: str) -> Entry:
        """Dtype and shape of the tensor `name` from its file's header (nothing is read)."""
        file = self._where.get(name)
        if file is None:
            raise CheckpointError(f"{self.folder}: tensor {name!r} is missing from the checkpoint")
        opened = self._open(file)
        if name not in opened.entries:
            raise CheckpointError(f"{file}: tensor {name!r} is missing from the file")
        return opened.entries[name]

    def get(
        self,
        name: str,
        shape: tuple[int, ...],
        part: tuple[int, slice] | None = None,
        *,
        dtype: torch.dtype | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The tensor `name` on the CPU, checked against the shape the config implies.

        With `part` = (dim, slice), only that slice along that dimension is read from the file
        (a tensor-parallel rank's share; the rest of the tensor is never loaded). In `dtype`
        (default: the file's), or into `out` (see SafetensorsFile.read).
        """
        file = self._where.get(name)
        if file is None:
            raise CheckpointError(f"{self.folder}: tensor {name!r} is missing from the checkpoint")
        opened = self._open(file)
        if name not in opened.entries:
            raise CheckpointError(f"{file}: tensor {name!r} is missing from the file")
        found = opened.shape(name)
        if found != tuple(shape):
            raise CheckpointError(
                f"{file}: tensor {name!r} has shape {found}, but config.json implies {tuple(shape)}"
            )
        try:
            if self._scratch is None:
                self._scratch = torch.empty(CHUNK_BYTES, dtype=torch.uint8)
            return opened.read(name, part, dtype=dtype, out=out, scratch=self._scratch)
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"{file}: cannot read tensor {name!r}: {exc}") from exc


# (weight, bias) -> the projection that holds them: DenseLinear, or a kind that converts them
MakeDense = Callable[[torch.Tensor, torch.Tensor | None], Linear]


def load_checkpoint(
    folder: Path,
    device: torch.device,
    dtype: torch.dtype,
    *,
    expert_slots: int | None = None,
    experts_on_host: bool = False,
    shard: Shard = Shard(),
    make_dense: MakeDense = DenseLinear,
    make_head: MakeDense | None = None,
) -> tuple[ModelSpec, ModelWeights]:
    """Spec and fused weights of the checkpoint in `folder`, on `device` in `dtype`.

    With `expert_slots` fewer than the checkpoint's experts (partial expert residency), or with
    `experts_on_host` (residency not decided yet: the runner measures the device budget after the
    dense weights), the routed experts stay in host memory: the ExpertStore moves them to the
    device, all at once or into slots as steps need them, so they never all sit on the device
    unless they fit.

    With `shard` (a tensor-parallel rank), only that rank's part of each split weight is read
    (see models/shard.py) and the spec returned is the rank's local one.

    Each dense projection (qkv, o, gate_up, down: a dense MLP's or a shared expert's) becomes
    `make_dense(weight, bias)` as soon as its weight is assembled (this rank's slice of it), before
    the next one is read: a factory that converts (int8 quantizing, layers/quant.py) lets the
    weight in `dtype` go, so the load never holds the whole model in `dtype`.

    With `make_head` (int8), the embedding becomes `make_head(embedding, None)` as it is read, the
    embedding of ModelWeights and a tied LM head both (one object); an untied head becomes
    `make_head(head, None)`.

    A quantized checkpoint (`quantization_config`, models/quant_formats.py) has every shape
    and field checked from the files' headers before anything is read; each quantized projection
    becomes the kind that keeps its packed weight, never a `dtype` copy (`make_dense` is not called
    for it).
    """
    full = load_spec(folder)
    spec = local_spec(full, shard.size)
    src = TensorSource(folder)
    quant = read_quant_config(folder)
    if quant is not None:
        if shard.size > 1:
            raise CheckpointError(
                f"{folder} is quantized ({quant.describe()}); tensor parallelism does not "
                "split quantized checkpoints yet: drop --tensor-parallel-size"
            )
        check_quantized(full, src, quant)
    partial = bool(spec.moe_layers) and expert_slots is not None and expert_slots < spec.num_experts
    expert_device = torch.device("cpu") if partial or experts_on_host else device

    def get(
        name: str,
        *shape: int,
        on: torch.device = device,
        part: tuple[int, slice] | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The weight in `dtype` on `on` (read into `out` when given)."""
        if quant is not None and not src.has(name):
            # NOTE: a quantized Linear that the model keeps in float (GPTQ/AWQ MoE experts)
            weight = float_weight(quant, src, name, shape, dtype)
            if weight is not None:
                return weight.to(on) if out is None else out.copy_(weight)
        if on.type == "cpu":
            return src.get(name, shape, part, dtype=dtype, out=out)
        tensor = src.get(name, shape, part).to(device=on, dtype=dtype)
        return tensor if out is None else out.copy_(tensor)

    def cat(
        names: list[str],
        shapes: list[tuple[int, ...]],
        on: torch.device = device,
        parts: list[tuple[int, slice] | None] | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The weights joined along dim 0 (parts, if any, slice dim 0 too), read into `out` when given."""
        parts = parts or [None] * len(names)
        pairs = zip(shapes, parts, strict=True)
        rows = [len(range(*p[1].indices(s[0]))) if p else s[0] for s, p in pairs]
        if out is None:
            out = torch.empty(sum(rows), *shapes[0][1:], dtype=dtype, device=on)
        at = 0
        # NOTE: each read lands in its rows of the result: no part is held beside it
        for n, s, p, r in zip(names, shapes, parts, rows, strict=True):
            get(n, *s, on=on, part=p, out=out[at : at + r])
            at += r
        return out

    def stacked(
        make: Callable[[int, torch.Tensor | None], torch.Tensor], count: int
    ) -> torch.Tensor:
        """[count, ...] of make(x, into) for each x: the first sizes it, the rest are read in place."""
        first = make(0, None)
        out = torch.empty((count, *first.shape), dtype=first.dtype, device=first.device)
        out[0].copy_(first)
        del first
        for x in range(1, count):
            make(x, out[x])
        return out

    h, v = spec.hidden_size, spec.vocab_size
    embed = get("model.embed_tokens.weight", v, h)
    if make_head is not None:
        embed = make_head(embed, None)
    if spec.tie_word_embeddings or not src.has("lm_head.weight"):
        if not spec.tie_word_embeddings:
            raise CheckpointError(
                f"{folder}: tensor 'lm_head.weight' is missing and tie_word_embeddings is false"
            )
        # the embedding itself, held once
        lm_head = embed if make_head is not None else DenseLinear(embed)
    else:
        lm_head = (make_head or DenseLinear)(get("lm_head.weight", v, h), None)

    def linear(
        names: list[str],
        shapes: list[tuple[int, int]],
        parts: list[tuple[int, slice] | None],
        bias: torch.Tensor | None,
    ) -> Linear:
        """The projection of the Linear weights `names` joined along their output rows."""
        modules = [n.removesuffix(".weight") for n in names]
        if quant is not None:
            proj = quantized_projection(quant, src, modules, shapes, dtype, bias, make_dense)
            if proj is not None:
                return proj
        if len(names) == 1:
            return make_dense(get(names[0], *shapes[0], part=parts[0]), bias)
        return make_dense(cat(names, shapes, parts=parts), bias)

    layers, experts = [], {}
    for i in range(spec.num_layers):
        layer, routed = _load_layer(full, shard, i, get, cat, stacked, src, expert_device, linear)
        layers.append(layer)
        if routed is not None:
            experts[i] = routed
    return spec, ModelWeights(
        embed=embed,
        norm=get("model.norm.weight", h),
        lm_head=lm_head,
        layers=layers,
        experts=experts,
    )


Getter = Callable[..., torch.Tensor]


def _load_layer(
    spec: ModelSpec,
    shard: Shard,
    i: int,
    get: Getter,
    cat: Callable,
    stacked: Callable,
    src: TensorSource,
    expert_device: torch.device,
    linear: Callable[..., Linear],
):
    """Layer i's fused weights (this rank's part of them), checked against the full `spec`'s shapes."""
    h, d = spec.hidden_size, spec.head_dim
    p = f"model.layers.{i}."
    q, kv = spec.q_size, spec.kv_size
    attn = p + "self_attn."
    qh, kvh = shard.q_heads(spec), shard.kv_heads(spec)
    rows = [(0, slice(qh.start * d, qh.stop * d))] + [(0, slice(kvh.start * d, kvh.stop * d))] * 2
    whole = shard.size == 1
    qkv_names = [attn + f"{n}_proj.weight" for n in "qkv"]
    layer = LayerWeights(
        ln1=get(p + "input_layernorm.weight", h),
        ln2=get(p + "post_attention_layernorm.weight", h),
        qkv=linear(
            qkv_names,
            [(q, h), (kv, h), (kv, h)],
            [None] * 3 if whole else rows,
            cat(
                [attn + f"{n}_proj.bias" for n in "qkv"],
                [(q,), (kv,), (kv,)],
                parts=None if whole else rows,
            )
            if spec.qkv_bias
            else None,
        ),
        o=linear(
            [attn + "o_proj.weight"],
            [(h, spec.num_heads * d)],
            [None if whole else (1, slice(qh.start * d, qh.stop * d))],
            get(attn + "o_proj.bias", h) if spec.o_bias and shard.owns_bias else None,
        ),
    )

    def split(n: int, dim: int) -> tuple[int, slice] | None:
        return None if whole else (dim, shard.split(n))

    if i not in spec.moe_layers:
        mlp, inter = p + "mlp.", spec.intermediate_size
        up_rows = [split(inter, 0)] * 2
        gate_up_b = down_b = None
        if spec.mlp_bias:
            gate_up_b = cat(
                [mlp + "gate_proj.bias", mlp + "up_proj.bias"], [(inter,), (inter,)], parts=up_rows
            )
            down_b = get(mlp + "down_proj.bias", h) if shard.owns_bias else None
        layer.gate_up = linear(
            [mlp + "gate_proj.weight", mlp + "up_proj.weight"],
            [(inter, h), (inter, h)],
            up_rows,
            gate_up_b,
        )
        layer.down = linear([mlp + "down_proj.weight"], [(h, inter)], [split(inter, 1)], down_b)
        return layer, None
    e, inter = spec.num_experts, spec.moe_intermediate_size
    if spec.family == "mixtral" and not src.has(p + "mlp.experts.gate_up_proj"):
        moe = p + "block_sparse_moe."
        layer.router = DenseLinear(get(moe + "gate.weight", e, h))
        names = [moe + f"experts.{x}.w{{}}.weight" for x in range(e)]  # w1 gate, w3 up, w2 down
        return layer, _stacked_experts(
            names, (1, 3, 2), inter, h, split, get, cat, stacked, expert_device
        )
    moe = p + "mlp."
    layer.router = DenseLinear(get(moe + "gate.weight", e, h))
    if src.has(moe + "experts.gate_up_proj"):  # transformers 5's fused in-memory layout
        fused = moe + "experts.gate_up_proj"
        if whole:
            w13 = get(fused, e, 2 * inter, h, on=expert_device)
        else:  # gate rows [0, I) and up rows [I, 2I): this rank's part of each
            part = shard.split(inter)
            up = slice(inter + part.start, inter + part.stop)
            w13 = torch.cat(
                [
                    get(fused, e, 2 * inter, h, on=expert_device, part=(1, part)),
                    get(fused, e, 2 * inter, h, on=expert_device, part=(1, up)),
                ],
                dim=1,
            )
        w2 = get(moe + "experts.down_proj", e, h, inter, on=expert_device, part=split(inter, 2))
    else:
        names = [moe + f"experts.{x}.{{}}_proj.weight" for x in range(e)]
        w13, w2 = _stacked_experts(
            names, ("gate", "up", "down"), inter, h, split, get, cat, stacked, expert_device
        )
    if spec.shared_expert_intermediate_size:
        shared, s = moe + "shared_expert.", spec.shared_expert_intermediate_size
        layer.gate_up = linear(
            [shared + "gate_proj.weight", shared + "up_proj.weight"],
            [(s, h), (s, h)],
            [split(s, 0)] * 2,
            None,
        )
        layer.down = linear([shared + "down_proj.weight"], [(h, s)], [split(s, 1)], None)
        layer.shared_gate = DenseLinear(get(moe + "shared_expert_gate.weight", 1, h))
    return layer, (w13, w2)


def _stacked_experts(
    names: list[str],
    kinds: tuple,
    inter: int,
    h: int,
    split: Callable,
    get: Getter,
    cat: Callable,
    stacked: Callable,
    on: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    """w13 [E, 2I, H] (gate then up) and w2 [E, H, I] of per-expert tensors `names[x].format(kind)`."""
    gate, up, down = kinds
    w13 = stacked(
        lambda x, into: cat(
            [names[x].format(gate), names[x].format(up)],
            [(inter, h), (inter, h)],
            on=on,
            parts=[split(inter, 0)] * 2,
            out=into,
        ),
        len(names),
    )
    w2 = stacked(
        lambda x, into: get(names[x].format(down), h, inter, on=on, part=split(inter, 1), out=into),
        len(names),
    )
    return w13, w2
