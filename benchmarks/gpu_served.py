"""sloserve served on CUDA against transformers' `generate` and the HBM roofline, on one checkpoint.

    python -m benchmarks.gpu_served [--cpu]      # also the `served` section of gpu_check.py

A random-weight Llama (~0.9B parameters, bfloat16; tiny and float32 with --cpu) is saved with a
byte-level tokenizer, then
  transformers   model.generate, greedy, exactly NEW tokens of PROMPT-token prompts, batch 1/16/64
  c1, c16, c64   `sloserve serve --device cuda` driven by `sloserve bench fixed:PROMPT,NEW
                 --ignore-eos`, closed loop at concurrency 1/16/64
  roofline       the weights' bytes over 4.3 TB/s: the least time a batch-1 decode step can take
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

H200_BANDWIDTH = 4.3e12  # bytes/s, HBM3e peak
PORT = 52311


def llama_dims(gpu: bool) -> dict:
    """The Llama of the GPU measurements (~0.9B parameters), or a tiny one for a CPU dry run."""
    if gpu:
        return dict(
            vocab_size=32000,
            hidden_size=2048,
            intermediate_size=5632,
            num_hidden_layers=16,
            num_attention_heads=16,
            num_key_value_heads=8,
        )
    return dict(
        vocab_size=300,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )


def _save_llama(folder: Path, gpu: bool, device: str) -> tuple[dict, torch.nn.Module]:
    from sloserve.tokenizer import save_byte_level_tokenizer
    from transformers import AutoModelForCausalLM, LlamaConfig

    dims = llama_dims(gpu)
    config = LlamaConfig(
        **dims,
        max_position_embeddings=4096,
        bos_token_id=256,
        eos_token_id=257,
        pad_token_id=258,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(
            config, dtype=torch.bfloat16 if gpu else torch.float32
        )
    model.eval()
    model.save_pretrained(folder, safe_serialization=True)
    save_byte_level_tokenizer(folder, 4096)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return {
        **dims,
        "parameters": sum(p.numel() for p in model.parameters()),
        "weight_bytes": weight_bytes,
    }, model


def _transformers(model, prompt: int, new: int, batches: list[int], device: str) -> dict:
    gen = torch.Generator().manual_seed(1)
    rows = {}
    for batch in batches:
        ids = torch.randint(0, 256, (batch, prompt), generator=gen).to(device)
        with torch.inference_mode():
            model.generate(ids[:, :32], max_new_tokens=4, do_sample=False, pad_token_id=258)  # warm
            if device == "cuda":
                torch.cuda.synchronize()
            began = time.perf_counter()
            model.generate(
                ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=258
            )
            if device == "cuda":
                torch.cuda.synchronize()
            seconds = time.perf_counter() - began
        rows[f"b{batch}"] = {"seconds": seconds, "output_tok_s": batch * new / seconds}
    return rows


def _sloserve(
    folder: Path, out: Path, device: str, prompt: int, new: int, conc: list[int], extra: list[str]
) -> dict:
    scripts = Path(sys.executable).parent
    cli = str(scripts / "sloserve") if (scripts / "sloserve").exists() else "sloserve"
    results: dict = {}
    started = time.perf_counter()
    with open(out / "serve.log", "w") as log:
        server = subprocess.Popen(
            [cli, "serve", "--model", str(folder), "--device", device, "--port", str(PORT), *extra],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            for c in conc:
                report = out / f"sloserve_c{c}.json"
                cmd = [
                    cli,
                    "bench",
                    "--server",
                    f"127.0.0.1:{PORT}",
                    "--workload",
                    f"fixed:{prompt},{new}",
                    "--num-requests",
                    str(max(8, 4 * c)),
                    "--concurrency",
                    str(c),
                    "--ignore-eos",
                    "--ready-timeout",
                    "240",
                    "--json",
                    str(report),
                ]
                done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
                if c == conc[0]:
                    results["ready_after_s"] = time.perf_counter() - started
                if done.returncode != 0:
                    results[f"c{c}"] = {
                        "rc": done.returncode,
                        "tail": (done.stdout + done.stderr)[-1500:],
                    }
                    break
                run = json.loads(report.read_text())["runs"][0]
                results[f"c{c}"] = {
                    "tpot_p50_s": (run.get("tpot_s") or {}).get("p50"),
                    "ttft_p50_s": run["ttft_s"]["p50"],
                    "output_tok_s": run.get("output_token_throughput"),
                    "completed": run.get("completed"),
                    "failed": run.get("failed"),
                }
                print(f"  served c{c}: {json.dumps(results[f'c{c}'])}", flush=True)
        finally:
            os.killpg(server.pid, 15)
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, 9)
    return results


def served(gpu: bool, extra: list[str] | None = None) -> dict:
    """The `served` section: sloserve at each concurrency, transformers, the roofline, the commit."""
    device = "cuda" if gpu else "cpu"
    prompt, new = (512, 128) if gpu else (64, 16)
    conc = [1, 16, 64] if gpu else [1, 4]
    commit = subprocess.run(
        ["git", "rev-parse", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    with tempfile.TemporaryDirectory(prefix="gpu_served_") as tmp:
        folder, out = Path(tmp) / "llama", Path(tmp)
        model_info, model = _save_llama(folder, gpu, device)
        hf = _transformers(model, prompt, new, conc, device)
        del model
        if gpu:
            torch.cuda.empty_cache()
        result = {
            "commit": commit,
            "model": model_info,
            "workload": f"fixed:{prompt},{new} --ignore-eos",
            "roofline_step_s": model_info["weight_bytes"] / H200_BANDWIDTH,
        }
        result.update(_sloserve(folder, out, device, prompt, new, conc, extra or []))
        result["transformers"] = hf
        for c in conc:
            row, base = result.get(f"c{c}", {}), hf.get(f"b{c}", {})
            if row.get("output_tok_s") and base.get("output_tok_s"):
                row["vs_transformers"] = row["output_tok_s"] / base["output_tok_s"]
            if row.get("tpot_p50_s"):
                row["share_of_roofline"] = result["roofline_step_s"] / row["tpot_p50_s"]
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--cpu", action="store_true", help="a tiny float32 model on the CPU (a dry run)"
    )
    parser.add_argument("--out", type=Path, help="JSON path (default: print only)")
    args = parser.parse_args()
    result = served(torch.cuda.is_available() and not args.cpu)
    text = json.dumps(result, indent=1)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
