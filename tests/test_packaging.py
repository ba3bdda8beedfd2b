"""One distribution named sloserve: nothing generic at the top level, no sources in the wheel."""

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(out),
            str(ROOT),
        ],
        check=True,
        capture_output=True,
    )
    (path,) = out.glob("sloserve-*.whl")
    return path


def test_wheel_installs_only_the_sloserve_namespace(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    top = {name.split("/")[0] for name in names}
    assert top == {"sloserve", next(t for t in top if t.endswith(".dist-info"))}
    for package in ("sloserve/engine", "sloserve/hotpath", "sloserve/cli", "sloserve/pb"):
        assert any(n.startswith(package + "/") for n in names), package


def test_wheel_carries_compiled_extensions_and_no_sources(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    assert not [n for n in names if n.endswith((".pyx", ".pxd", ".c"))]
    assert any(n.startswith("sloserve/hotpath/") and n.endswith(".so") for n in names)


def test_wheel_ships_the_trained_default_model(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    folder = "sloserve/models/weights/default/"
    for name in (
        "model.safetensors",
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
    ):
        assert folder + name in names, name
    assert zipfile.ZipFile(wheel).getinfo(folder + "model.safetensors").file_size <= 25 * 2**20


def test_build_outputs_are_not_tracked():
    tracked = subprocess.run(
        ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True
    ).stdout.split()
    if not tracked:
        pytest.skip("not a git checkout")
    assert not [t for t in tracked if t.endswith((".so", ".c")) or t.startswith("build/")]
