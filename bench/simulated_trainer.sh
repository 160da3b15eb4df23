#!/usr/bin/env bash
# The product's promise, simulated: the example trainer (examples/offload_trainer.cpp) with
# the CUDA engine on the test-only CUDA runtime double (tests/cuda_double), whose copies take
# a modelled link's time (one copy per direction at a time, as a GPU's copy engines) and
# whose forward/backward takes a modelled device's time, while the CPU update is real: this
# machine's cores, hostopt's kernels. For a few links and batch sizes, synchronous vs
# delayed parameter update (DPU), it prints the step time, the share of it the device
# spent computing, and the CPU update's time. Not a GPU measurement: `.ci/gpu` is that.
#
#   bash bench/simulated_trainer.sh [device_tflops=400] [parameters=16777216] [steps=10]
#
# The device's work per micro-batch is 6 x parameters x tokens flops (forward + backward)
# at `device_tflops` achieved (400: an H100 at ~40% of its dense bf16 peak). Both the
# device's work and the CPU's scale with the parameter count, so the answer is per
# parameter: how many tokens per step hide this machine's CPU update on that device.
set -euo pipefail
tflops=${1:-400} params=${2:-16777216} steps=${3:-10}
here=$(cd "$(dirname "$0")/.." && pwd)
cmake --preset simulated -S "$here" >/dev/null
cmake --build "$here/build/simulated" --target offload_trainer >/dev/null
trainer=$here/build/simulated/examples/offload_trainer
micro=2
echo "simulated trainer: $params parameters (f32 gradients in, bf16 parameters out), $micro micro-batches per step,"
echo "device at $tflops TFLOPS achieved, CPU update on this machine: $(nproc) cores," \
  "$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ *//')"
echo
echo "| link | tokens per micro-batch | device ms per micro-batch | mode | step ms | device computing | CPU update ms |"
echo "|---|---|---|---|---|---|---|"
for link in "PCIe 4 x16 (25 GB/s);25" "PCIe 5 x16 (50 GB/s);50" "NVLink-C2C (450 GB/s);450"; do
  name=${link%;*} gbps=${link#*;}
  for tokens in 8192 32768 131072; do
    us=$(awk -v p="$params" -v t="$tokens" -v r="$tflops" 'BEGIN { printf "%d", 6 * p * t / (r * 1e12) * 1e6 }')
    for mode in sync dpu; do
      line=$(HOSTOPT_CUDA_DOUBLE_MAX_DELAY_US=0 HOSTOPT_CUDA_DOUBLE_MODEL="link_gbps=$gbps,move_data=0" \
        "$trainer" "$mode" "$steps" "$micro" "$params" "$us" | grep '^timing')
      step=$(sed -E 's/.*step ([0-9.]+) ms.*/\1/' <<<"$line")
      busy=$(sed -E 's/.*device computing ([0-9.]+%).*/\1/' <<<"$line")
      update=$(sed -E 's/.*CPU update ([0-9.]+) ms.*/\1/' <<<"$line")
      printf "| %s | %d | %.1f | %s | %.1f | %s | %.1f |\n" "$name" "$tokens" "$(awk -v u="$us" 'BEGIN{print u/1000}')" \
        "$mode" "$step" "$busy" "$update"
    done
  done
done
