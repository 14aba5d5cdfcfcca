#!/usr/bin/env bash
# Bounded GPU calls (docs/simulation.md, "On a GPU"). Two parts, each < 600 s (one device call):
#   GPU_CHECK_PART=owed     — what the last GPU-less sessions owe: the default scope=top slice, the
#                             gpu-marked tests (fixed since the last GPU), the eager paper slice;
#   GPU_CHECK_PART=compiled — the compiled folded trunk (issue 32): the paper slice eager vs compiled
#                             (compile timed apart), one 48-client chunk eager vs compiled, interleaved;
#   GPU_CHECK_PART=all      — both (two device calls' worth: only where a session has the time).
# Every step has its own time limit (seconds, scaled by GPU_CHECK_SCALE); logs go to $OUT (or
# ./gpu_out). From the repo root:
#   GPU_CHECK_PART=owed PYTHONPATH=. bash benchmarks/gpu_check.sh
set -uo pipefail
out="${OUT:-gpu_out}"; mkdir -p "$out"
scale="${GPU_CHECK_SCALE:-1}"
part="${GPU_CHECK_PART:-owed}"
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
if [ "$part" = owed ] || [ "$part" = all ]; then
  # the SDK default (scope=top: ξ's trunk once per image per run, only the top trained per step)
  step paper_slice_top 90 python benchmarks/gpu_paper_scale.py --slice 384 --eval-clients 16 --methods fedfs fedfs+feduv \
    --json "$out/paper_slice_top.json"
  # only the simulator's files: the GPU image may lack the server/secagg dependencies (cryptography)
  step gpu_tests 150 python -m pytest -q -m gpu -p no:cacheprovider --continue-on-collection-errors \
    tests/test_sim_executor_paths.py tests/test_sim_executors.py tests/test_sim_federation.py \
    tests/test_sim_data_pipeline.py tests/test_synthfaces.py tests/test_server_aggregate.py \
    tests/test_sim_executor_compile.py
  step paper_slice 110 python benchmarks/gpu_paper_scale.py --slice 384 --eval-clients 16 --compile off \
    --json "$out/paper_slice.json"
  step bench_chunk32 30 python -m fedfs_sdk.cli.main bench --device cuda --backbone mobilefacenet --image-size 112 \
    --clients 64 --chunk-size 32 --images 57 --batch-size 10 --local-epochs 2 --amp bf16 --repeats 1 \
    --executors batched
fi
if [ "$part" = compiled ] || [ "$part" = all ]; then
  # eager and compiled side by side on one chunk (warm-up = compilation outside the timings, reported)
  step variants_compiled 200 python benchmarks/gpu_step_profile.py --device cuda --clients 48 --no-reference \
    --variants compile=off compile=on --repeats 3 --json "$out/variants_compiled.json"
  # the paper slice at default flags (compile=auto: compiled on CUDA) next to eager, scope=all
  step paper_slice_compiled 300 python benchmarks/gpu_paper_scale.py --slice 384 --eval-clients 16 \
    --methods fedfs:scope=all --compile off auto --json "$out/paper_slice_compiled.json"
fi
