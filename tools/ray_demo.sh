#!/usr/bin/env bash
# The Ray launcher as an operator runs it, end to end on this machine (docs/ray.md): a private Ray head
# (token auth), `kvpact-launch` as a Ray job with one autoscaled CPU group of the default model, then
#   1_scale.txt           `kvpact-launch scale` 1 -> 2 -> 1 as Ray jobs, `router status` after each
#   2_autoscale_lines.txt a burst of 12 requests, 15 s idle: the launcher's scaling lines
#   3_crash.txt           the worker SIGKILLed: the launcher's report with its own last lines, its restart
#   4_job_stop.txt        `ray job stop` during 8 streams: each stream's outcome, then what is left running
#   5_job_logs.txt        the whole job log (worker lines prefixed WorkerActor(<id>))
# Usage: tools/ray_demo.sh OUTDIR   (from the repository root, with .venv built; about 4 minutes)
# It stops only what it started (its head's process group), never `ray stop`.
set -u
OUT=$(realpath -m "$1"); mkdir -p "$OUT"
TMPDIR=$(mktemp -d /tmp/kvdemo.XXXX); export TMPDIR RAY_TMPDIR=
# shellcheck source=/dev/null
source .venv/bin/activate
RAY_AUTH_TOKEN=$(python -c "import secrets; print(secrets.token_hex(16))")
export RAY_JOB_STOP_WAIT_TIME_S=90 RAY_AUTH_MODE=token RAY_AUTH_TOKEN
port() { python -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
GCS=$(port); DASH=$(port); RP=$(port)
# --block in its own process group: this demo stops its own head by that group, never `ray stop`
setsid ray start --head --block --port "$GCS" --dashboard-port "$DASH" --num-cpus 3 --dashboard-host 127.0.0.1 \
  --node-ip-address 127.0.0.1 --temp-dir "$TMPDIR/ray" --disable-usage-stats > "$OUT/head.log" 2>&1 &
HEAD=$!
trap 'kill -- -$HEAD 2>/dev/null; sleep 5; kill -9 -- -$HEAD 2>/dev/null; rm -rf "$TMPDIR"' EXIT
export RAY_ADDRESS="http://127.0.0.1:$DASH"
for _ in $(seq 1 60); do ray job list > /dev/null 2>&1 && break; sleep 1; done
cat > "$TMPDIR/demo.yaml" <<YAML
ray: {address: auto, placement_strategy: PACK, placement_timeout_s: 60}
router: {listen: 127.0.0.1:$RP, paged_attn: "on", startup_timeout_s: 300}
workers:
  - name: cpu
    replicas: 1
    min_replicas: 1
    max_replicas: 2
    resources: {num_cpus: 0.5}
    max_restarts: 1
    autoscale: {metric: waiting, target: 1, up_after_s: 3, down_after_s: 15}
    flags: {device: cpu, pa-backend: torch, max-model-len: 512, max-num-seqs: 2}
YAML
{ echo '$ cat demo.yaml'; cat "$TMPDIR/demo.yaml"; } > "$OUT/0_config.txt"
JOB=demo23-$RP; ray job submit --no-wait --submission-id "$JOB" -- kvpact-launch --config "$TMPDIR/demo.yaml" > "$OUT/submit.txt" 2>&1
echo "job $JOB"
for _ in $(seq 1 240); do ray job logs "$JOB" 2>/dev/null | grep -q "is SERVING" && break; sleep 1; done
st() { echo "\$ router status --address 127.0.0.1:$RP"; router status --address "127.0.0.1:$RP" 2>&1; }
{ echo "### SERVING"; st; } > "$OUT/1_scale.txt"
{ echo "\$ ray job submit -- kvpact-launch scale --group cpu --replicas 2"; time ray job submit -- kvpact-launch scale --group cpu --replicas 2 2>&1 | tail -5; st; } >> "$OUT/1_scale.txt" 2>&1
{ echo "\$ ray job submit -- kvpact-launch scale --group cpu --replicas 1"; time ray job submit -- kvpact-launch scale --group cpu --replicas 1 2>&1 | tail -5; st; } >> "$OUT/1_scale.txt" 2>&1
# autoscaling: a burst of 12 long requests (max-num-seqs 2: 10 wait), then idle
python - "$RP" > "$OUT/2_burst.txt" 2>&1 <<'PY'
import sys, time, concurrent.futures as cf
from kvpact.client import Client
c = Client(f"127.0.0.1:{sys.argv[1]}", timeout=600)
t = time.monotonic()
def one(i):
    r = c.complete(f"Tell me a long story number {i}.", max_tokens=160, temperature=0, ignore_eos=True)
    return len(r.token_ids), r.finish_reason
with cf.ThreadPoolExecutor(12) as ex:
    print([f.result() for f in [ex.submit(one, i) for i in range(12)]])
print(f"burst done in {time.monotonic()-t:.1f}s")
PY
sleep 25  # down_after_s 15 + a drain
ray job logs "$JOB" 2>&1 | grep -iE "autoscal|scal(e|ing)|drain" > "$OUT/2_autoscale_lines.txt"
{ echo "### after the burst and 25 s idle"; st; } >> "$OUT/2_autoscale_lines.txt"
# a crash: SIGKILL the worker process; the launcher's report carries the worker's own last lines
WPID=$(ray job logs "$JOB" 2>&1 | grep -o "worker cpu-0 (pid [0-9]*)" | tail -1 | grep -o "[0-9]*)" | tr -d ")"); echo "killing worker cpu-0 pid $WPID" > "$OUT/3_crash.txt"
kill -9 "$WPID"
for _ in $(seq 1 60); do ray job logs "$JOB" 2>/dev/null | grep -q "restarting it" && break; sleep 1; done
for _ in $(seq 1 180); do [ "$(ray job logs "$JOB" 2>/dev/null | grep -c "worker cpu-0 admitted by router")" -ge 2 ] && break; sleep 1; done; sleep 2
ray job logs "$JOB" 2>&1 | grep -A30 "exited with code -9" | grep -v '"event"' | head -60 >> "$OUT/3_crash.txt"
st >> "$OUT/3_crash.txt"
# ray job stop during 8 streams
python - "$RP" "$JOB" > "$OUT/4_job_stop.txt" 2>&1 <<'PY'
import sys, time, threading, subprocess
from kvpact.client import Client
rp, job = sys.argv[1], sys.argv[2]
results = {}
def one(i):
    c = Client(f"127.0.0.1:{rp}", timeout=600)
    n = 0
    try:
        for chunk in c.generate(f"Count slowly {i}", max_tokens=60, temperature=0, ignore_eos=True):
            n += len(chunk.token_ids)
        results[i] = ("OK", n)
    except Exception as e:
        results[i] = (type(e).__name__ + ": " + str(e)[:200], n)
ts = [threading.Thread(target=one, args=(i,)) for i in range(8)]
[t.start() for t in ts]; time.sleep(3)
t0 = time.monotonic()
print("$ ray job stop", job); print(subprocess.run(["ray", "job", "stop", job], capture_output=True, text=True).stdout[-1500:])
[t.join(300) for t in ts]
print(f"stop returned after {time.monotonic()-t0:.1f}s")
for i in sorted(results): print(f"stream {i}: {results[i][0]}, {results[i][1]} tokens")
print("job status:", subprocess.run(["ray", "job", "status", job], capture_output=True, text=True).stdout.strip()[-300:])
PY
ray job logs "$JOB" > "$OUT/5_job_logs.txt" 2>&1
PIDS=$(grep -oE "(router started on [^ ]+ \(pid|worker [a-z0-9-]+ \(pid) [0-9]+" "$OUT/5_job_logs.txt" | grep -oE "[0-9]+$" | sort -u)
{ echo "pids the launcher started: ${PIDS//$'\n'/ }"; for p in $PIDS; do kill -0 "$p" 2>/dev/null && echo "STILL RUNNING: $p"; done; echo "(none still running unless listed)"; } >> "$OUT/4_job_stop.txt"
