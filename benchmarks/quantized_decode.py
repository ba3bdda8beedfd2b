"""A quantized checkpoint beside the one it was made from: c1 decode tok/s and weight bytes, in process.

Each arm is a folder served by the offline `LLM` (`--dtype`, default auto: bf16 on a CPU with
AVX512-BF16) with a small KV pool. A round runs every arm once, arms alternating (the machine may
be shared): one prompt of `--prompt` tokens generated to 1 token, then to `--tokens` tokens; decode
tok/s = (tokens - 1) / (the long run's time - the short run's). The best round counts. Weight bytes
are what the loaded weights hold (`sloserve info`'s `weight_resident_bytes`).

    python -m benchmarks.quantized_decode BASE QUANTIZED [--rounds 3] [--tokens 64] [--json PATH]

e.g. BASE the 358M bf16 checkpoint of benchmarks.peers, QUANTIZED its W4A16 folder made by
llm-compressor (`QuantizationModifier(targets="Linear", scheme="W4A16", ignore=["lm_head"])`).
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from sloserve.llm import LLM
from sloserve.sampling_params import SamplingParams

from benchmarks._output import OUT, write_json


def timed(llm: LLM, prompt: list[int], tokens: int) -> float:
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    started = time.perf_counter()
    (out,) = llm.generate([prompt], params)
    assert len(out.token_ids) == tokens, out.finish_reason
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("base", type=Path)
    parser.add_argument("quantized", type=Path)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=16)
    parser.add_argument("--json", type=Path, default=OUT / "quantized_decode.json")
    args = parser.parse_args()
    arms = {"base": args.base, "quantized": args.quantized}
    llms = {
        name: LLM(str(folder), dtype=args.dtype, kv_pool_bytes=64 * 2**20, max_model_len=1024)
        for name, folder in arms.items()
    }
    prompt = [256] + list(range(65, 65 + args.prompt - 1))
    best = dict.fromkeys(arms, 0.0)
    for _ in range(args.rounds):
        for name, llm in llms.items():
            first = timed(llm, prompt, 1)
            whole = timed(llm, prompt, args.tokens)
            best[name] = max(best[name], (args.tokens - 1) / (whole - first))
    weights = {
        name: llm.engine.runner.info()["weight_resident_bytes"] for name, llm in llms.items()
    }
    for name in arms:
        print(
            f"{name:9} {arms[name].name}: decode {best[name]:6.1f} tok/s "
            f"(x{best[name] / best['base']:.2f}), weights {weights[name] / 2**20:7.1f} MiB "
            f"(x{weights[name] / weights['base']:.3f})"
        )
    write_json(
        args.json,
        {
            "arms": {name: str(folder) for name, folder in arms.items()},
            "dtype": args.dtype,
            "rounds": args.rounds,
            "tokens": args.tokens,
            "load_average": os.getloadavg(),
            "decode_tok_s": best,
            "weight_bytes": weights,
        },
    )


if __name__ == "__main__":
    main()
