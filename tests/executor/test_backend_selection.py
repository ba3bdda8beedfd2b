"""Which attention backend `auto` (or a name) picks, with which KV page size, and the log line saying why.

CUDA and flash-attn are faked on CPU machines (torch.cuda.is_available, a stub `flash_attn` module,
triton's presence flag), so the CUDA choices are checked everywhere; the `gpu` tests at the end
check the same on a real GPU and fail, not skip, when flash-attn is missing there.
"""

from __future__ import annotations

import importlib.machinery
import logging
import sys
import types

import pytest
import torch
from sloserve.layers.attention import BackendUnavailableError, select_backend
from sloserve.layers.attention.sdpa import SdpaBackend
from sloserve.sampling_params import SamplingParams
from sloserve.sched.output import ScheduledSequence

from tests.checkpoints import hf_greedy, load_hf_model
from tests.executor.conftest import CPU_AUTO_BACKEND
from tests.executor.driver import generate

CUDA = torch.cuda.is_available()
PROMPTS = [[256, 72, 101, 108, 108, 111], [256] + [(i * 37) % 250 for i in range(40)]]
GREEDY = SamplingParams(max_tokens=5, ignore_eos=True)


def fake_cuda(monkeypatch: pytest.MonkeyPatch, *, flash: bool, triton: bool) -> None:
    """Make this process look like a CUDA machine, with or without flash-attn and triton installed."""
    from sloserve.layers.attention import triton_decode

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(triton_decode, "_HAS_TRITON", triton)
    if flash:
        stub = types.ModuleType("flash_attn")
        stub.__spec__ = importlib.machinery.ModuleSpec("flash_attn", None)  # found by find_spec
        stub.flash_attn_varlen_func = stub.flash_attn_with_kvcache = lambda *a, **k: None
        monkeypatch.setitem(sys.modules, "flash_attn", stub)
    else:
        # `import flash_attn` raises ImportError
        monkeypatch.setitem(sys.modules, "flash_attn", None)


# (flash-attn installed, triton installed, dtype, block size in the config)
#   -> (backend, page size, fragments of the reason)
CUDA_CASES = {
    "flash-bf16-unset": (
        (True, True, torch.bfloat16, None),
        ("flash", 256, ["auto on cuda, first choice", "256-token KV pages, as flash needs"]),
    ),
    "flash-fp16-unset": ((True, True, torch.float16, None), ("flash", 256, ["first choice"])),
    "flash-bf16-512": (
        (True, True, torch.bfloat16, 512),
        ("flash", 512, ["512-token KV pages, set in the config"]),
    ),
    "flash-bf16-16-falls-back": (
        (True, True, torch.bfloat16, 16),
        (
            "triton",
            16,
            [
                "skipped 'flash' cannot run: flash-attn's paged KV needs a block size that is a multiple "
                "of 256, got 16",
                "16-token KV pages, set in the config",
            ],
        ),
    ),
    "flash-fp32-falls-back": (
        (True, True, torch.float32, None),
        (
            "triton",
            16,
            ["flash-attn supports float16 and bfloat16 only", "16-token KV pages, the default"],
        ),
    ),
    "no-flash": (
        (False, True, torch.bfloat16, None),
        ("triton", 16, ["'flash' cannot run: flash-attn is not installed", "the default"]),
    ),
    "no-flash-no-triton": (
        (False, False, torch.bfloat16, None),
        (
            "sdpa",
            16,
            ["flash-attn is not installed", "'triton' cannot run: triton is not installed"],
        ),
    ),
    "no-triton-block-16": (
        (True, False, torch.bfloat16, 16),
        ("sdpa", 16, ["multiple of 256, got 16", "triton is not installed"]),
    ),
}


@pytest.mark.parametrize("case", list(CUDA_CASES))
def test_auto_on_cuda(monkeypatch, case):
    (flash, triton, dtype, block_size), (name, page, fragments) = CUDA_CASES[case]
    fake_cuda(monkeypatch, flash=flash, triton=triton)
    choice = select_backend("auto", "cuda", dtype=dtype, block_size=block_size, head_dim=64)
    assert (choice.name, choice.block_size) == (name, page)
    for fragment in fragments:
        assert fragment in choice.reason


def test_auto_on_cpu_is_sdpa_with_16_token_pages():
    choice = select_backend("auto", "cpu", dtype=torch.float32, block_size=None, head_dim=16)
    assert (choice.name, choice.block_size) == (CPU_AUTO_BACKEND, 16)
    assert choice.reason == "auto on cpu, first choice; 16-token KV pages, the default"
    assert select_backend("auto", "cpu", block_size=4).block_size == 4  # a set block size is kept


def test_auto_on_cpu_never_tries_gpu_kernels_even_with_flash_attn_installed(monkeypatch):
    fake_cuda(monkeypatch, flash=True, triton=True)
    choice = select_backend("auto", "cpu", dtype=torch.bfloat16, block_size=None, head_dim=64)
    assert (choice.name, choice.block_size) == ("sdpa", 16)


def test_named_backends_get_their_page_size_or_fail_with_what_to_change(monkeypatch):
    fake_cuda(monkeypatch, flash=True, triton=True)
    flash = select_backend("flash", "cuda", dtype=torch.bfloat16, head_dim=64)
    assert (flash.name, flash.block_size) == ("flash", 256)
    assert flash.reason == "named in the config; 256-token KV pages, as flash needs"
    assert select_backend("triton", "cuda", dtype=torch.bfloat16, head_dim=64).block_size == 16
    with pytest.raises(
        BackendUnavailableError, match="multiple of 256, got 16: leave the block size unset"
    ):
        select_backend("flash", "cuda", dtype=torch.bfloat16, block_size=16, head_dim=64)
    fake_cuda(monkeypatch, flash=False, triton=True)
    with pytest.raises(
        BackendUnavailableError, match="'flash' cannot run: flash-attn is not installed"
    ):
        select_backend("flash", "cuda", dtype=torch.bfloat16, head_dim=64)


def test_a_broken_flash_attn_install_falls_back(monkeypatch):
    """find_spec sees flash_attn but importing it fails (e.g. built for another torch): auto moves on."""
    fake_cuda(monkeypatch, flash=True, triton=True)
    del sys.modules["flash_attn"].flash_attn_with_kvcache
    choice = select_backend("auto", "cuda", dtype=torch.bfloat16, head_dim=64)
    assert (choice.name, choice.block_size) == ("triton", 16)
    assert "flash-attn >= 2.6" in choice.reason


# -- the runner uses the chosen page size everywhere -----------------------------------------


def test_runner_logs_one_line_with_the_backend_and_why(tiny_llama, make_runner, caplog):
    with caplog.at_level(logging.INFO, logger="sloserve"):
        runner = make_runner(tiny_llama, block_size=None)
    lines = [r for r in caplog.records if r.getMessage().startswith("attention backend:")]
    assert [(r.levelno, r.getMessage()) for r in lines] == [
        (
            logging.INFO,
            "attention backend: sdpa (auto on cpu, first choice; 16-token KV pages, the default)",
        )
    ]
    assert runner.block_size == 16 and runner.info()["block_size"] == 16


def test_runner_takes_the_backends_page_size_for_pool_inputs_and_scheduler(
    make_checkpoint, make_runner, monkeypatch
):
    """A backend that asks for 32-token pages (as flash asks for 256) gets them in every layer."""
    from sloserve.llm import LLM

    monkeypatch.setattr(SdpaBackend, "preferred_block_size", 32, raising=False)
    folder = make_checkpoint("llama")
    runner = make_runner(folder, block_size=None)
    assert runner.block_size == runner.inputs.block_size == runner.info()["block_size"] == 32
    # layers, K/V, heads, dim
    assert runner.kv.shape[3] == 32 and runner.page_bytes == 32 * 2 * 2 * 2 * 16 * 4
    expected = hf_greedy(load_hf_model(folder), PROMPTS, 5)
    assert generate(runner, PROMPTS, 5, chunk=7, stagger=True) == expected
    with LLM(
        str(folder), device="cpu", max_model_len=128, kv_pool_bytes=2**20, swap_bytes=0
    ) as llm:
        scheduler = llm.engine.scheduler
        assert scheduler.block_size == scheduler.block_manager.block_size == 32
        assert llm.engine.model_info["block_size"] == 32
        assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == expected


# -- GPU: the same choice on a real CUDA machine (fails when flash-attn is missing there) --------


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_auto_runs_flash_on_256_token_pages_on_cuda(make_checkpoint, make_runner):
    from sloserve.layers.attention.flash import FlashBackend

    reason = FlashBackend.unavailable_reason("cuda", torch.bfloat16, 256, 16)
    if reason is not None:
        pytest.fail(
            f"auto must run flash on a CUDA machine, but flash cannot run here: {reason}",
            pytrace=False,
        )
    folder = make_checkpoint("llama")
    runner = make_runner(
        folder, block_size=None, device="cuda", dtype="bfloat16", kv_pool_bytes=64 * 2**20
    )
    assert (runner.backend.name, runner.block_size, runner.kv.shape[3]) == ("flash", 256, 256)
    reference = make_runner(
        folder,
        block_size=256,
        device="cuda",
        dtype="bfloat16",
        kv_pool_bytes=64 * 2**20,
        backend="reference",
    )
    assert _first_logits(runner) == pytest.approx(_first_logits(reference), rel=0, abs=0.1)


def _first_logits(runner) -> list[float]:
    """Logits of one whole-prompt prefill of PROMPTS[1] (bf16 rounding differs between kernels)."""
    prompt = PROMPTS[1]
    table = list(range(1, 1 + -(-len(prompt) // runner.block_size)))
    step = runner.inputs.build([ScheduledSequence("p", prompt, 0, table, True, GREEDY)])
    logits = runner.model.forward(
        step.input_ids, step.positions, step.meta, runner.kv, step.sample_idx
    )
    return logits.float().flatten().tolist()
