#!/usr/bin/env bash
# Makes the real-model data of the GPU tests (test_real_activations_gpu): post-RoPE q/k/v of
# SmolLM2-135M layers 0, 5, 15, 29 on KJV Matthew 1-5 (`oscar-decode dump`), and an OSCAR plan
# calibrated on a different text, KJV Genesis 1-10 (`oscar-decode calibrate`, ~6 min on 2
# cores). The GPU machine has no model, so make the data here and carry the folder there:
#   scripts/make-real-activations.sh [OUT_DIR]      (default build/real-activations, where
#                                                    ctest points the test)
set -euo pipefail
out=${1:-build/real-activations}
decode=${OSCAR_DECODE:-build/examples/oscar-decode}
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$out"
"$here/kjv-text.sh" "Genesis 1:1-10:32" > "$out/calibration.txt"
"$here/kjv-text.sh" "Matthew 1:1-5:48" > "$out/evaluation.txt"
"$decode" dump --text "$out/evaluation.txt" --ctx 1100 --layers 0,5,15,29 --out "$out/activations.safetensors" --no-progress
"$decode" calibrate --text "$out/calibration.txt" --calib-tokens 6000 --held-out-tokens 512 \
  --out "$out/plan.safetensors" --threads 2 --no-progress
echo "real activations in $out"
