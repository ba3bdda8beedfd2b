"""Regenerate the gRPC stubs from protos/ (run from the repository root):

    python -m sloserve.pb.generate            # writes server/pb/*_pb2*.py
    python -m sloserve.pb.generate --check    # exits 1 if the committed stubs differ
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

PROTO_DIR = Path("protos/sloserve/v1")
OUT_DIR = Path("server/pb")


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
            fresh = path.read_text()
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
