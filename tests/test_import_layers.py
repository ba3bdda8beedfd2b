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


def _product_graph():
    import grimp

    graph = grimp.build_graph("sloserve")
    return graph, sorted(m for m in graph.modules if not m.startswith("sloserve.testing"))


def test_no_product_module_imports_the_test_package():
    """Faults and fakes are wrapped in from outside (serve.run's core factory), never imported."""
    graph, product = _product_graph()
    offenders = [
        (m, i)
        for m in product
        for i in graph.find_modules_directly_imported_by(m)
        if i == "sloserve.testing" or i.startswith("sloserve.testing.")
    ]
    assert not offenders, offenders
    for path in sorted((ROOT / "cli").glob("*.py")):  # cli/ is outside the tree grimp walks
        for match in _IMPORT.finditer(path.read_text()):
            name = match.group(1) or match.group(2)
            assert not name.startswith("sloserve.testing"), f"cli/{path.name} imports {name}"


def test_the_product_has_no_import_cycles():
    """No circle of imports among the product's modules (TYPE_CHECKING and lazy ones included)."""
    graph, product = _product_graph()
    inside = set(product)
    for module in product:
        for imported in graph.find_modules_directly_imported_by(module):
            if imported in inside and imported != module:
                chain = graph.find_shortest_chain(importer=imported, imported=module)
                assert chain is None, f"{module} -> {' -> '.join(chain)}"
