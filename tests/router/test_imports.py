"""The router never imports worker/, kernels/ or torch (docs/design.md, "Layers"): it starts fast where no GPU
is."""

import json
import subprocess
import sys

FORBIDDEN = ("torch", "triton", "kvpact.worker", "kvpact.kernels")
CHECK = (
    "import json, sys\n"
    "import kvpact.router.cli, kvpact.router.server, kvpact.router.http.server, kvpact.client\n"
    f"found = [m for m in sys.modules for f in {FORBIDDEN!r} if m == f or m.startswith(f + '.')]\n"
    "print(json.dumps(sorted(found)))"
)


def test_router_and_client_import_neither_torch_nor_the_worker():
    out = subprocess.run(
        [sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=60, check=True
    )
    assert json.loads(out.stdout) == []
