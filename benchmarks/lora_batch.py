"""Many LoRA adapters in one batch against the base model: output tokens per second of the same
load (N concurrent greedy requests) with no adapter, and spread over A adapters of rank R.

Arms, in alternating rounds (the best round of each counts), on one LLM:
  base       every request on the base model (decode steps take the fused C step where it runs)
  base-flat  the same, with the decode fast path off: every step on the batched torch path, the
             path a step with adapters takes, so `lora/base-flat` is the deltas' own cost
  lora       request i on adapter i % A

The adapters are written in PEFT's format with random A and B (no peft needed).

    python -m benchmarks.lora_batch [--model default-random] [--requests 16] [--adapters 8] [--rank 64]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file
from sloserve import LLM
from sloserve.lora.peft_format import module_dims
from sloserve.models.default import ensure_default_model
from sloserve.models.spec import load_spec
from sloserve.sampling_params import SamplingParams

from benchmarks._output import OUT, write_json

MODULES = {
    "self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"),
    "mlp": ("gate_proj", "up_proj", "down_proj"),
}


def write_adapter(folder: Path, base: Path, rank: int, seed: int) -> Path:
    """A PEFT LoRA adapter of `base` on every projection, A and B random."""
    spec = load_spec(base)
    dims = module_dims(spec)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(spec.num_layers):
        for block, names in MODULES.items():
            for name in names:
                fan_in, fan_out = dims[name]
                prefix = f"base_model.model.model.layers.{layer}.{block}.{name}."
                tensors[prefix + "lora_A.weight"] = (
                    torch.randn(rank, fan_in, generator=gen) / fan_in**0.5
                )
                tensors[prefix + "lora_B.weight"] = torch.randn(fan_out, rank, generator=gen) * 0.01
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(dims)}
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return folder


def tokens_per_second(
    llm: LLM, prompts: list[list[int]], params: SamplingParams, adapters
) -> float:
    started = time.perf_counter()
    outputs = llm.generate(prompts, params, adapter=adapters)
    elapsed = time.perf_counter() - started
    return sum(len(o.token_ids) for o in outputs) / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default-random")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--rank", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=OUT / "lora_batch.json")
    args = parser.parse_args()
    base = Path(args.model) if Path(args.model).is_dir() else ensure_default_model(args.model)
    with tempfile.TemporaryDirectory() as tmp:
        names = [f"a{i}" for i in range(args.adapters)]
        modules = " ".join(
            f"{n}={write_adapter(Path(tmp) / n, base, args.rank, i)}" for i, n in enumerate(names)
        )
        llm = LLM(str(base), device="cpu", lora_modules=modules, prefix_cache=False)
        runner = llm.engine.runner
        gen = torch.Generator().manual_seed(0)
        prompts = [
            [256, *torch.randint(0, 250, (args.prompt_tokens - 1,), generator=gen).tolist()]
            for _ in range(args.requests)
        ]
        params = SamplingParams(max_tokens=args.new_tokens, ignore_eos=True)
        spread = [names[i % len(names)] for i in range(args.requests)]
        fast = runner.decode_step
        arms = {"base": None, "base-flat": None, "lora": spread}
        best = dict.fromkeys(arms, 0.0)
        tokens_per_second(llm, prompts[:2], params, None)  # warm
        for _ in range(args.rounds):
            for arm, adapters in arms.items():
                runner.decode_step = None if arm == "base-flat" else fast
                best[arm] = max(best[arm], tokens_per_second(llm, prompts, params, adapters))
        runner.decode_step = fast
        llm.close()
    print(
        f"{args.model}: {args.requests} requests x {args.new_tokens} tokens, {args.adapters} "
        f"adapters of rank {args.rank}, best of {args.rounds} rounds, load {os.getloadavg()[0]:.1f}"
    )
    for arm, value in best.items():
        print(f"  {arm:<10} {value:8.1f} out tok/s")
    print(
        f"  lora/base {best['lora'] / best['base']:.2f}   "
        f"lora/base-flat {best['lora'] / best['base-flat']:.2f}"
    )
    write_json(args.out, {"args": {k: str(v) for k, v in vars(args).items()}, "tok_s": best})


if __name__ == "__main__":
    main()
