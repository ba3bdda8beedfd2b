"""The committed gRPC stubs are exactly what grpc_tools.protoc makes from protos/."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_stubs_match_protos():
    result = subprocess.run([sys.executable, "-m", "sloserve.pb.generate", "--check"], cwd=ROOT,
                            capture_output=True, text=True, env={**os.environ})
    assert result.returncode == 0, result.stdout + result.stderr


def test_stub_package_is_versioned():
    from sloserve.pb import serving_pb2

    assert serving_pb2.DESCRIPTOR.package == "sloserve.v1"
    assert "Sloserve" in serving_pb2.DESCRIPTOR.services_by_name
