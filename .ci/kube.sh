#!/usr/bin/env bash
# The real-cluster suite on a throwaway Kubernetes control plane: starts kube-apiserver,
# etcd and kube-controller-manager on loopback with UP_SH (default ../shared/kube/up.sh
# beside the checkout; see that directory's README), runs every real-cluster variant of
# tests/operators once with the token kubeconfig and once with the client-certificate
# kubeconfig (`make e2e-k8s`), and stops the control plane by the pids it recorded whatever
# the outcome. Used by .ci/run and `make test-kube`.
#
# Usage: .ci/kube.sh            (UP_SH=/path/to/up.sh, KUBE_PORT=..., ETCD_PORT=... to move it)
# Exit status: non-zero when the control plane does not start or any variant fails.
set -euo pipefail
cd "$(dirname "$0")/.."
UP_SH=${UP_SH:-../shared/kube/up.sh}
if [ ! -x "$UP_SH" ]; then
  echo "error: $UP_SH not found: cannot start a Kubernetes API server for the real-cluster" \
    "suite. To fix: set UP_SH to an up.sh, or run 'make e2e-k8s KUBECONFIG=...' against" \
    "your own cluster (docs/kubernetes.md)" >&2
  exit 2
fi
DOWN_SH=$(dirname "$UP_SH")/down.sh
DIR=$(mktemp -d "${TMPDIR:-/tmp}/mixfleet-kube.XXXXXX")

stop() {
  # down.sh stops etcd, kube-apiserver and kube-controller-manager by DIR/*.pid; kill any
  # that it left (a missing down.sh, say) by the same pids.
  [ -x "$DOWN_SH" ] && "$DOWN_SH" "$DIR" || true
  for f in "$DIR"/*.pid; do
    [ -f "$f" ] && kill -9 "$(cat "$f")" 2>/dev/null || true
  done
  rm -rf "$DIR"
}
trap stop EXIT
trap 'exit 130' INT TERM

if ! "$UP_SH" "$DIR"; then
  echo "error: the Kubernetes API server did not start; its logs:" >&2
  tail -n 20 "$DIR"/*.log >&2 || true
  exit 1
fi
status=0
for kubeconfig in kubeconfig kubeconfig-cert; do
  echo "== real-cluster suite with $kubeconfig"
  make --no-print-directory e2e-k8s KUBECONFIG="$DIR/$kubeconfig" || status=1
done
exit $status
