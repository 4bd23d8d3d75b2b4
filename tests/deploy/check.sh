#!/usr/bin/env bash
# Offline validation of the Kubernetes manifests in deploy/k8s (issue 9):
#  - `kubectl kustomize` renders the base, every overlay, and the base with each component;
#  - kubernetes-validate checks every rendered object strictly (unknown fields fail) against
#    the Kubernetes versions in K8S_VERSIONS (default 1.29.0,1.32.0,1.37.0);
#  - every --flag and env var the manifests pass to tandem-router / tandem-prefill /
#    tandem-decode exists in that binary's --help (binaries from ${BIN_DIR:-target/release}),
#    with a value it accepts (enum values, whole numbers), so the manifests cannot drift;
#  - the manifests agree with themselves: grace periods cover the drain and request timeout,
#    memory limits cover the caches, the model and key file are mounted, ports line up;
#  - a self-test breaks copies of the manifests and the chart on purpose (tests/deploy/selftest.py)
#    and expects each break to be caught, so a check that stopped working fails the run.
# Ends with `<n> passed, <m> failed`; exits non-zero on any failure.
#
#   bash tests/deploy/check.sh
#
# Needs: the release binaries; a Python with tests/deploy/requirements.txt (PYTHON, default
# .venv/bin/python); kubectl with kustomize (KUBECTL, else found or fetched by get-kubectl.sh).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."

PY="${PYTHON:-.venv/bin/python}"
if ! "$PY" -c 'import kubernetes_validate, yaml' 2>/dev/null; then
  echo "$PY lacks kubernetes-validate: $PY -m pip install -r tests/deploy/requirements.txt" >&2
  exit 1
fi
export BIN_DIR="${BIN_DIR:-target/release}"
KUBECTL="$(PYTHON="$PY" bash tests/deploy/get-kubectl.sh)"
HELM="$(PYTHON="$PY" bash tests/deploy/get-kubectl.sh helm)"
export KUBECTL HELM
echo "kubectl: $KUBECTL ($("$KUBECTL" version --client 2>/dev/null | tr '\n' ' '))"
echo "helm: $HELM ($("$HELM" version --short 2>/dev/null))"
echo "kubernetes-validate $("$PY" -c 'import kubernetes_validate.version as v; print(v.__version__)')"
exec "$PY" tests/deploy/manifests.py
