"""benchmarks/peers.py: its pure parts (llama-server's timings, ratios, ceilings, weight counts,
process-tree memory, the bf16 checkpoint) and its arguments; no server is started."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from benchmarks import peers

LLAMA_LOG = """\
slot update_slots: id  0 | task 3 | new prompt, n_ctx_slot = 2048
slot print_timing: id  0 | task 3 |
prompt eval time =     200.00 ms /   500 tokens (    0.40 ms per token,  2500.00 tokens per second)
       eval time =     630.00 ms /    64 tokens (    9.84 ms per token,   101.59 tokens per second)
      total time =     830.00 ms /   564 tokens
slot print_timing: id  1 | task 4 |
prompt eval time =     400.00 ms /   520 tokens (    0.77 ms per token,  1300.00 tokens per second)
       eval time =    1260.00 ms /    64 tokens (   19.69 ms per token,    50.79 tokens per second)
      total time =    1660.00 ms /   584 tokens
slot print_timing: id  2 | task 5 |
prompt eval time =     300.00 ms /     1 tokens (  300.00 ms per token,     3.33 tokens per second)
       eval time =     945.00 ms /    64 tokens (   14.77 ms per token,    67.72 tokens per second)
      total time =    1245.00 ms /    65 tokens
"""


def test_llama_timings_are_the_servers_own_medians():
    own = peers.llama_timings(LLAMA_LOG)
    assert own["requests"] == 3
    assert own["ttft_p50_s"] == pytest.approx(0.3)
    # generation time spans n - 1 gaps
    assert own["tpot_p50_s"] == pytest.approx(0.945 / 63)
    assert peers.llama_timings("no timings here") == {
        "requests": 0,
        "ttft_p50_s": None,
        "tpot_p50_s": None,
    }


def _run(tok_s: float, ttft: float, tpot: float, dtype: str) -> dict:
    return {"output_tok_s": tok_s, "ttft_p50_s": ttft, "tpot_p50_s": tpot, "dtype": dtype}


def test_ratios_pair_each_sloserve_arm_with_each_peer_and_ceilings_use_each_arms_bytes():
    runs = {
        1: {
            "sloserve": [_run(30.0, 0.2, 1 / 40, "bfloat16"), _run(34.0, 0.4, 1 / 40, "bfloat16")],
            "vllm": [_run(16.0, 0.1, 1 / 20, "bfloat16")],
            "llamacpp-q8_0": [_run(32.0, 0.3, 1 / 32, "q8_0")],
            "sloserve-int8": [],
        },
    }
    ratios, ceilings = peers.summarize(runs, {"read_gb_s": 32.0}, weights=400_000_000)
    by_peer = {r["peer"]: r for r in ratios}
    assert set(by_peer) == {"vllm", "llamacpp-q8_0"} and len(ratios) == 2
    assert by_peer["vllm"]["output_tok_s_ratio"] == pytest.approx(32.0 / 16.0)
    assert by_peer["vllm"]["ttft_p50_ratio"] == pytest.approx(0.3 / 0.1)
    # 32 GB/s over 0.8 GB a token (bf16)
    assert ceilings["sloserve"]["ceiling_tok_s"] == pytest.approx(40.0)
    assert ceilings["sloserve"]["fraction_of_ceiling"] == pytest.approx(1.0)
    assert ceilings["llamacpp-q8_0"]["weight_bytes_per_token"] == pytest.approx(4e8 * 34 / 32)
    assert "sloserve-int8" not in ceilings


def test_weights_per_token_leave_out_the_embedding_table(tmp_path):
    import torch
    from safetensors.torch import save_file

    save_file(
        {
            "model.embed_tokens.weight": torch.zeros(259, 8),
            "model.layers.0.mlp.up_proj.weight": torch.zeros(16, 8),
            "lm_head.weight": torch.zeros(259, 8),
            "model.norm.weight": torch.zeros(8),
        },
        tmp_path / "model.safetensors",
    )
    assert peers.weights_per_token(tmp_path) == 16 * 8 + 259 * 8 + 8


def test_to_bf16_rounds_the_tensors_and_says_so_in_the_config(tmp_path):
    import torch
    from safetensors.torch import load_file, save_file

    src, dst = tmp_path / "src", tmp_path / "dst"
    src.mkdir()
    dst.mkdir()
    save_file({"w": torch.full((2, 2), 1 / 3)}, src / "model.safetensors")
    (src / "config.json").write_text(json.dumps({"torch_dtype": "float32"}))
    peers.to_bf16(src, dst)
    w = load_file(dst / "model.safetensors")["w"]
    assert w.dtype == torch.bfloat16 and w[0, 0] == torch.tensor(1 / 3).to(torch.bfloat16)
    assert json.loads((dst / "config.json").read_text())["torch_dtype"] == "bfloat16"


def test_tree_memory_sums_over_the_children_too():
    sleep = "import time; time.sleep(30)"
    code = f"import subprocess, sys; subprocess.Popen([sys.executable, '-c', {sleep!r}]); {sleep}"
    parent = subprocess.Popen([sys.executable, "-c", code])
    try:
        for _ in range(100):
            if len(peers.process_tree(parent.pid)) == 2:
                break
            subprocess.run(["sleep", "0.05"])
        memory = peers.tree_memory(parent.pid)
        assert memory["processes"] == 2
        assert 0 < memory["pss_bytes"] <= memory["rss_bytes"] <= memory["hwm_sum_bytes"]
    finally:
        for pid in peers.process_tree(parent.pid)[1:]:
            subprocess.run(["kill", str(pid)])
        parent.kill()
        parent.wait()


@pytest.mark.parametrize(
    "argv",
    [
        ["--rounds", "0"],
        ["--concurrency", "1", "0"],
        ["--requests", "0"],
        ["--max-tokens", "1"],
        ["--arms", "sloserve", "tgi"],
        ["--shape", "7b"],
    ],
)
def test_bad_arguments_name_the_flag(argv, capsys):
    with pytest.raises(SystemExit):
        peers.parse_args(argv)
    assert "error" in capsys.readouterr().err


def test_the_defaults_are_the_issues_measurement():
    args = peers.parse_args([])
    assert args.shape == "qwen05" and args.concurrency == [1, 4, 16] and args.rounds == 1
    assert (args.requests, args.max_tokens) == (24, 64)
    # issue 55's five arms and issue 56's int4 pair (W4A16 made by llm-compressor, q4_0)
    assert set(args.arms) == {
        "sloserve",
        "sloserve-int8",
        "vllm",
        "llamacpp-bf16",
        "llamacpp-q8_0",
        "sloserve-w4a16",
        "llamacpp-q4_0",
    }
    assert peers.SHAPES["qwen05"] == {
        "hidden": 896,
        "layers": 24,
        "heads": 14,
        "kv-heads": 2,
        "ffn": 4864,
    }
