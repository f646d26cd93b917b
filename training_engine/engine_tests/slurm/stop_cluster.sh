#!/usr/bin/env bash
# Stop the SLURM test cluster started by start_cluster.sh: cancel its jobs, then end slurmd, slurmctld,
# slurmdbd, MariaDB and munged by the pids recorded under $SLURM_TEST_ROOT/run, and wait until they are gone.
# Safe to run when nothing (or only part of the cluster) is running.
set -uo pipefail

ROOT=$(realpath -m "${SLURM_TEST_ROOT:-/tmp/slurm-test}")
RUN=$ROOT/run
export SLURM_CONF=$ROOT/etc/slurm.conf
WAIT=${SLURM_TEST_STOP_WAIT:-30}

log() { echo "[stop_cluster] $*" >&2; }

# pid_of PIDFILE NAME: print the pid if it is running and its command name starts with NAME
pid_of() {
    local pid
    [[ -s $1 ]] || return 1
    pid=$(tr -dc '0-9' <"$1")
    [[ -n $pid && -d /proc/$pid ]] || return 1
    [[ $(cat "/proc/$pid/comm" 2>/dev/null) == "$2"* ]] || return 1
    echo "$pid"
}

# stop_pids NAME PID...: SIGTERM, wait up to $WAIT s, then SIGKILL
stop_pids() {
    local name=$1; shift
    (( $# )) || return 0
    log "stopping $name (pid $*)"
    kill -TERM "$@" 2>/dev/null
    local deadline=$(( $(date +%s) + WAIT )) p left
    while :; do
        left=()
        for p in "$@"; do [[ -d /proc/$p ]] && left+=("$p"); done
        (( ${#left[@]} )) || return 0
        if (( $(date +%s) >= deadline )); then
            log "$name did not exit after ${WAIT}s, sending SIGKILL to ${left[*]}"
            kill -KILL "${left[@]}" 2>/dev/null
            sleep 1
            return 0
        fi
        sleep 0.2
    done
}

# Job processes of this cluster: slurmstepd (started by our slurmd, whose environment has our SLURM_CONF)
# and the job's own processes (SLURM_JOB_ID and our SLURM_CONF). Never this script or its callers.
job_pids() {
    local p self=" $$ " a=$$ env
    while [[ $a -gt 1 ]]; do a=$(awk '{ print $4 }' "/proc/$a/stat" 2>/dev/null) || break; self+="$a "; done
    for p in /proc/[0-9]*; do
        p=${p#/proc/}
        [[ $self == *" $p "* ]] && continue
        env=$(tr '\0' '\n' 2>/dev/null <"/proc/$p/environ") || continue
        grep -qx "SLURM_CONF=$SLURM_CONF" <<<"$env" || continue
        if [[ $(cat "/proc/$p/comm" 2>/dev/null) == slurmstepd ]] || grep -q '^SLURM_JOB_ID=' <<<"$env"; then
            echo "$p"
        fi
    done
}

# 1. Cancel all jobs while slurmctld still runs, so that no job outlives the cluster.
if ctld=$(pid_of "$RUN/slurmctld.pid" slurmctld) && command -v squeue >/dev/null; then
    jobs=$(timeout 10 squeue -h -o %A 2>/dev/null | tr '\n' ' ')
    if [[ -n ${jobs// /} ]]; then
        log "cancelling jobs: $jobs"
        timeout 10 scancel $jobs 2>/dev/null
        deadline=$(( $(date +%s) + 15 ))
        while [[ -n $(timeout 10 squeue -h -o %A 2>/dev/null) ]] && (( $(date +%s) < deadline )); do sleep 0.5; done
    fi
fi

# 2. Job processes the cancel did not end (slurmstepd ignores SIGTERM), e.g. when slurmctld was already gone.
mapfile -t left < <(job_pids)
WAIT=3 stop_pids "job processes" "${left[@]}"

# 3. Daemons in reverse start order; those in one group are stopped together.
for group in "slurmd:slurmd slurmctld:slurmctld" "slurmdbd:slurmdbd" "mariadb:mariadbd munged:munged"; do
    pids=(); names=()
    for entry in $group; do
        file=${entry%%:*}; name=${entry#*:}
        if pid=$(pid_of "$RUN/$file.pid" "$name"); then pids+=("$pid"); names+=("$name"); fi
    done
    if (( ${#pids[@]} )); then
        t=$(date +%s.%N)
        stop_pids "${names[*]}" "${pids[@]}"
        log "${names[*]} gone after $(awk -v a="$t" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }') s"
    fi
    for entry in $group; do rm -f "$RUN/${entry%%:*}.pid"; done
done
mapfile -t left < <(job_pids)
WAIT=3 stop_pids "job processes" "${left[@]}"
log "SLURM test cluster stopped (state kept under $ROOT; delete it for a clean start)"
