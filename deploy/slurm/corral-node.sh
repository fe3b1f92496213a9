#!/usr/bin/env bash
# One node's corral daemon in a Slurm job: deploy/slurm/corral.sbatch runs it on every node of the
# allocation with srun, one task per node. It starts `corral serve` with a TCP listener (the job's
# bearer token) and a socket and state directory of its own on the node's local disk, waits until
# the daemon answers SERVING on that TCP port with the token, then writes the node's entry for
# cluster.json (corral_nodes.py) and stays until the daemon ends. SIGTERM (the end of the job,
# scancel, or the batch script once its command is done) stops the daemon, which destroys its
# sandboxes first.
#
# Set by corral.sbatch: CORRAL_JOB_DIR (shared: token, nodes/, logs/), CORRAL_SLURM_DIR.
# Settings, from the environment: see corral.sbatch.
set -euo pipefail

: "${CORRAL_JOB_DIR:?CORRAL_JOB_DIR is not set (corral.sbatch sets it)}"
: "${SLURM_JOB_ID:?not in a Slurm job}"
slurm_dir=${CORRAL_SLURM_DIR:-$(dirname "$(readlink -f "$0")")}
corral=${CORRAL_BIN:-corral}
python=${CORRAL_PYTHON:-python3}
port=${CORRAL_PORT:-7700}
node=${SLURMD_NODENAME:-$(hostname -s)}
# The name other nodes reach this one by; the daemon listens on every interface.
host=${CORRAL_ADVERTISE_HOST:-$(hostname -f 2>/dev/null || hostname)}
# Node-local (never the shared filesystem): the socket, and the state directory with the
# sandboxes' roots and the image cache. Per job unless CORRAL_STATE_DIR names a lasting one.
run_dir=${CORRAL_RUN_DIR:-${TMPDIR:-/tmp}/corral-$SLURM_JOB_ID}
state_dir=${CORRAL_STATE_DIR:-$run_dir/state}
socket=$run_dir/corral.sock
token_file=$CORRAL_JOB_DIR/token
log=$CORRAL_JOB_DIR/logs/$node.log
start_timeout_s=${CORRAL_START_TIMEOUT_S:-120}
# The daemon runs as the job's user: as root where the job is, else rootless (local and Apptainer
# sandboxes; docs/local-backend.md, "Without root"). For a root daemon in a job that is not root:
# CORRAL_SERVE_PREFIX="sudo -n".
read -r -a serve_prefix <<<"${CORRAL_SERVE_PREFIX:-}"

mkdir -p "$run_dir" "$CORRAL_JOB_DIR/logs"
serve=("$corral" serve --socket "$socket" --state-dir "$state_dir" --tcp "0.0.0.0:$port" --token-file "$token_file")
if [[ -n ${CORRAL_CONFIG:-} ]]; then
  serve+=(--config "$CORRAL_CONFIG")
fi
echo "$node: ${serve_prefix[*]} ${serve[*]} (log: $log)"
"${serve_prefix[@]}" "${serve[@]}" >>"$log" 2>&1 &
daemon=$!

# shellcheck disable=SC2317  # (run by the trap below)
stop() {
  trap - TERM INT
  kill -TERM "$daemon" 2>/dev/null || true
  wait "$daemon" 2>/dev/null || true
  exit 0
}
trap stop TERM INT

deadline=$((SECONDS + start_timeout_s))
until CORRAL_TOKEN=$(<"$token_file") "$corral" health --address "127.0.0.1:$port" --timeout 2 >/dev/null 2>&1; do
  if ! kill -0 "$daemon" 2>/dev/null; then
    wait "$daemon" && status=0 || status=$?
    echo "$node: the daemon exited ($status) before it served; the end of $log:" >&2
    tail -n 20 "$log" >&2
    exit 1
  fi
  if ((SECONDS >= deadline)); then
    echo "$node: the daemon did not serve within ${start_timeout_s} s (see $log)" >&2
    kill -TERM "$daemon" 2>/dev/null || true
    exit 1
  fi
  sleep 0.5
done
"$python" "$slurm_dir/corral_nodes.py" add-node --dir "$CORRAL_JOB_DIR/nodes" --node "$node" \
  --address "$host:$port" --socket "$socket" --state-dir "$state_dir"
echo "$node: serving at $host:$port"

wait "$daemon" && status=0 || status=$?
echo "$node: the daemon exited ($status)" >&2
exit "$status"
