"""The committed gRPC stubs are exactly what grpc_tools.protoc makes from protos/."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_stubs_match_protos():
    result = subprocess.run(
        [sys.executable, "-m", "sloserve.pb.generate", "--check"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ},
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_stub_package_is_versioned():
    from sloserve.pb import serving_pb2

    assert serving_pb2.DESCRIPTOR.package == "sloserve.v1"
    assert "Sloserve" in serving_pb2.DESCRIPTOR.services_by_name


def test_stubs_require_only_the_floors_of_setup_cfg():
    """The last two protobuf majors load the stubs: their stamps are setup.cfg's floors, one major back."""
    import configparser
    import re

    import google.protobuf
    from sloserve.pb import generate

    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    requires = config["options"]["install_requires"]
    protobuf_floor = re.search(r"^protobuf>=([\d.]+)", requires, re.M).group(1)
    grpc_floor = re.search(r"^grpcio>=([\d.]+)", requires, re.M).group(1)
    assert (
        protobuf_floor == ".".join(map(str, generate.PROTOBUF_FLOOR))
        and grpc_floor == generate.GRPC_FLOOR
    )
    for package in ("grpcio-health-checking", "grpcio-reflection"):
        assert re.search(rf"^{package}>={re.escape(grpc_floor)}$", requires, re.M), package
    stub = (ROOT / "server/pb/serving_pb2.py").read_text()
    assert f"# Protobuf Python Version: {protobuf_floor}\n" in stub
    assert (
        f"GRPC_GENERATED_VERSION = '{grpc_floor}'"
        in (ROOT / "server/pb/serving_pb2_grpc.py").read_text()
    )
    assert generate.PROTOBUF_FLOOR[0] == int(google.protobuf.__version__.split(".")[0]) - 1
