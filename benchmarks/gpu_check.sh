#!/usr/bin/env bash
# One bounded GPU session (docs/simulation.md, "On a GPU"): the gpu-marked tests, the executor
# variants on one chunk with a profile, `fedfs bench` at two chunk sizes, and the paper-scale
# slice. Every step has its own time limit; logs go to $OUT (or ./gpu_out). Run from the repo root:
#   PYTHONPATH=. bash benchmarks/gpu_check.sh [quick|full]
set -uo pipefail
out="${OUT:-gpu_out}"; mkdir -p "$out"
mode="${1:-full}"
export PYTHONPATH="${PYTHONPATH:-.}" PYTHONUNBUFFERED=1
step() {   # step NAME SECONDS CMD...
  local name="$1" secs="$2"; shift 2
  echo "=== $name (limit ${secs}s): $*"
  local t0=$SECONDS
  timeout "$secs" "$@" 2>&1 | grep -v -e USDT -e "Profiler clears" -e "_warn_once" | tee "$out/$name.log"
  echo "=== $name: exit ${PIPESTATUS[0]} after $((SECONDS - t0)) s"
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/smi.txt"
(nvidia-smi dmon -s um -d 1 > "$out/dmon.txt" 2>&1 &)
step gpu_tests 150 python -m pytest -q -m gpu -p no:cacheprovider tests
step step_profile 120 python benchmarks/gpu_step_profile.py --device cuda --clients 48 \
  --variants default pointwise=matmul fold=off --repeats 2 --profile --json "$out/step_profile.json"
if [ "$mode" = full ]; then
  for c in 32 64; do
    step "bench_chunk$c" 120 python -m fedfs_sdk.cli.main bench --device cuda --backbone mobilefacenet --image-size 112 \
      --clients 128 --chunk-size $c --images 57 --batch-size 10 --local-epochs 2 --amp bf16 --repeats 1 \
      --executors batched batched-vmap
  done
fi
step paper_slice 200 python benchmarks/gpu_paper_scale.py --slice 1024 --eval-clients 32 --json "$out/paper_slice.json"
