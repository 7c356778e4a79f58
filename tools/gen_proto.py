"""Generate the Python stubs for the kubelet protocols from the project's .proto files.

The stubs are committed, so installing gpuppetti needs no code generator; tests/unit/test_proto_stubs.py
fails when a committed stub differs from what this script writes.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "src"
PROTO_ROOT = SRC / "gpuppetti" / "_proto"
SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def proto_files() -> list[Path]:
    return sorted(PROTO_ROOT.rglob("*.proto"))


def generated_names(proto: Path) -> list[Path]:
    stem = proto.with_suffix("")
    return [stem.with_name(stem.name + suffix) for suffix in SUFFIXES]


def generate(out_dir: Path) -> list[Path]:
    """Write the stubs for every .proto under src/gpuppetti/_proto into ``out_dir`` (mirroring src/)."""
    from grpc_tools import protoc

    written: list[Path] = []
    for proto in proto_files():
        relative = proto.relative_to(SRC)
        args = [
            "grpc_tools.protoc",
            f"-I{SRC}",
            f"--python_out={out_dir}",
            f"--pyi_out={out_dir}",
            f"--grpc_python_out={out_dir}",
            str(relative),
        ]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed for {relative}")
        written.extend(out_dir / p.relative_to(SRC) for p in generated_names(proto))
    return written


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        for path in generate(Path(tmp)):
            target = SRC / path.relative_to(tmp)
            shutil.copyfile(path, target)
            print(f"wrote {target.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
