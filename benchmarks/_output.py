"""Where the scripts write by default: benchmarks/out/ (git-ignored; benchmarks/results/ keeps only
the few small files the docs cite)."""

from __future__ import annotations

import json
from pathlib import Path

OUT = Path(__file__).resolve().parent / "out"


def write_json(path: Path, report: dict, indent: int = 2) -> Path:
    """report as indented JSON at path, its folder created; prints where."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=indent) + "\n")
    print(f"wrote {path}")
    return path
