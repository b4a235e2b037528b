#!/usr/bin/env bash
# The declared minimum versions work: a second venv gets exactly the `>=` floors of
# pyproject.toml (pip constraints from .ci/min_versions.py), then every module of the console
# scripts' packages is imported, the three console scripts answer --help, and a few fast
# suites run (wire codecs, gRPC services, stores, plan files and pictures, the agent, leader
# election and the Kubernetes API layer). About two minutes on two cores.
# `make test-min-versions` runs it; .ci/run runs it after make test.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PY:-python3.11}"
VENV="${MIN_VENV:-build/min-versions-venv}"
rm -rf "$VENV"
"$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip > "$VENV/pip.log" 2>&1 || { cat "$VENV/pip.log"; exit 1; }
"$VENV/bin/python" .ci/min_versions.py constraints dev > "$VENV/constraints.txt"
echo "lowest allowed versions:"; sed 's/^/  /' "$VENV/constraints.txt"
# pip's output goes to a log, shown when the install fails.
if ! "$VENV/bin/python" -m pip install -q -c "$VENV/constraints.txt" -e . pytest pytest-timeout \
    hypothesis >> "$VENV/pip.log" 2>&1; then
  cat "$VENV/pip.log"; echo "the declared floors do not install (constraints above)"; exit 1
fi
# pip must have installed every floor exactly (a floor pip cannot install fails above).
"$VENV/bin/python" -m pip freeze > "$VENV/freeze.txt"
"$VENV/bin/python" .ci/min_versions.py check "$VENV/constraints.txt" "$VENV/freeze.txt"
"$VENV/bin/python" .ci/min_versions.py imports
for cmd in mixfleetctl mixfleet-agent mixfleet-operator mixfleet-router; do
  "$VENV/bin/$cmd" --help > /dev/null
done
"$VENV/bin/python" -m pytest -q -x -p no:cacheprovider \
  tests/apis tests/controlplane/test_server_errors.py tests/controlplane/test_store.py \
  tests/controlplane/test_controlplane_files.py tests/controlplane/test_plan_render.py \
  tests/agents/test_agent.py tests/operators/test_leader_election.py \
  tests/operators/test_k8s_api_semantics.py
