"""Build script: the package map lives in setup.cfg; this file lists packages and Cython extensions."""

from pathlib import Path

from Cython.Build import cythonize
from setuptools import Extension, setup


def find_packages() -> list[str]:
    """Every folder under server/ with an __init__.py becomes sloserve.<dotted path>."""
    packages = ["sloserve.hotpath", "sloserve.cli"]
    for init in sorted(Path("server").rglob("__init__.py")):
        packages.append(".".join(("sloserve", *init.parent.relative_to("server").parts)))
    return packages


extensions = [
    Extension(f"sloserve.hotpath.{pyx.stem}", [str(pyx)], extra_compile_args=["-O3", "-ffp-contract=off"])
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
