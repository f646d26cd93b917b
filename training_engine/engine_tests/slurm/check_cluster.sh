#!/usr/bin/env bash
# Check a running SLURM test cluster (start_cluster.sh) the way the SLURM tests use it, and print timings:
#   1. sbatch --wrap hostname completes and sacct shows COMPLETED
#   2. a 2-task job runs both tasks (srun)
#   3. scontrol requeue of a running job: it runs again (requeue -> running latency)
#   4. scancel --signal=USR1 reaches a job step; scancel -b --signal=USR1 reaches the batch script
#   5. a job at its time limit gets --signal=B:USR1@50 before it is killed   (~75 s; SLURM_CHECK_TIMELIMIT=0 skips)
#   6. submitit: a function's return value comes back; a cancelled job's result() raises
#      (uses $PYTHON, default python3; skipped when submitit is not importable there)
# Exit status: number of failed checks.
set -uo pipefail

ROOT=$(realpath -m "${SLURM_TEST_ROOT:-/tmp/slurm-test}")
# shellcheck disable=SC1091
source "$ROOT/env.sh" || { echo "no $ROOT/env.sh: run start_cluster.sh first" >&2; exit 1; }
PYTHON=${PYTHON:-python3}
WORK=$(mktemp -d "$ROOT/check.XXXXXX")
failed=0

ok()   { echo "PASS $*"; }
bad()  { echo "FAIL $*"; failed=$((failed + 1)); }
now()  { date +%s.%N; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }'; }
state() { squeue -h -j "$1" -o %T 2>/dev/null; }
# wait_state JOB STATE SECONDS
wait_state() {
    local deadline=$(( $(date +%s) + $3 ))
    until [[ $(state "$1") == "$2" ]]; do (( $(date +%s) < deadline )) || return 1; sleep 0.2; done
}
# wait_done JOB SECONDS: until the job has left the queue
wait_done() {
    local deadline=$(( $(date +%s) + $2 ))
    while [[ -n $(state "$1") ]]; do (( $(date +%s) < deadline )) || return 1; sleep 0.2; done
}
sacct_state() { sacct -n -X -P -j "$1" -o State 2>/dev/null | head -n 1; }
# wait_sacct JOB STATE SECONDS
wait_sacct() {
    local deadline=$(( $(date +%s) + $3 ))
    until [[ $(sacct_state "$1") == "$2"* ]]; do (( $(date +%s) < deadline )) || return 1; sleep 0.5; done
}

# 1. hostname
t=$(now)
id=$(sbatch --parsable -o "$WORK/host-%j.out" --wrap hostname)
if wait_done "$id" 60 && wait_sacct "$id" COMPLETED 30; then
    ok "hostname job $id COMPLETED in sacct ($(since "$t") s, output: $(cat "$WORK/host-$id.out"))"
else
    bad "hostname job $id: sacct state '$(sacct_state "$id")'"
fi

# 2. two tasks
id=$(sbatch --parsable -n 2 -o "$WORK/two-%j.out" --wrap 'srun bash -c "echo task \$SLURM_PROCID of \$SLURM_NTASKS"')
if wait_done "$id" 60 && [[ $(grep -c '^task [01] of 2$' "$WORK/two-$id.out") == 2 ]]; then
    ok "2-task job $id ran both tasks"
else
    bad "2-task job $id: $(cat "$WORK/two-$id.out" 2>/dev/null)"
fi

# 3. requeue
id=$(sbatch --parsable -o "$WORK/rq-%j.out" --wrap 'sleep 300')
if wait_state "$id" RUNNING 60; then
    t=$(now)
    scontrol requeue "$id"
    deadline=$(( $(date +%s) + 120 ))
    until [[ $(state "$id") == RUNNING ]] && scontrol show job "$id" | grep -q 'Restarts=1'; do
        (( $(date +%s) < deadline )) || break
        sleep 0.2
    done
    if scontrol show job "$id" | grep -q 'Restarts=1' && [[ $(state "$id") == RUNNING ]]; then
        ok "requeued job $id running again after $(since "$t") s"
    else
        bad "requeued job $id not running again within 120 s (state $(state "$id"))"
    fi
else
    bad "requeue: job $id never started"
fi
scancel "$id"

# 4. signals from scancel
cat >"$WORK/sig.sh" <<'EOF'
#!/bin/bash
trap 'echo batch >> "$MARK"' USR1
srun bash -c 'trap "echo step >> \"$MARK\"" USR1; for i in $(seq 600); do sleep 0.1; done' &
for i in $(seq 600); do sleep 0.1; done
EOF
for how in "-b" ""; do
    mark=$WORK/sig-mark${how}
    id=$(MARK=$mark sbatch --parsable -o "$WORK/sig-%j.out" "$WORK/sig.sh")
    if wait_state "$id" RUNNING 60; then
        sleep 2
        t=$(now)
        scancel $how --signal=USR1 "$id"
        want=$([[ $how == -b ]] && echo batch || echo step)
        for _ in $(seq 50); do grep -qx "$want" "$mark" 2>/dev/null && break; sleep 0.1; done
        if grep -qx "$want" "$mark" 2>/dev/null; then
            ok "scancel${how:+ $how} --signal=USR1 reached the $want of job $id within $(since "$t") s"
        else
            bad "scancel${how:+ $how} --signal=USR1 did not reach the $want of job $id"
        fi
    else
        bad "signal: job $id never started"
    fi
    scancel "$id"
done

# 5. time limit
if [[ ${SLURM_CHECK_TIMELIMIT:-1} == 1 ]]; then
    cat >"$WORK/tl.sh" <<'EOF'
#!/bin/bash
trap 'echo "USR1 $(date +%s)" >> "$MARK"' USR1
trap 'echo "TERM $(date +%s)" >> "$MARK"' TERM
echo "START $(date +%s)" >> "$MARK"
for i in $(seq 3000); do sleep 0.1; done
EOF
    mark=$WORK/tl-mark
    id=$(MARK=$mark sbatch --parsable --time=1 --signal=B:USR1@50 -o "$WORK/tl-%j.out" "$WORK/tl.sh")
    wait_done "$id" 150
    wait_sacct "$id" TIMEOUT 30
    start=$(awk '$1 == "START" { print $2 }' "$mark" 2>/dev/null)
    usr1=$(awk '$1 == "USR1" { print $2; exit }' "$mark" 2>/dev/null)
    term=$(awk '$1 == "TERM" { print $2; exit }' "$mark" 2>/dev/null)
    if [[ -n $start && -n $usr1 && $(sacct_state "$id") == TIMEOUT ]] && { [[ -z $term ]] || (( usr1 < term )); }; then
        ok "time-limit job $id: USR1 at +$((usr1 - start)) s, TERM at +$(( ${term:-0} - start )) s, sacct TIMEOUT"
    else
        bad "time-limit job $id: marks '$(tr '\n' ' ' <"$mark" 2>/dev/null)' sacct '$(sacct_state "$id")'"
    fi
fi

# 6. submitit
if "$PYTHON" -c 'import submitit' 2>/dev/null; then
    cat >"$WORK/sub.py" <<'EOF'
import sys, time
import submitit

def add(a, b):
    return a + b

def slow():
    time.sleep(300)

ex = submitit.AutoExecutor(folder=sys.argv[1] + "/%j")
ex.update_parameters(slurm_partition="debug", timeout_min=5, cpus_per_task=1, tasks_per_node=1)
assert type(ex._executor).__name__ == "SlurmExecutor", type(ex._executor)
t = time.time()
job = ex.submit(add, 2, 3)
assert job.result() == 5
print(f"PASS submitit job {job.job_id} returned 5 after {time.time() - t:.1f} s")
job = ex.submit(slow)
while job.state != "RUNNING":
    time.sleep(0.5)
t = time.time()
job.cancel()
try:
    job.result()
except Exception as e:
    print(f"PASS submitit cancelled job {job.job_id}: result() raised {type(e).__name__} after {time.time() - t:.1f} s")
else:
    sys.exit("FAIL submitit cancelled job returned a result")
EOF
    if ! timeout 240 "$PYTHON" "$WORK/sub.py" "$WORK/submitit"; then
        bad "submitit check (above)"
    fi
else
    echo "SKIP submitit: not importable by $PYTHON"
fi

echo "$failed check(s) failed; job files in $WORK"
exit "$failed"
