#!/usr/bin/env bash
# Runs the example trainer's engine comparisons (sync and DPU, both flag mechanisms: the CUDA
# engine on the double against the host engine, bitwise) and, unless SKIP_TEST_CUDA=1,
# test_cuda's [pipeline] cases, once per seed of the double's random delays. Any race,
# rule break, fault or difference fails that seed; the seed reproduces it.
#   bash tests/cuda_double/seeded_runs.sh BUILD_DIR FIRST_SEED LAST_SEED
set -uo pipefail
build=$1 first=$2 last=$3
trainer=$build/examples/offload_trainer test_cuda=$build/tests/test_cuda
here=$(cd "$(dirname "$0")/../.." && pwd)
runs=0 failed=0
for seed in $(seq "$first" "$last"); do
  export HOSTOPT_CUDA_DOUBLE_SEED=$seed
  for args in "sync;60;2" "dpu;60;3"; do
    for flags in "" host_function; do
      runs=$((runs + 1))
      if ! out=$(cmake -DTRAINER="$trainer" "-DARGS=$args" -DFLAG_WAIT=$flags -P "$here/examples/same_as_host_engine.cmake" 2>&1); then
        failed=$((failed + 1))
        echo "seed $seed: trainer $args ${flags:-stream memory operations}: FAILED"
        echo "$out" | grep -E "VIOLATION|differs|failed" | head -5
      fi
    done
  done
  if [ "${SKIP_TEST_CUDA:-0}" != 1 ]; then
    runs=$((runs + 1))
    if ! out=$("$test_cuda" "[pipeline]" 2>&1); then
      failed=$((failed + 1))
      echo "seed $seed: test_cuda [pipeline]: FAILED"
      echo "$out" | grep -E "VIOLATION|FAILED" | head -5
    fi
  fi
done
echo "seeds $first..$last: $runs runs, $failed failed"
[ "$failed" = 0 ]
