#!/usr/bin/env bash
# Every GPU check and benchmark of the project in one go, for a machine with a CUDA device:
# the GPU tests, compute-sanitizer memcheck and racecheck on the write and attention tests,
# the write and attention benchmarks, PyTorch SDPA on the same shapes (where torch is
# installed), the decode report and plot, and ncu on the largest decode shape (where ncu is).
#
#   scripts/gpu-suite.sh BIN_DIR OUT_DIR [quick]
#
# BIN_DIR holds the executables of a build (test_functors_gpu, test_write_gpu,
# test_attention_gpu, test_real_activations_gpu, oscar-gpu-step, test_smollm2_gpu,
# bench_write_gpu, bench_attention_gpu), e.g. build/tests + build/bench + build/examples copied
# into one folder, or a build tree's root (the three subfolders are searched).
# OSCAR_REAL_ACTIVATIONS_DIR (or BIN_DIR/real-activations) points the real-activation test at
# its data (scripts/make-real-activations.sh); test_smollm2_gpu needs the SmolLM2 model
# (OSCAR_MODEL, or scripts/fetch-model.sh's ~/.cache/oscar) and fails here without it. The
# benchmarks link Debian's Google Benchmark dynamically: on a GPU machine without it, copy
# libbenchmark.so.1debian into BIN_DIR/lib (it is put on LD_LIBRARY_PATH). Every step's output goes to OUT_DIR/<step>.txt; the
# summary (each step's exit status and last lines) to stdout. "quick" skips the sanitizers and
# ncu. Exits non-zero when any test or sanitizer step failed (77, no device, counts as failed
# here: this script is for machines that have one).
set -uo pipefail
if [[ $# -lt 2 ]]; then
  sed -n '2,20p' "$0"
  exit 2
fi
bin_dir=$1
out=$2
quick=${3:-}
repo=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$out"

find_exe() {
  for d in "$bin_dir" "$bin_dir/tests" "$bin_dir/bench" "$bin_dir/examples"; do
    [[ -x $d/$1 ]] && { echo "$d/$1"; return 0; }
  done
  return 1
}

failed=0
# step NAME KIND COMMAND...: KIND "check" counts toward the exit status, "measure" does not.
step() {
  local name=$1 kind=$2
  shift 2
  local start=$SECONDS
  "$@" >"$out/$name.txt" 2>&1
  local rc=$?
  printf '== %s: rc=%d (%d s)\n' "$name" "$rc" $((SECONDS - start))
  tail -n "${TAIL:-2}" "$out/$name.txt" | sed 's/^/   /'
  if [[ $kind == check && $rc -ne 0 ]]; then failed=1; fi
}

nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader | tee "$out/device.txt" ||
  { echo "no CUDA device visible"; exit 1; }
[[ -d $bin_dir/lib ]] && export LD_LIBRARY_PATH=$bin_dir/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
for b in bench_write_gpu bench_attention_gpu; do
  if exe=$(find_exe $b) && missing=$(ldd "$exe" 2>/dev/null | grep 'not found'); then
    echo "== $b cannot start, a shared library is missing (copy it into $bin_dir/lib):"
    echo "$missing" | sed 's/^/   /'
  fi
done

real_dir=${OSCAR_REAL_ACTIVATIONS_DIR:-$bin_dir/real-activations}
for t in test_functors_gpu test_write_gpu test_attention_gpu; do
  if exe=$(find_exe $t); then
    step "$t" check "$exe"
  else
    echo "== $t: not in $bin_dir"
    failed=1
  fi
done
if exe=$(find_exe test_real_activations_gpu) && [[ -d $real_dir ]]; then
  OSCAR_REAL_ACTIVATIONS_DIR=$real_dir step test_real_activations_gpu check "$exe"
else
  echo "== test_real_activations_gpu: binary or data ($real_dir) missing"
  failed=1
fi
exe=$(find_exe oscar-gpu-step) && TAIL=1 step oscar_gpu_step check "$exe"
# The decode app's @gpu caches on SmolLM2; needs the model (OSCAR_MODEL or ~/.cache/oscar).
if exe=$(find_exe test_smollm2_gpu); then
  TAIL=3 step test_smollm2_gpu check "$exe"
else
  echo "== test_smollm2_gpu: not in $bin_dir"
fi

if [[ $quick != quick ]] && command -v compute-sanitizer >/dev/null; then
  # The cases that cover every kernel and launcher path without the sanitizers' hours on
  # the large shapes.
  exe=$(find_exe test_write_gpu) &&
    TAIL=3 step memcheck_write check compute-sanitizer --tool memcheck --error-exitcode 1 "$exe" \
      -tc='*bit-exact*,*bad arguments*,*graph*'
  exe=$(find_exe test_write_gpu) &&
    TAIL=3 step racecheck_write check compute-sanitizer --tool racecheck --error-exitcode 1 "$exe" \
      -tc='*single layer*,*graph*'
  exe=$(find_exe test_attention_gpu) &&
    TAIL=3 step memcheck_attention check compute-sanitizer --tool memcheck --error-exitcode 1 "$exe"
  exe=$(find_exe test_attention_gpu) &&
    TAIL=3 step racecheck_attention check compute-sanitizer --tool racecheck --error-exitcode 1 "$exe" \
      -tc='*forked*,*NaN*,*extend*'
fi

exe=$(find_exe bench_write_gpu) && TAIL=0 step bench_write measure "$exe" --benchmark_min_time=0.1
grep -E '^BM_' "$out/bench_write.txt" 2>/dev/null | awk '{printf "   %-55s %8s %s\n", $1, $2, $3}'
exe=$(find_exe bench_attention_gpu) && TAIL=0 step bench_attention measure "$exe" --benchmark_min_time=0.05
if python3 -c 'import torch' 2>/dev/null; then
  TAIL=0 step sdpa measure python3 "$repo/bench/sdpa_baseline.py"
  TAIL=40 step report measure python3 "$repo/bench/attention_report.py" "$out/bench_attention.txt" "$out/sdpa.txt" \
    "$out/attention_decode.png"
else
  echo "== sdpa: torch not installed, skipped"
fi

if [[ $quick != quick ]] && command -v ncu >/dev/null && exe=$(find_exe bench_attention_gpu); then
  TAIL=0 step ncu_decode measure ncu --clock-control none -k regex:paged_attention_kernel --launch-skip 3 \
    --launch-count 1 --section SpeedOfLight --section Occupancy \
    --metrics smsp__inst_executed.sum,dram__bytes_read.sum,smsp__average_warp_latency_per_inst_issued.ratio \
    "$exe" --benchmark_filter='^int2/hq32_hkv8_d128/B64/L8192/page16/' --benchmark_min_time=0.01
  grep -E 'Duration|inst_executed|dram__bytes_read|Achieved Occupancy|warp_latency' "$out/ncu_decode.txt" |
    sed 's/^ */   /'
fi

echo "== checks: $([[ $failed -eq 0 ]] && echo passed || echo FAILED)"
exit $failed
