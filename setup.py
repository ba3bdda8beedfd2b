"""Build script: the package map lives in setup.cfg; this file lists packages and Cython extensions.

SLOSERVE_ASAN=1 builds the extensions with AddressSanitizer (and -O1 -g for readable reports);
`make test-asan` uses it to build them into build/asan/ and run tests/hotpath against them.
"""

import os
from pathlib import Path

from Cython.Build import cythonize
from setuptools import Extension, setup


def find_packages() -> list[str]:
    """Every folder under server/ with an __init__.py becomes sloserve.<dotted path>."""
    packages = ["sloserve.hotpath", "sloserve.cli"]
    for init in sorted(Path("server").rglob("__init__.py")):
        packages.append(".".join(("sloserve", *init.parent.relative_to("server").parts)))
    return packages


ASAN = os.environ.get("SLOSERVE_ASAN", "").strip() not in ("", "0")
SANITIZE = ["-fsanitize=address", "-fno-omit-frame-pointer"]
COMPILE_ARGS = (
    ["-O1", "-g", *SANITIZE, "-ffp-contract=off"] if ASAN else ["-O3", "-ffp-contract=off"]
)
LINK_ARGS = SANITIZE if ASAN else []
# the plain-C kernels the .pyx files include: an edit to one rebuilds the extensions (Cython
# tracks .pxd/.pxi itself, not C headers)
C_HEADERS = sorted(str(h) for h in Path("hotpath").glob("*.h"))

extensions = [
    Extension(
        f"sloserve.hotpath.{pyx.stem}",
        [str(pyx)],
        depends=C_HEADERS,
        extra_compile_args=COMPILE_ARGS,
        extra_link_args=LINK_ARGS,
    )
    for pyx in sorted(Path("hotpath").glob("*.pyx"))
]

setup(
    packages=find_packages(),
    ext_modules=cythonize(
        extensions,
        include_path=["hotpath"],
        compiler_directives={
            "language_level": 3,
            "boundscheck": False,
            "wraparound": False,
            "cdivision": True,
            "initializedcheck": False,
        },
    ),
)
