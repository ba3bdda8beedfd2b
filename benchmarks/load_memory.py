"""Peak memory while loading a checkpoint, over the weights the load keeps: this build, and another's.

Loads big_model's random Llama (`--shape small` by default: ~1B parameters, bf16 on disk, shards
of 2 GiB) through `load_checkpoint` at bf16 and at float32, each load in a fresh child whose peak
RSS (VmHWM, reset through /proc/self/clear_refs just before the load) is read after it, and
prints peak growth / bytes kept. `--other PYTHON` runs the same loads under another build's
interpreter (e.g. the build before a loader change), alternating with this one.

    python -m benchmarks.load_memory [--shape small] [--other ../main/.venv/bin/python] [--json PATH]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import textwrap
from pathlib import Path

from benchmarks._output import OUT, write_json
from benchmarks.big_model import SHAPES, checkpoint

CHILD = textwrap.dedent(
    """
    import sys, time, torch
    from pathlib import Path
    from sloserve.models.loader import load_checkpoint

    def status(key):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key):
                return int(line.split()[1]) * 1024

    Path("/proc/self/clear_refs").write_text("5")
    before, started = status("VmRSS:"), time.monotonic()
    _, weights = load_checkpoint(Path(sys.argv[1]), torch.device("cpu"), getattr(torch, sys.argv[2]))
    print(status("VmHWM:") - before, weights.nbytes(), time.monotonic() - started)
    """
)


def load(python: str, folder: Path, dtype: str) -> dict:
    """One load in a fresh `python` child: peak RSS growth, bytes kept, their ratio, seconds."""
    out = subprocess.run(
        [python, "-c", CHILD, str(folder), dtype], check=True, capture_output=True, text=True
    ).stdout
    peak, kept, seconds = out.split()
    peak, kept = int(peak), int(kept)
    return {
        "peak_growth_mib": round(peak / 2**20, 1),
        "kept_mib": round(kept / 2**20, 1),
        "peak_over_kept": round(peak / kept, 3),
        "load_s": round(float(seconds), 2),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--shape", choices=list(SHAPES), default="small")
    p.add_argument("--other", default=None, help="another build's python, loaded alternately")
    p.add_argument("--cache", type=Path, default=OUT / "checkpoints")
    p.add_argument("--json", type=Path, default=OUT / "load_memory.json")
    args = p.parse_args()
    folder = checkpoint(SHAPES[args.shape], args.cache)
    builds = {"this": sys.executable} | ({"other": args.other} if args.other else {})
    results: dict[str, dict[str, dict]] = {dtype: {} for dtype in ("bfloat16", "float32")}
    for dtype in results:
        for name, python in builds.items():
            results[dtype][name] = r = load(python, folder, dtype)
            print(f"{dtype} {name}: {r}", flush=True)
    write_json(args.json, {"checkpoint": str(folder), "builds": builds, "loads": results})


if __name__ == "__main__":
    main()
