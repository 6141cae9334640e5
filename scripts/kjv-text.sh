#!/usr/bin/env bash
# Prints books of the King James Bible as plain English prose, from Debian's bible-kjv-text
# (read through the `bible` program of bible-kjv): chapter headings and verse numbers are
# dropped, the verses of a chapter form one paragraph.
#   scripts/kjv-text.sh "Genesis 1:1-50:26" "Exodus 1:1-40:38" > genesis-exodus.txt
set -euo pipefail
if ! command -v bible >/dev/null 2>&1; then
  echo "kjv-text.sh: the 'bible' program is missing (scripts/install-deps.sh installs bible-kjv)" >&2
  exit 2
fi
for spec in "$@"; do
  bible -l100000 "$spec"
done | awk '
  /^[[:space:]]*$/ { next }
  /^[^ ].* [0-9]+$/ { if (para != "") print para "\n"; para = ""; next }   # "Genesis 1"
  { sub(/^[[:space:]]*[0-9]+[[:space:]]+/, ""); para = (para == "" ? $0 : para " " $0) }
  END { if (para != "") print para }'
