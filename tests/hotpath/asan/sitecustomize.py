"""Start-up hook for `make test-asan`: sloserve.hotpath loads its extensions from another folder.

Python imports this module at start-up only while tests/hotpath/asan is on PYTHONPATH. With
SLOSERVE_HOTPATH_EXT_DIR set, that folder (the AddressSanitizer build) comes first on the
package's search path, so `sloserve.hotpath._queue` and the others load from it while the Python
modules still come from hotpath/. Subprocesses inherit the environment, so the fuzz and
regression children run against the same build. The in-place build is never touched.
"""

from __future__ import annotations

import os
import sys
from importlib.machinery import ModuleSpec

_EXT_DIR = os.environ.get("SLOSERVE_HOTPATH_EXT_DIR", "")


class _HotpathExtensionsFrom:
    """Meta-path finder: the normal spec of sloserve.hotpath, with _EXT_DIR searched first."""

    @classmethod
    def find_spec(cls, fullname: str, path=None, target=None) -> ModuleSpec | None:
        if fullname != "sloserve.hotpath":
            return None
        for finder in sys.meta_path:
            if finder is cls or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.submodule_search_locations is not None:
                spec.submodule_search_locations.insert(0, os.path.abspath(_EXT_DIR))
                return spec
        return None


if _EXT_DIR:
    sys.meta_path.insert(0, _HotpathExtensionsFrom)
