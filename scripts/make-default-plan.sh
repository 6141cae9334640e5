#!/usr/bin/env bash
# Fits the OSCAR plan shipped for the app's default model
# (examples/oscar-decode/plans/SmolLM2-135M-Instruct.Q4_1.plan.safetensors, which
# `oscar-decode generate` and `share` use when no --cache is given): KJV Genesis 1-10 (Debian's
# bible-kjv, scripts/kjv-text.sh), 6000 calibration tokens, the last 512 held out for the clip
# search, sink 64 / window 256 recorded. ~1 min on 2 cores; the same bytes on every run of one
# build (the plan in the tree was made by this script, with a build at the x86-64 baseline,
# -DOSCAR_HOST_FMA=OFF). A build with AVX2 + FMA (the default where the machine runs them)
# sums the model's products in another order, and its plan differs: rotations within
# near-degenerate eigenspaces, and a clip ratio by a grid step (measured 2026-12-07: one of 30
# layers' K ratios, 0.02); the generated text of `oscar-decode generate` is the same.
#   scripts/make-default-plan.sh [OUT]      (needs build/examples/oscar-decode, or OSCAR_DECODE=...)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=${1:-$here/../examples/oscar-decode/plans/SmolLM2-135M-Instruct.Q4_1.plan.safetensors}
decode=${OSCAR_DECODE:-$here/../build/examples/oscar-decode}
text=$(mktemp)
trap 'rm -f "$text"' EXIT
"$here/kjv-text.sh" "Genesis 1:1-10:32" > "$text"
"$decode" calibrate --text "$text" --calib-tokens 6000 --held-out-tokens 512 --out "$out" --threads 2 --no-progress
