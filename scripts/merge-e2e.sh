#!/usr/bin/env bash
# Merges two oscar-decode perplexity outputs over the same tokens, each with its own bf16
# cache, into one result file: the first as it is, then a note and the second's other caches.
# Fails unless both bf16 lines agree to every printed digit (same tokens, same reference).
#
#   scripts/merge-e2e.sh FIRST SECOND > e2e-CTX.txt
set -euo pipefail
[[ $# -eq 2 ]] || { echo "usage: scripts/merge-e2e.sh FIRST SECOND" >&2; exit 2; }
first=$1 second=$2
bf16_first=$(grep '^cache=bf16 ' "$first" || true)
bf16_second=$(grep '^cache=bf16 ' "$second" || true)
if [[ -z "$bf16_first" || "$bf16_first" != "$bf16_second" ]]; then
  echo "merge-e2e: the bf16 lines differ (or one is missing):" >&2
  echo "  $first: ${bf16_first:-none}" >&2
  echo "  $second: ${bf16_second:-none}" >&2
  exit 1
fi
others=$(grep '^cache=' "$second" | grep -v '^cache=bf16 ' | sed 's/^cache=\([^ ]*\).*/\1/' | paste -sd, | sed 's/,/, /g')
cat "$first"
echo "# $others: a second lockstep run over the same tokens, side by side with the first, with its own bf16 reference, whose bf16 line matched the first run's to all printed digits (its header: $(head -1 "$second"))"
grep '^cache=' "$second" | grep -v '^cache=bf16 '
