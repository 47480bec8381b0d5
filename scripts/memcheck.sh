#!/usr/bin/env bash
# Run a job N times under a memory checker and report every memory error (docs/fault_tolerance.md "Native crashes").
#   bash scripts/memcheck.sh RUNS NPROC [run_train.py args...]
#   e.g. bash scripts/memcheck.sh 12 4 --config arithmetic --world.inference_ranks=2 --inference.engine=vllm ...
#   MEMCHECK_VALGRIND_RANKS=K bash scripts/memcheck.sh ...   # valgrind on ranks 0..K-1 (the trainers) instead
# AddressSanitizer (the default) is preloaded into the uninstrumented Python, torch, gloo and vLLM of every process:
# its allocator keeps freed memory out of use for a while and its interceptors check every recv/read/memcpy/memset,
# so a transport or copy that writes into a freed buffer is reported (writer's, freeing and allocating stacks) every
# time it happens, not only in the rare run where the write lands on live allocator data. Plain stores inside native
# kernels are not checked by ASan; valgrind checks every access (~50x slower, AVX2 code paths: no AVX-512 there).
# A positive control (gloo receiving into freed memory, scripts/memcheck_control.py) runs first under the same tool:
# if the tool does not report it, the script stops, since a clean run would mean nothing.
# Output in $MEMCHECK_OUT (default outputs/memcheck): reports in reports/, logs of failed runs as run<i>.{out,err}.
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
VALGRIND_RANKS="${MEMCHECK_VALGRIND_RANKS:-0}"

if [ "${1:-}" = "--rank" ]; then  # valgrind mode: torchrun starts every rank through here (--no-python)
  shift
  if [ "$RANK" -lt "$VALGRIND_RANKS" ]; then
    exec valgrind --tool=memcheck --undef-value-errors=no --error-limit=no --num-callers=40 \
      --log-file="$MEMCHECK_REPORTS/valgrind.rank$RANK.%p" "$PY" -u "$@"
  fi
  exec "$PY" -u "$@"
fi

runs="${1:?usage: memcheck.sh RUNS NPROC [run_train.py args...]}"
nproc="${2:?usage: memcheck.sh RUNS NPROC [run_train.py args...]}"
shift 2
out="${MEMCHECK_OUT:-outputs/memcheck}"
rm -rf "$out" && mkdir -p "$out/reports" "$out/control/reports"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1
port() { "$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

if [ "$VALGRIND_RANKS" -gt 0 ]; then
  command -v valgrind > /dev/null || { echo "memcheck: valgrind is not installed" >&2; exit 2; }
  # Errors only, never the dynamic loader's reads of its own strings (every `import torch` shows 4 of those).
  errors='Invalid write|Invalid free|Mismatched free|unaddressable byte'
  checked() {  # REPORTS NPROC SCRIPT ARGS...: every rank through this script's --rank role
    MEMCHECK_REPORTS="$1" MEMCHECK_VALGRIND_RANKS="$VALGRIND_RANKS" PYTHONMALLOC=malloc \
      "$PY" -m torch.distributed.run --nnodes 1 --nproc-per-node "$2" --rdzv-backend c10d \
      --rdzv-endpoint "127.0.0.1:$(port)" --no-python scripts/memcheck.sh --rank "${@:3}"
  }
else
  lib() { ldconfig -p | awk -v n="$1" '$1 == n { print $NF; exit }'; }
  asan="$(lib libasan.so.8)"
  asan="${asan:-$(lib libasan.so.6)}"
  [ -n "$asan" ] || { echo "memcheck: no libasan on this machine (Debian: apt-get install libasan8)" >&2; exit 2; }
  errors='ERROR: AddressSanitizer'
  # libstdc++ is preloaded too: python does not link it, and ASan's __cxa_throw interceptor must find the real one
  # when it starts, or the first C++ exception (torch raises them on purpose) aborts the process.
  checked() {
    LD_PRELOAD="$asan:$(lib libstdc++.so.6)" \
      ASAN_OPTIONS="detect_leaks=0:verify_asan_link_order=0:alloc_dealloc_mismatch=0:allow_user_segv_handler=1:malloc_context_size=40:log_path=$1/asan" \
      "$PY" -m torch.distributed.run --nnodes 1 --nproc-per-node "$2" --rdzv-backend c10d \
      --rdzv-endpoint "127.0.0.1:$(port)" "${@:3}"
  }
fi
reported() { grep -lsE "$errors" "$1"/* 2> /dev/null | wc -l; }

VALGRIND_RANKS=$((VALGRIND_RANKS > 0 ? 2 : 0)) checked "$out/control/reports" 2 scripts/memcheck_control.py \
  > "$out/control/log" 2>&1
if [ "$(reported "$out/control/reports")" -eq 0 ]; then
  echo "memcheck: the checker did not report the control's write into freed memory: a clean run would mean nothing" >&2
  exit 2
fi
echo "control: the write into freed memory was reported, so the check works here"

clean=0
for i in $(seq 1 "$runs"); do
  t0=$(date +%s)
  checked "$out/reports" "$nproc" run_train.py "$@" --job.output_dir="$out/job$i" > "$out/run$i.out" 2> "$out/run$i.err"
  rc=$?
  aborts=$(grep -cE "SIGABRT|SIGSEGV|Fatal Python error|malloc|corrupt" "$out/run$i.err")
  echo "run $i/$runs: exit $rc, files with memory errors so far $(reported "$out/reports"), abort lines $aborts," \
    "$(($(date +%s) - t0)) s"
  if [ "$rc" -eq 0 ] && [ "$aborts" -eq 0 ]; then clean=$((clean + 1)) && rm -rf "$out/job$i" "$out/run$i.err"; fi
done
echo "memcheck: $clean of $runs runs clean, $(reported "$out/reports") report file(s) with memory errors in $out/reports"
[ "$clean" -eq "$runs" ] && [ "$(reported "$out/reports")" -eq 0 ]
