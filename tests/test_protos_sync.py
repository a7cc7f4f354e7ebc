"""The checked-in generated code must be exactly what protos/generate.py makes from the .proto files."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GENERATED = ROOT / "protos" / "kvpact" / "v1"


def test_generated_code_is_in_sync_with_protos(tmp_path):
    subprocess.run(
        [sys.executable, str(ROOT / "protos" / "generate.py"), "--out", str(tmp_path)],
        check=True,
        capture_output=True,
    )
    fresh = {p.name: p.read_text() for p in (tmp_path / "kvpact" / "v1").iterdir()}
    checked_in = {p.name: p.read_text() for p in GENERATED.iterdir() if "_pb2" in p.name}
    assert sorted(fresh) == sorted(checked_in), "run `make protos` and commit the result"
    stale = [name for name in fresh if fresh[name] != checked_in[name]]
    assert not stale, f"generated code out of sync with the .proto files: {stale}; run `make protos`"


def test_contract_is_importable_as_kvpact_v1():
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            "from kvpact.v1 import cache_pb2, worker_pb2_grpc, router_pb2_grpc; "
            "print(cache_pb2.PagedAttentionMode.Name(0))",
        ],
        check=True,
        capture_output=True,
        text=True,
        cwd="/",
    )
    assert out.stdout.strip() == "PAGED_ATTENTION_MODE_UNSPECIFIED"
