#!/usr/bin/env bash
# Runs a command the way a fresh machine sees it: an empty TMPDIR and empty tool caches, so nothing an
# earlier run left behind (/tmp/ray, a Triton or kernel build, a converted GGUF, a Ray session) can make
# a test pass. CI runs `make test` through it (.ci/run); run it by hand the same way:
#     tools/fresh_env.sh make test
# pip's download cache is kept (it does not change what the tests see). Everything is removed afterwards.
set -euo pipefail
# Short on purpose: Ray puts unix sockets under TMPDIR, and their paths must stay under 107 bytes.
fresh=$(mktemp -d /tmp/kv.XXXXXX)
trap 'rm -rf "$fresh"' EXIT
export PIP_CACHE_DIR="${PIP_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/pip}"
export TMPDIR="$fresh"
export RAY_TMPDIR="$fresh"
export XDG_CACHE_HOME="$fresh/cache"
export KVPACT_CACHE_DIR="$fresh/cache/kvpact"
export TRITON_CACHE_DIR="$fresh/cache/triton"
export TORCHINDUCTOR_CACHE_DIR="$fresh/cache/inductor"
export TORCH_HOME="$fresh/cache/torch"
export HF_HOME="$fresh/cache/huggingface"
export MPLCONFIGDIR="$fresh/cache/matplotlib"
mkdir -p "$XDG_CACHE_HOME"
echo "fresh_env: TMPDIR and tool caches under $fresh (removed on exit)"
"$@"
