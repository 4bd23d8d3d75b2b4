#!/usr/bin/env bash
# Builds a real kube-apiserver and an etcd it accepts from their upstream sources on the Go
# module proxy, once per machine, and prints the folder that holds both binaries. No
# prebuilt Kubernetes binary is on the package registries these machines reach, and Debian's
# etcd (3.4) is older than the API server supports.
#
# kube-apiserver: a scratch module requires k8s.io/kubernetes and pins each k8s.io staging
# module (which the upstream go.mod replaces with ./staging paths) to its published v0.x.y;
# built with -tags providerless (no cloud providers). etcd: a scratch module requires
# go.etcd.io/etcd/server/v3, whose own go.mod replaces its siblings with paths.
# A cold build takes several minutes on two cores; the result is cached under
# ${TANDEM_CACHE:-~/.cache/tandem}, outside the checkout.
#
#   dir="$(bash tests/kube/get-apiserver.sh)"; "$dir/kube-apiserver" --version
set -euo pipefail

K8S_VERSION="${K8S_VERSION:-1.37.2}"
ETCD_VERSION="${ETCD_VERSION:-3.6.16}"
CACHE="${TANDEM_CACHE:-$HOME/.cache/tandem}"
out="$CACHE/kube-v$K8S_VERSION-etcd-v$ETCD_VERSION"
if [ -x "$out/kube-apiserver" ] && [ -x "$out/etcd" ]; then
  echo "$out"
  exit 0
fi
command -v go >/dev/null || { echo "get-apiserver.sh: needs Go (1.26 or newer)" >&2; exit 1; }
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
export GOFLAGS="-mod=mod -buildvcs=false" CGO_ENABLED=0

# The staging modules k8s.io/kubernetes replaces with paths, from its own go.mod.
staging() {
  curl -fsS "${GOPROXY_URL:-https://proxy.golang.org}/k8s.io/kubernetes/@v/v$K8S_VERSION.mod" \
    | sed -n 's#^\s*\(k8s\.io/[a-z0-9-]*\) => \./staging/.*#\1#p'
}

build() {  # build <folder> <module path of the main package> <output> [ldflags]
  (cd "$1" && go build -trimpath -tags providerless -ldflags="-s ${4:-}" -o "$3" "$2") >&2
}
# What `--version` and /version say (Helm checks a chart's kubeVersion against it).
v=k8s.io/component-base/version
minor="${K8S_VERSION#1.}"
version_flags="-X $v.gitVersion=v$K8S_VERSION -X $v.gitMajor=1 -X $v.gitMinor=${minor%%.*}"

mkdir -p "$work/apiserver" "$work/etcd" "$out.tmp"
(
  cd "$work/apiserver"
  go mod init tandem.invalid/apiserver >/dev/null 2>&1
  for m in $(staging); do
    go mod edit -replace "$m=$m@v0.${K8S_VERSION#1.}"
  done
  go get "k8s.io/kubernetes/cmd/kube-apiserver@v$K8S_VERSION" >&2
)
build "$work/apiserver" k8s.io/kubernetes/cmd/kube-apiserver "$out.tmp/kube-apiserver" \
  "$version_flags"
(
  cd "$work/etcd"
  go mod init tandem.invalid/etcd >/dev/null 2>&1
  go get "go.etcd.io/etcd/server/v3@v$ETCD_VERSION" >&2
)
build "$work/etcd" go.etcd.io/etcd/server/v3 "$out.tmp/etcd"
rm -rf "$out"
mv "$out.tmp" "$out"
echo "$out"
