#!/usr/bin/env bash
# Fetch, HERE (a machine with PyPI), the wheels benchmarks/gpu_check.sh needs on a GPU machine that
# has torch and triton but no network: the pure-Python or cp312 packages of ours its image lacks.
#
#   bash benchmarks/gpu_wheels.sh        -> .whl/*.whl (ignored by git; ~10 MB)
#
# Then carry `.whl` with the device run (run tool: carry [".whl"]); gpu_check.sh installs them with
# `pip install --no-index --no-deps --target` into a temporary folder first on PYTHONPATH. Versions
# come from constraints.txt. PYTHON_VERSION (default 3.12, the GPU image's) picks the cp tag.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
PYTHON_VERSION=${PYTHON_VERSION:-3.12}
PACKAGES=(structlog gguf grpcio grpcio-health-checking grpcio-reflection protobuf)

pins=()
for name in "${PACKAGES[@]}"; do
    pin=$(grep -i "^${name}==" constraints.txt || true)
    if [ -z "$pin" ]; then
        echo "gpu_wheels.sh: $name is not pinned in constraints.txt" >&2
        exit 1
    fi
    pins+=("$pin")
done
mkdir -p .whl
rm -f .whl/*.whl
platforms=()
for tag in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
    platforms+=(--platform "$tag")
done
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$PYTHON_VERSION" --implementation cp \
    "${platforms[@]}" -d .whl "${pins[@]}"
ls -l .whl
du -sh .whl
