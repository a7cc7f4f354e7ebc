"""Generate the Python code for protos/kvpact/v1/*.proto (messages, gRPC stubs, type stubs).

    python protos/generate.py            # regenerate in place (what `make protos` runs)
    python protos/generate.py --out DIR  # generate into DIR/kvpact/v1 (the sync test compares)

The generated files are checked in; tests/test_protos_sync.py fails when they drift from the .proto files.
"""

import argparse
import sys
from pathlib import Path

from grpc_tools import protoc

PROTO_ROOT = Path(__file__).resolve().parent


def generate(out_dir: Path) -> None:
    bin_dir = Path(sys.executable).parent
    sources = sorted(str(p.relative_to(PROTO_ROOT)) for p in (PROTO_ROOT / "kvpact" / "v1").glob("*.proto"))
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{Path(protoc.__file__).parent / '_proto'}",
        f"--plugin=protoc-gen-mypy={bin_dir / 'protoc-gen-mypy'}",
        f"--plugin=protoc-gen-mypy_grpc={bin_dir / 'protoc-gen-mypy_grpc'}",
        f"--python_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        f"--mypy_out={out_dir}",
        f"--mypy_grpc_out={out_dir}",
        *sources,
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed (see above)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=PROTO_ROOT, help="output root (default: in place)")
    out = parser.parse_args().out
    (out / "kvpact" / "v1").mkdir(parents=True, exist_ok=True)
    generate(out)
    if out != PROTO_ROOT:
        return
    for stale in (PROTO_ROOT / "kvpact" / "v1").glob("*_pb2*.py"):
        if not (PROTO_ROOT / "kvpact" / "v1" / (stale.name.split("_pb2")[0] + ".proto")).exists():
            stale.unlink()


if __name__ == "__main__":
    main()
