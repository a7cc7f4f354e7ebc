"""The router never imports worker/, kernels/ or torch (DESIGN §2): it starts fast where no GPU is."""

import json
import subprocess
import sys

FORBIDDEN = ("torch", "triton", "worker", "kernels")
CHECK = (
    "import json, sys\n"
    "import router.cli, router.server, kvpact.client\n"
    f"print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in {FORBIDDEN!r})))"
)


def test_router_and_client_import_neither_torch_nor_the_worker():
    out = subprocess.run(
        [sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=60, check=True
    )
    assert json.loads(out.stdout) == []
