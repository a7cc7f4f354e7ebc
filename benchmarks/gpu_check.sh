#!/usr/bin/env bash
# The one script a GPU session runs on the device machine (a copy of this repo; $OUT comes back).
#
#   HERE, first (PyPI):  bash benchmarks/gpu_wheels.sh     -> .whl/ (structlog, gguf, grpcio, ... for cp312)
#   THEN, on the device: bash benchmarks/gpu_check.sh      (run tool: carry [".whl"], timeout_s 600)
#     Its 10 output files are more than a run brings back (8): run it with OUT=/tmp/gc and pack them,
#     R=$OUT; OUT=/tmp/gc bash benchmarks/gpu_check.sh; rc=$?; tar czf $R/gpu_check.tgz -C /tmp/gc .; exit $rc
#   Dry run, no GPU:     PYTHON=.venv/bin/python bash benchmarks/gpu_check.sh --dry-run
#
# It installs nothing from a network: it uses the machine's python3 (torch and triton must be there;
# without torch it prints what is missing and exits 2), plus the wheels carried in .whl/ (installed
# with --no-index into a temporary folder put first on PYTHONPATH); kvpact itself is imported from this
# checkout through the link tree of tools/link_tree.py (kvpact.router -> router/, ...). Each step is bounded by `timeout`
# and a global budget (GPU_CHECK_BUDGET_S, default 540 s), writes $OUT/<step>.txt, and never stops the
# later steps:
#   a_env.txt       nvidia-smi, python/torch/triton versions, compute capability, missing modules
#   b_kernels.txt   tests/kernels/triton_cases.py compiled on the GPU (KVPACT_KERNEL_DEVICE=cuda, -m '':
#                   the slow grid too; native bf16 tl.dot), except the ptxas-only cuda_compile cases
#   c_bench.txt     python benchmarks/kernels.py: a compiled correctness pass, then the Triton vs torch
#                   decode bandwidth table, launched and graph-replayed (batch 64 / 2k in the summary)
#   d_engine.txt    benchmarks/gpu_check.py engine: the engine in-process, Triton vs torch backend (fp32
#                   and bf16, chunked prefill, prefix cache; logits compared), and a sync audit
#   e_e2e.txt       benchmarks/gpu_check.py e2e: a router + one worker `--device cuda` for each of
#                   `on` (must realize PAGED/TRITON), `on --pa-backend torch`, `auto` (PAGED/TRITON),
#                   `off` (EAGER), ClusterStatus read and one greedy request through the router each, then 8
#                   concurrent requests (tokens/s, on vs on-torch and vs off) and the worker's compiles
#                   after ready
#   i_graphs.txt    benchmarks/gpu_check.py graphs: `--cuda-graphs on` realized (captured, parity-checked at
#                   startup), fp32 and bf16 greedy runs against `off` at batch 1/8/64 (tokens equal, or
#                   parted at a near tie with the logits agreeing up to it), no decode step run eagerly,
#                   tok/s on vs off (dry run: auto off with no-cuda-device, on exit 78, the uncaptured
#                   static path in fp32)
#   f_host.txt      benchmarks/gpu_perf.py: a serving PagedAttentionStep's host time per layer at decode
#                   batch 1/16/64 (context 2k) and the kernel compiles after the startup warm-up (must be 0)
#   g_device_map.txt  benchmarks/gpu_check.py device-map: `--device-map cuda:0=N-1,cpu=1` in-process (fp32):
#                   auto realizes EAGER with the mixed-map reason, greedy tokens equal a one-device run's,
#                   on is refused before loading (dry run: cpu=N-1,cpu=1)
#   h_tp.txt        benchmarks/gpu_check.py tp, only with 2 or more GPUs (else a SKIP line saying so; the
#                   dry run runs it on the CPU): `--tensor-parallel-size 3 --device cuda:0` refused before
#                   loading (this build has gloo, not NCCL), TP=3 on CPU ranks (eager) gives the greedy
#                   tokens of TP=1 (paged) (2 minutes at most)
#   summary.txt     one line a step (PASS / WARN / FAIL / SKIP, exit code, seconds); also printed last
# The model is a tiny Llama with SmolLM2's attention shapes built on the fly (the SmolLM2 GGUF is 98 MB,
# more than a run can carry); KVPACT_GPU_CHECK_MODEL=PATH uses another.
# GPU_CHECK_ONLY="d i": run only those steps (the letters before the ')'); a rerun after a fix.
# --dry-run: the same steps on this machine's CPU with CPU expectations (interpreter for the kernels,
# a subset of the kernel tests, float32 only in c), the torch paged backend, auto staying eager), and no
# run that would repeat another on a CPU (on --pa-backend torch is on; torch vs torch in d); kvpact is
# imported through the link tree alone, as there (a sitecustomize drops an editable install's hook).
set -u
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT" || exit 1
DRY=0
[ "${1:-}" = "--dry-run" ] && DRY=1
PY=${PYTHON:-python3}
OUT=${OUT:-$(mktemp -d /tmp/kvpact-gpu-check-out.XXXXXX)}
mkdir -p "$OUT"
WORK=$(mktemp -d /tmp/kvpact-gpu-check.XXXXXX)
BUDGET=${GPU_CHECK_BUDGET_S:-540}
START=$(date +%s)
DEVICE=cuda
[ $DRY = 1 ] && DEVICE=cpu
MODEL=${KVPACT_GPU_CHECK_MODEL:-tiny}
export PYTHONUNBUFFERED=1 KVPACT_CACHE_DIR="$WORK/cache"
: > "$OUT/summary.txt"

note() { echo "$*" | tee -a "$OUT/summary.txt"; }
left() { echo $((BUDGET - ($(date +%s) - START))); }

# step NAME FILE MAX_SECONDS CMD...: run CMD under min(MAX, budget left - 10) seconds; one summary line.
step() {
    local name=$1 file=$2 max=$3
    shift 3
    if [ -n "${GPU_CHECK_ONLY:-}" ] && [[ " $GPU_CHECK_ONLY " != *" ${name%%)*} "* ]]; then
        note "SKIP  $name: not in GPU_CHECK_ONLY=$GPU_CHECK_ONLY"
        return
    fi
    local limit
    limit=$(left)
    limit=$((limit - 10 < max ? limit - 10 : max))
    if [ "$limit" -lt 20 ]; then
        note "SKIP  $name: the ${BUDGET}s budget is spent"
        return
    fi
    local t0 rc
    t0=$(date +%s)
    echo "### $name: $* (limit ${limit}s)" > "$OUT/$file"
    timeout -k 20 "$limit" "$@" >> "$OUT/$file" 2>&1
    rc=$?
    local secs=$(($(date +%s) - t0))
    local verdict=PASS
    [ $rc -ne 0 ] && verdict=FAIL
    [ $rc -eq 124 ] && verdict="FAIL (timed out)"
    local detail
    detail=$(grep -E '^RESULT |^(=+ )?[0-9]+ (passed|failed)|max \|triton - torch\||^ *(FAIL|WARN) |^decode bandwidth' \
        "$OUT/$file" | tail -14 | sed 's/^/        /')
    grep -q '^RESULT .*: WARN' "$OUT/$file" && [ $rc -eq 0 ] && verdict=WARN
    note "$verdict  $name: exit $rc, ${secs}s ($file)"
    [ -n "$detail" ] && note "$detail"
}

# ---- carried wheels ----
if ls .whl/*.whl > /dev/null 2>&1; then
    if "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$WORK/site" .whl/*.whl > "$WORK/wheels.txt" 2>&1; then
        SITE="$WORK/site"
    else
        note "WARN  the carried wheels did not install: $(tail -3 "$WORK/wheels.txt" | tr '\n' ' ')"
    fi
fi
# kvpact.* as this checkout's folders (pyproject's package-dir, spelled out as links; nothing installed),
# then the checkout itself for benchmarks/ and tests/.
if ! TREE=$("$PY" tools/link_tree.py "$WORK/tree" 2> "$WORK/tree.txt"); then
    note "FAIL  tools/link_tree.py: $(tr '\n' ' ' < "$WORK/tree.txt")"
    exit 1
fi
export PYTHONPATH="${SITE:+$SITE:}$TREE:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
if [ $DRY = 1 ]; then
    # Import kvpact as the GPU machine does, through the link tree alone: an editable install's import
    # hook (a .venv's) would answer first and hide a path that works only here.
    mkdir -p "$WORK/no_editable"
    printf '%s\n' 'import sys' \
        'sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in repr(f).lower()]' \
        > "$WORK/no_editable/sitecustomize.py"
    export PYTHONPATH="$WORK/no_editable:$PYTHONPATH"
fi

# ---- a) environment ----
{
    echo "### a) environment ($(date -u +%FT%TZ)); dry run: $DRY; python: $PY; carried wheels: ${SITE:-none}"
    if command -v nvidia-smi > /dev/null; then timeout 30 nvidia-smi; else echo "no nvidia-smi"; fi
    find .whl -maxdepth 1 -type f -printf "carried: %f\n" 2> /dev/null
    timeout 60 "$PY" benchmarks/gpu_check.py env --device "$DEVICE"
    echo "gpu_check.py env exit $?"
} > "$OUT/a_env.txt" 2>&1
MISSING=$(sed -n 's/^MISSING_MODULES *//p' "$OUT/a_env.txt")
if ! grep -q '^gpu_check.py env exit 0' "$OUT/a_env.txt"; then
    note "FAIL  a) environment: python or torch is not usable here; see a_env.txt:"
    grep -E '^MISSING|^python|Error' "$OUT/a_env.txt" | sed 's/^/        /' | tee -a "$OUT/summary.txt"
    exit 2
fi
note "PASS  a) environment: $(grep -E '^torch |^triton |compute capability' "$OUT/a_env.txt" | tr '\n' ';')"
[ -n "$MISSING" ] && note "WARN  missing modules: $MISSING (steps that need them are skipped; carry .whl: benchmarks/gpu_wheels.sh)"
if [ $DRY = 0 ] && [[ " $MISSING " == *" triton "* ]]; then
    note "FAIL  triton is not importable here: the Triton kernels cannot run (see a_env.txt)"
    exit 2
fi
if [ $DRY = 0 ] && ! grep -q 'cuda available: True' "$OUT/a_env.txt"; then
    note "FAIL  torch sees no CUDA device here; the CUDA steps cannot run (use --dry-run without a GPU)"
    exit 2
fi

needs() { # needs STEP MODULE...: 0 if every module is present, else note a SKIP
    local name=$1 m
    shift
    for m in "$@"; do
        if [[ " $MISSING " == *" $m "* ]]; then
            note "SKIP  $name: needs python module $m, missing here"
            return 1
        fi
    done
}
SERVING=(numpy safetensors tokenizers jinja2 gguf structlog prometheus_client grpc grpc_health grpc_reflection google.protobuf)

# ---- b) kernel tests, compiled on the GPU ----
if needs "b) kernel tests" pytest triton; then
    if [ $DRY = 1 ]; then
        step "b) kernel tests (dry run: interpreter, a subset)" b_kernels.txt 150 \
            env KVPACT_KERNEL_DEVICE=cpu TRITON_INTERPRET=1 "$PY" -m pytest tests/kernels/triton_cases.py \
            -q -p no:cacheprovider -m '' -rfE --tb=short -k 'default_num_splits or cache_write_accepts_strided'
    else
        XDIST=()
        "$PY" -c 'import xdist' 2> /dev/null && XDIST=(-n 8)
        step "b) kernel tests (compiled on the GPU, -m '')" b_kernels.txt 150 \
            env KVPACT_KERNEL_DEVICE=cuda "$PY" -m pytest tests/kernels/triton_cases.py \
            -q -p no:cacheprovider -m '' -rfE --tb=short -k 'not cuda_compile' ${XDIST[@]+"${XDIST[@]}"}
    fi
fi

# ---- c) kernel benchmark ----
if needs "c) kernel benchmark" triton; then
    QUICK=()
    [ $DRY = 1 ] && QUICK=(--quick)  # the interpreter: float32 only
    step "c) benchmarks/kernels.py" c_bench.txt 100 "$PY" benchmarks/kernels.py ${QUICK[@]+"${QUICK[@]}"}
fi

# ---- d) the engine in-process ----
if needs "d) engine" triton "${SERVING[@]}"; then
    step "d) engine: triton vs torch, sync audit" d_engine.txt 120 \
        "$PY" benchmarks/gpu_check.py engine --device "$DEVICE" --model "$MODEL" --workdir "$WORK"
fi

# ---- i) CUDA graphs for decode (dry run: the uncaptured static path, and the CPU's verdicts) ----
if needs "i) cuda graphs" triton "${SERVING[@]}"; then
    step "i) cuda graphs: capture, replay == eager tokens at batch 1/8/64, tok/s on vs off" i_graphs.txt 100 \
        "$PY" benchmarks/gpu_check.py graphs --device "$DEVICE" --model "$MODEL" --workdir "$WORK"
fi

# ---- f) host work per layer, compiles after the warm-up ----
if needs "f) host time" triton numpy google.protobuf; then
    if [ $DRY = 1 ]; then
        step "f) host time per layer (dry run: torch backend)" f_host.txt 80 \
            "$PY" benchmarks/gpu_perf.py --device cpu --batches 1 4 --repeats 1
    else
        step "f) host time per layer at batch 1/16/64, compiles after warm-up" f_host.txt 80 \
            "$PY" benchmarks/gpu_perf.py --device cuda
    fi
fi

# ---- g) the seed's device map: layers on cuda:0 and the CPU as stages ----
if needs "g) device map" "${SERVING[@]}"; then
    step "g) --device-map cuda:0=N-1,cpu=1: auto eager + same tokens, on refused" g_device_map.txt 100 \
        "$PY" benchmarks/gpu_check.py device-map --device "$DEVICE" --model "$MODEL" --workdir "$WORK"
fi

# ---- h) tensor parallel: two or more GPUs (the dry run: the CPU) ----
NUM_GPUS=$(timeout 60 "$PY" -c "import torch; print(torch.cuda.device_count())" 2> /dev/null || echo 0)
if [ $DRY = 0 ] && [ "${NUM_GPUS:-0}" -lt 2 ]; then
    note "SKIP  h) tensor parallel: this machine has ${NUM_GPUS:-0} GPU; the TP section needs 2 or more"
elif needs "h) tensor parallel" "${SERVING[@]}"; then
    step "h) tensor parallel: cuda refused (gloo only), TP=3 == TP=1" h_tp.txt 120 \
        "$PY" benchmarks/gpu_check.py tp --device "$DEVICE" --model "$MODEL" --workdir "$WORK"
fi

# ---- e) router + worker processes ----
if needs "e) end to end" "${SERVING[@]}"; then
    step "e) end to end: router + worker (on, on-torch, auto, off)" e_e2e.txt 150 \
        "$PY" benchmarks/gpu_check.py e2e --device "$DEVICE" --model "$MODEL" --workdir "$WORK"
fi

# ---- summary ----
{
    echo "total $(($(date +%s) - START))s of a ${BUDGET}s budget; outputs in $OUT"
    command -v nvidia-smi > /dev/null && timeout 20 nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
} >> "$OUT/summary.txt" 2>&1
echo "=============================== summary ==============================="
cat "$OUT/summary.txt"
grep -q '^FAIL' "$OUT/summary.txt" && exit 1
exit 0
