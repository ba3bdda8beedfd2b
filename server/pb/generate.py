"""Regenerate the gRPC stubs from protos/ (run from the repository root):

    python -m sloserve.pb.generate            # writes server/pb/*_pb2*.py
    python -m sloserve.pb.generate --check    # exits 1 if the committed stubs differ

The stubs are stamped with the oldest runtimes they load on, the floors of setup.cfg, so that the
last two protobuf majors (and the grpcio releases of the older one) can import them.
NOTE: protoc stamps the version it was built from, and protobuf refuses gencode newer than its
runtime. For these protos, grpcio-tools 1.76.0 (protoc 6.31.1) writes the same _pb2.py as 1.85.1
(protoc 7.35.1) but for that stamp (its _pb2_grpc.py differs only by `class X(object)`), so the
stamp, not the code, is what keeps protobuf 6 out; restamping the floors is what 1.76.0 would write.
"""

from __future__ import annotations

import re
import sys
import tempfile
from pathlib import Path

PROTO_DIR = Path("protos/sloserve/v1")
OUT_DIR = Path("server/pb")
PROTOBUF_FLOOR = (6, 31, 1)  # protobuf>= in setup.cfg: the previous major's release protoc 6.31.1 came from
GRPC_FLOOR = "1.76.0"  # grpcio>= in setup.cfg: grpcio-tools 1.76.0 bundles protoc 6.31.1


def stamp(name: str, text: str) -> str:
    """The generated text with the floors as the versions it requires."""
    major, minor, patch = PROTOBUF_FLOOR
    if name.endswith("_pb2.py"):
        text, a = re.subn(r"# Protobuf Python Version: \S+", f"# Protobuf Python Version: {major}.{minor}.{patch}",
                          text)
        text, b = re.subn(r"(ValidateProtobufRuntimeVersion\(\n\s+_runtime_version\.Domain\.PUBLIC,\n)"
                          r"\s+\d+,\n\s+\d+,\n\s+\d+,\n",
                          lambda m: f"{m.group(1)}    {major},\n    {minor},\n    {patch},\n", text)
        found = a == b == 1
    elif name.endswith("_pb2_grpc.py"):
        text, n = re.subn(r"GRPC_GENERATED_VERSION = '[^']+'", f"GRPC_GENERATED_VERSION = '{GRPC_FLOOR}'", text)
        found = n == 1
    else:
        return text
    if not found:
        raise RuntimeError(f"{name}: protoc no longer writes the version stamps this script rewrites")
    return text


def generate(out_root: Path) -> list[Path]:
    """Run grpc_tools.protoc over every .proto; return the generated files."""
    import grpc_tools
    from grpc_tools import protoc  # dev-only dependency (extra 'test')

    include = Path(grpc_tools.__file__).parent / "_proto"
    protos = sorted(str(p.name) for p in PROTO_DIR.glob("*.proto"))
    args = ["protoc", f"-Isloserve/pb={PROTO_DIR}", f"-I{include}",
            f"--python_out={out_root}", f"--pyi_out={out_root}", f"--grpc_python_out={out_root}",
            *[f"sloserve/pb/{name}" for name in protos]]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed")
    return sorted((out_root / "sloserve" / "pb").glob("*_pb2*"))


def main() -> int:
    check = "--check" in sys.argv[1:]
    with tempfile.TemporaryDirectory() as tmp:
        stale = []
        for path in generate(Path(tmp)):
            target = OUT_DIR / path.name
            fresh = stamp(path.name, path.read_text())
            if check:
                if not target.exists() or target.read_text() != fresh:
                    stale.append(target.name)
            else:
                target.write_text(fresh)
        if stale:
            print(f"stubs out of date with protos/: {', '.join(stale)}; run python -m sloserve.pb.generate")
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
