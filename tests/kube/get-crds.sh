#!/usr/bin/env bash
# The upstream CustomResourceDefinitions of the custom kinds the manifests use (cert-manager,
# the Prometheus Operator, KEDA, Gateway API), taken from those projects' own modules on the Go
# module proxy, for the test API server (tests/tests/e2e/chart.rs): it then holds every custom
# resource the chart and kustomize render to the real schema, strictly. Prints the path of one
# YAML file that holds them, cached under ${TANDEM_CACHE:-~/.cache/tandem}, outside the
# checkout.
#
#   kubectl apply --server-side -f "$(bash tests/kube/get-crds.sh)"
set -euo pipefail

CERT_MANAGER="${CERT_MANAGER_VERSION:-v1.16.2}"
PROMETHEUS_OPERATOR="${PROMETHEUS_OPERATOR_VERSION:-v0.79.2}"
KEDA="${KEDA_VERSION:-v2.16.1}"
GATEWAY_API="${GATEWAY_API_VERSION:-v1.2.1}"
CACHE="${TANDEM_CACHE:-$HOME/.cache/tandem}"
out="$CACHE/crds-cert-manager-$CERT_MANAGER-prometheus-operator-$PROMETHEUS_OPERATOR-keda-$KEDA-gateway-api-$GATEWAY_API.yaml"
if [ -s "$out" ]; then
  echo "$out"
  exit 0
fi
command -v go >/dev/null || { echo "get-crds.sh: needs Go" >&2; exit 1; }
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
export GOFLAGS="-mod=mod"
(cd "$work" && go mod init crds >/dev/null 2>&1)

# The folder of a module version in the module cache, downloaded if need be.
module() {
  (cd "$work" && go mod download -json "$1") | sed -n 's/^\t"Dir": "\(.*\)",$/\1/p'
}
cm="$(module "github.com/cert-manager/cert-manager@$CERT_MANAGER")"
po="$(module "github.com/prometheus-operator/prometheus-operator@$PROMETHEUS_OPERATOR")"
keda="$(module "github.com/kedacore/keda/v2@$KEDA")"
gw="$(module "sigs.k8s.io/gateway-api@$GATEWAY_API")"

{
  # cert-manager keeps its CRDs as its Helm chart's templates: the metadata labels are
  # template expressions, which the API server would refuse as label values.
  for kind in certificates issuers; do
    echo "---"
    sed '/^  labels:$/,/^spec:$/{/^spec:$/!d}' "$cm/deploy/crds/crd-$kind.yaml"
  done
  for kind in podmonitors prometheusrules; do
    echo "---"
    cat "$po/example/prometheus-operator-crd/monitoring.coreos.com_$kind.yaml"
  done
  echo "---"
  cat "$keda/config/crd/bases/keda.sh_scaledobjects.yaml"
  echo "---"
  cat "$gw/config/crd/standard/gateway.networking.k8s.io_httproutes.yaml"
} >"$work/crds.yaml"
mkdir -p "$CACHE"
mv "$work/crds.yaml" "$out"
echo "$out"
