"""benchmarks/gpu_served.py (gpu_check.py's `served` section) as a dry run on the CPU: the fields the
GPU issue records, from a real server driven by `sloserve bench`."""

from __future__ import annotations

import pytest


@pytest.mark.slow
def test_served_section_records_each_concurrency_transformers_and_the_roofline():
    from benchmarks.gpu_served import served

    result = served(gpu=False)
    assert result["roofline_step_s"] > 0 and len(result["commit"]) == 40
    for c in ("c1", "c4"):
        row = result[c]
        assert row["failed"] == 0 and row["completed"] > 0, row
        assert row["tpot_p50_s"] > 0 and row["ttft_p50_s"] > 0 and row["output_tok_s"] > 0
        assert row["vs_transformers"] > 0 and 0 < row["share_of_roofline"]
    assert set(result["transformers"]) == {"b1", "b4"}
