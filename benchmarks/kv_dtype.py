"""KV pages in the model's dtype against int8 pages (--kv-cache-dtype int8), side by side:

  capacity    tokens one GiB of pages holds at float32, bf16 and int8 (a bf16 scale per token
              and KV head, counted in the page), for the built-in model, Qwen2.5-0.5B's shape
              and Llama-2-7B's, and the ratios against float32 and bf16
  agreement   teacher-forced greedy top-1 agreement of int8 pages with float32 pages: the
              trained built-in model on held-out ARC prompts, and the tests' tiny random
              checkpoints of each family (llama, qwen2, mixtral, qwen2_moe)
  scales      the built-in model's K/V rows (written on those prompts) quantized with a float32
              scale and with that scale rounded to bf16: relative error of the rows
  speed       decode tok/s of the built-in model at 1 and 16 sequences (ModelRunner.execute,
              each `--contexts` tokens of KV), its pages int8 against the model's dtype, at
              float32 and at bf16 (where the CPU has bf16 units), in alternating rounds (the best
              round counts)

    python -m benchmarks.kv_dtype [--contexts 512 1536] [--rounds 5] [--json PATH]

On a shared machine the speed figures are noisy: the rounds alternate the arms so that drift hits
both alike.
"""

from __future__ import annotations

import argparse
import os
import random
import tempfile
from pathlib import Path

import torch
from sloserve.config import CacheConfig, ModelConfig, SchedulerConfig, SloserveConfig
from sloserve.executor import ModelRunner
from sloserve.executor.plan import kv_layout
from sloserve.executor.precision import bf16_units
from sloserve.models.default import ensure_default_model
from sloserve.models.spec import load_spec
from sloserve.sampling_params import SamplingParams
from sloserve.sched.output import ScheduledSequence, SchedulerOutput

from benchmarks._output import OUT, write_json
from benchmarks.executor import EngineDecode, interleaved

# name -> (layers, KV heads, head dim)
SHAPES = {
    "qwen2.5-0.5b": (24, 2, 64),
    "llama-2-7b": (32, 32, 128),
}
ARC = Path("/work/shared/data/arc-agi-2/training")


def tokens_per_gib(layers: int, kv_heads: int, head_dim: int) -> dict:
    """Tokens per GiB of pages at each KV dtype, and int8's ratios."""
    out = {}
    for name, dtype, kv in (
        ("float32", torch.float32, "auto"),
        ("bfloat16", torch.bfloat16, "auto"),
        ("int8", torch.float32, "int8"),
    ):
        kv_dtype, row = kv_layout(kv, dtype, head_dim)
        token = layers * 2 * kv_heads * row * torch.empty((), dtype=kv_dtype).element_size()
        out[name] = round(2**30 / token)
    out["int8_vs_float32"] = round(out["int8"] / out["float32"], 3)
    out["int8_vs_bfloat16"] = round(out["int8"] / out["bfloat16"], 3)
    return out


def runner(
    folder: Path, kv: str, dtype: str = "float32", max_batch: int = 16, max_len: int = 1024
) -> ModelRunner:
    return ModelRunner(
        SloserveConfig(
            model=ModelConfig(path=str(folder), device="cpu", dtype=dtype, max_model_len=max_len),
            cache=CacheConfig(
                block_size=16, kv_pool_bytes=512 << 20, swap_bytes=0, kv_cache_dtype=kv
            ),
            scheduler=SchedulerConfig(max_batch=max_batch, max_batched_tokens=2048),
        )
    )


def forced_greedy(r: ModelRunner, prompts: list[list[int]], new: int, forced=None) -> list:
    """Each prompt alone: `new` greedy tokens, fed `forced`'s continuation when given."""
    outs = []
    greedy = SamplingParams(max_tokens=new)
    for i, prompt in enumerate(prompts):
        tokens, got = list(prompt), []
        table = list(range(1, 1 + -(-(len(prompt) + new) // r.block_size)))
        done = 0
        while len(got) < new:
            seq = ScheduledSequence(f"a{i}", tokens[done:], done, table, True, greedy, len(got))
            token = r.execute(SchedulerOutput([seq])).tokens[0][0]
            done = len(tokens)
            got.append(token)
            tokens.append(token if forced is None else forced[i][len(got) - 1])
        r.execute(SchedulerOutput(finished_req_ids=[f"a{i}"]))
        outs.append(got)
    return outs


def agreement(folder: Path, prompts: list[list[int]], new: int) -> tuple[dict, torch.Tensor]:
    """Top-1 agreement of int8 pages with float32 ones, and the float32 K/V rows written."""
    base = runner(folder, "auto")
    reference = forced_greedy(base, prompts, new)
    got = forced_greedy(runner(folder, "int8"), prompts, new, forced=reference)
    pairs = [(a, b) for g, w in zip(got, reference, strict=True) for a, b in zip(g, w, strict=True)]
    rows = base.kv.reshape(-1, base.kv.shape[-1])
    result = {
        "positions": len(pairs),
        "top1_agreement": round(sum(a == b for a, b in pairs) / len(pairs), 4),
    }
    return result, rows[rows.abs().amax(-1) > 0]


def scale_error(rows: torch.Tensor) -> dict:
    """Mean relative error of the rows through int8 with a float32 scale and a bf16 one."""
    out = {}
    for name in ("float32", "bfloat16"):
        scale = rows.abs().amax(-1, keepdim=True) / 127
        if name == "bfloat16":
            scale = scale.bfloat16().float()
        back = torch.round(rows / scale).clamp(-127, 127) * scale
        error = (back - rows).norm(dim=-1) / rows.norm(dim=-1)
        out[f"{name}_scale_mean_rel_error"] = round(error.mean().item(), 5)
    return out


def arc_prompts(folder: Path, limit: int) -> list[list[int]]:
    from benchmarks.structured import heldout_arc

    tokenizer = runner(folder, "auto", max_batch=1).tokenizer
    return [tokenizer.encode(i["prompt"]) for i in heldout_arc(ARC, 900, limit)]


def speed(folder: Path, dtype: str, context: int, steps: int, rounds: int) -> dict:
    """Decode tok/s at 1 and 16 sequences, the model's pages against int8, alternating."""
    out = {}
    for batch in (1, 16):
        arms = {
            kv: EngineDecode(
                runner(folder, kv, dtype, max_len=2048), batch, context, steps * rounds + 4
            )
            for kv in ("auto", "int8")
        }
        best = interleaved(arms, steps, rounds)
        for arm in arms.values():
            arm.close()
        tok_s = {kv: round(batch / best[f"{kv}_wall"], 1) for kv in arms}
        out[f"c{batch}"] = {
            "model_dtype_pages_tok_s": tok_s["auto"],
            "int8_pages_tok_s": tok_s["int8"],
            "int8_vs_model_dtype": round(tok_s["int8"] / tok_s["auto"], 3),
        }
        print(f"  {dtype} context {context} c{batch}: {out[f'c{batch}']}")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--contexts", type=int, nargs="+", default=[512, 1536], help="KV tokens each sequence holds"
    )
    p.add_argument("--steps", type=int, default=8, help="decode steps per timed round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--arc-prompts", type=int, default=12)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--json", type=Path, default=OUT / "kv_dtype.json")
    args = p.parse_args()
    builtin = ensure_default_model("default")
    spec = load_spec(builtin)
    report: dict = {"load_avg_1m_before": round(os.getloadavg()[0], 2), "capacity": {}}
    shapes = {"built-in": (spec.num_layers, spec.num_kv_heads, spec.head_dim), **SHAPES}
    for name, shape in shapes.items():
        report["capacity"][name] = {"shape": shape, **tokens_per_gib(*shape)}
        print(f"capacity {name} {shape}: {report['capacity'][name]}")
    report["agreement"] = {}
    if ARC.exists():
        prompts = arc_prompts(builtin, args.arc_prompts)
        result, rows = agreement(builtin, prompts, args.new_tokens)
        report["agreement"]["built-in on ARC"] = result
        report["scales"] = {"rows": rows.shape[0], **scale_error(rows)}
        print(f"agreement built-in on ARC: {result}; scales: {report['scales']}")
    from tests.checkpoints import tiny_checkpoint

    rng = random.Random(0)
    prompts = [[256] + [rng.randrange(256) for _ in range(rng.randrange(1, 60))] for _ in range(8)]
    with tempfile.TemporaryDirectory() as root:
        for arch in ("llama", "qwen2", "mixtral", "qwen2_moe"):
            folder = tiny_checkpoint(arch, Path(root))
            report["agreement"][f"tiny {arch}"] = agreement(folder, prompts, 40)[0]
            print(f"agreement tiny {arch}: {report['agreement'][f'tiny {arch}']}")
    report["speed"] = {"cpus": os.cpu_count()}
    dtypes = ["float32"] + (["bfloat16"] if bf16_units() else [])
    for context in args.contexts:
        report["speed"][f"context {context}"] = {
            dtype: speed(builtin, dtype, context, args.steps, args.rounds) for dtype in dtypes
        }
    report["load_avg_1m_after"] = round(os.getloadavg()[0], 2)
    write_json(args.json, report)


if __name__ == "__main__":
    main()
