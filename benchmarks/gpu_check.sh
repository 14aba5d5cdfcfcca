#!/usr/bin/env bash
# One bounded GPU session (docs/simulation.md, "On a GPU"): the paper-scale slice with its phase
# table and extrapolation, the gpu-marked tests, the executor variants on one chunk, and
# `fedfs bench` at two chunk sizes. Every step has its own time limit (seconds, scaled by
# GPU_CHECK_SCALE); logs go to $OUT (or ./gpu_out). From the repo root:
#   PYTHONPATH=. bash benchmarks/gpu_check.sh
set -uo pipefail
out="${OUT:-gpu_out}"; mkdir -p "$out"
scale="${GPU_CHECK_SCALE:-1}"
export PYTHONPATH="${PYTHONPATH:-.}" PYTHONUNBUFFERED=1
step() {   # step NAME SECONDS CMD...
  local name="$1" secs; secs=$(python3 -c "print(int($2 * $scale))"); shift 2
  echo "=== $name (limit ${secs}s): $*"
  local t0=$SECONDS
  timeout "$secs" "$@" 2>&1 | grep -v -e USDT -e "Profiler clears" -e "_warn_once" | tee "$out/$name.log"
  echo "=== $name: exit ${PIPESTATUS[0]} after $((SECONDS - t0)) s"
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/smi.txt"
(nvidia-smi dmon -s um -d 1 > "$out/dmon.txt" 2>&1 &)
step paper_slice 105 python benchmarks/gpu_paper_scale.py --slice 384 --eval-clients 16 --json "$out/paper_slice.json"
# the SDK default (scope=top: ξ's trunk once per image per run, only the top trained per step)
step paper_slice_top 60 python benchmarks/gpu_paper_scale.py --slice 384 --eval-clients 16 --methods fedfs fedfs+feduv \
  --json "$out/paper_slice_top.json"
# only the simulator's files: the GPU image may lack the server/secagg dependencies (cryptography)
step gpu_tests 70 python -m pytest -q -m gpu -p no:cacheprovider --continue-on-collection-errors \
  tests/test_sim_executor_paths.py tests/test_sim_executors.py tests/test_sim_federation.py \
  tests/test_sim_data_pipeline.py tests/test_synthfaces.py tests/test_server_aggregate.py
step variants 55 python benchmarks/gpu_step_profile.py --device cuda --clients 48 --no-reference \
  --variants default pointwise=matmul channels_last=true --repeats 2 --json "$out/variants.json"
for c in 16 32; do
  step "bench_chunk$c" 25 python -m fedfs_sdk.cli.main bench --device cuda --backbone mobilefacenet --image-size 112 \
    --clients $((2 * c)) --chunk-size $c --images 57 --batch-size 10 --local-epochs 2 --amp bf16 --repeats 1 \
    --executors batched
done
