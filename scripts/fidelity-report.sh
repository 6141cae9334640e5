#!/usr/bin/env bash
# Regenerates docs/fidelity.md and its plots: calibrates an OSCAR plan on one English text,
# evaluates every cache method on a different one (per-layer attention fidelity at 2K and 8K
# tokens, end-to-end perplexity and KL against the bf16 cache at 2K, 4K and 8K tokens),
# renders the plots and writes the document. One command:
#
#   scripts/fidelity-report.sh              # everything (~2 hours on 2 free cores)
#   scripts/fidelity-report.sh --doc-only   # re-render the doc and plots from docs/fidelity/results
#
# Texts (Debian's bible-kjv-text, read with the `bible` program of bible-kjv):
#   calibration  KJV Genesis + Exodus
#   evaluation   KJV Luke + John (other books, another author and style: held-out text)
# Needs: a build of oscar-decode (cmake --build build --target oscar-decode), the model
# (scripts/fetch-model.sh), python3-matplotlib. Environment knobs (defaults in brackets):
#   OSCAR_DECODE [build/examples/oscar-decode]  CALIB_TOKENS [8192]  LONG_CTX [8192]
#   E2E_LONG_CTX [4096 8192] (a list)  ATTENTION [blocked] (oscar-decode --attention)  THREADS [1]
# Every run is single-threaded and two run at a time, one per core.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
exe="${OSCAR_DECODE:-build/examples/oscar-decode}"
results=docs/fidelity/results
work=build/fidelity
calib_tokens="${CALIB_TOKENS:-8192}"
long_ctx="${LONG_CTX:-8192}"
e2e_long_ctx="${E2E_LONG_CTX:-4096 8192}"
attention="${ATTENTION:-blocked}"
threads="${THREADS:-1}"
geometry=(--sink 64 --recent 256 --page-size 16)

if [[ "${1:-}" != "--doc-only" ]]; then
  [[ -x "$exe" ]] || { echo "fidelity-report.sh: $exe is missing; build it: cmake --build build --target oscar-decode" >&2; exit 2; }
  mkdir -p "$results" "$work"
  scripts/kjv-text.sh "Genesis 1:1-50:26" "Exodus 1:1-40:38" > "$work/calibration.txt"
  scripts/kjv-text.sh "Luke 1:1-24:53" "John 1:1-21:25" > "$work/evaluation.txt"
  log() { echo "[fidelity-report $(date +%H:%M:%S)] $*" >&2; }
  log "calibrate on KJV Genesis+Exodus ($calib_tokens tokens)"
  "$exe" calibrate --text "$work/calibration.txt" --out "$work/plan.safetensors" --ctx 2048 \
    --calib-tokens "$calib_tokens" --held-out-tokens 1024 --sink 64 --recent 256 --threads 2 --no-progress \
    > "$results/calibrate.txt"
  # Two processes at a time, one per core.
  perplexity() {  # perplexity CTX CHUNK METHODS: oscar-decode's perplexity lines on stdout
    local plan=()  # oscar-decode refuses a plan that no method of the run uses
    [[ ",$3," == *,oscar,* || ",$3," == *,oscar-fit,* ]] && plan=(--plan "$work/plan.safetensors")
    "$exe" perplexity --text "$work/evaluation.txt" --ctx "$1" --cache "$3" "${plan[@]}" \
      "${geometry[@]}" --chunk "$2" --attention "$attention" --threads "$threads" --no-progress
  }
  log "per-layer fidelity at 2048 and $long_ctx tokens"
  "$exe" fidelity --text "$work/evaluation.txt" --ctx 2048 --plan "$work/plan.safetensors" "${geometry[@]}" \
    --threads "$threads" --no-progress > "$results/fidelity-2048.txt" &
  first=$!
  "$exe" fidelity --text "$work/evaluation.txt" --ctx "$long_ctx" --plan "$work/plan.safetensors" "${geometry[@]}" \
    --threads "$threads" --no-progress > "$results/fidelity-$long_ctx.txt"
  wait "$first"
  # End to end: 2048 tokens token by token (decode), the long contexts extending 16 tokens per
  # step (each chunk sits inside the BF16 window, so every token still reads all earlier ones
  # through its cache). Each context runs as two lockstep runs side by side, each with its own
  # bf16 reference for the KL; merge-e2e.sh checks that their bf16 lines agree.
  part_a=bf16,int4,int2-naive,kivi
  part_b=bf16,int2-hadamard,oscar,oscar-fit
  for ctx_chunk in 2048:1 $(for c in $e2e_long_ctx; do echo "$c:16"; done); do
    ctx=${ctx_chunk%:*} chunk=${ctx_chunk#*:}
    log "end to end at $ctx tokens, $chunk token(s) per step: $part_a | $part_b"
    perplexity "$ctx" "$chunk" "$part_a" > "$work/e2e-$ctx.a.txt" &
    first=$!
    perplexity "$ctx" "$chunk" "$part_b" > "$work/e2e-$ctx.b.txt"
    wait "$first"
    scripts/merge-e2e.sh "$work/e2e-$ctx.a.txt" "$work/e2e-$ctx.b.txt" > "$results/e2e-$ctx.txt"
  done
  cp "$work/plan.safetensors" "$results/../plan-kjv-genesis-exodus.safetensors"
fi
# Debian's python3 has python3-matplotlib; a python3 earlier on PATH (pyenv, venv) may not.
"${PYTHON:-/usr/bin/python3}" scripts/fidelity_report.py --results "$results" --out docs/fidelity.md --plots docs/fidelity
