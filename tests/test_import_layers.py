"""The import layers: lint-imports (run by `make test`) holds them for server/; hotpath/ is checked here.

import-linter builds its graph from the folder of the top-level package (server/); hotpath/ is
mapped into sloserve.hotpath from a folder of its own, so its rule (it imports nothing of
sloserve above it, and no transport) is checked on its sources directly.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_IMPORT = re.compile(r"^\s*(?:from\s+(\S+)\s+c?import|c?import\s+(\S+))", re.MULTILINE)
_TRANSPORTS = {"grpc", "grpc_health", "grpc_reflection", "google"}


def test_hotpath_imports_nothing_of_sloserve_above_it_and_no_transport():
    sources = sorted((ROOT / "hotpath").glob("*.p[yx]*"))
    assert sources
    for path in sources:
        for match in _IMPORT.finditer(path.read_text()):
            name = match.group(1) or match.group(2)
            top = name.split(".")[0]
            assert top != "sloserve" or name.startswith("sloserve.hotpath"), (
                f"{path.name} imports {name}"
            )
            assert top not in _TRANSPORTS, f"{path.name} imports {name}"
