"""Host memory on a CPU: with glibc's thresholds raised, a step's activations reuse heap pages."""

import platform
import resource

import pytest
import torch
from sloserve.config import ModelConfig
from sloserve.executor.host_memory import keep_freed_memory

glibc = pytest.mark.skipif(
    platform.libc_ver()[0] != "glibc", reason="mallopt thresholds are glibc's"
)


@glibc
def test_freed_activations_are_reused_without_page_faults():
    assert keep_freed_memory().startswith("glibc")
    assert keep_freed_memory() == keep_freed_memory()  # applied once per process

    # a prefill-sized activation: 8 MiB, above glibc's default 128 KiB mmap threshold
    def step() -> None:
        x = torch.empty(2 << 20)
        x.fill_(1.0)
        del x

    for _ in range(10):  # the heap grows until a free 8 MiB block is left between other allocations
        step()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(40):
        step()
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    # With glibc's defaults every one maps fresh pages: 20 of them took ~16,000 faults here.
    assert faults < 4 * 2048, f"{faults} page faults for 40 reused 8 MiB activations"


def test_host_malloc_is_validated():
    assert ModelConfig(host_malloc="system").host_malloc == "system"
    with pytest.raises(ValueError, match="host malloc must be keep or system"):
        ModelConfig(host_malloc="jemalloc")
