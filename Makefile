# mixfleet developer targets. Everything installs into a local .venv from pyproject.toml.
PY ?= python3.11
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TORCH_STAMP := $(VENV)/.torch-installed

.PHONY: install install-torch test-min-versions demo static-checks test test-slow test-all lint typecheck layers pytest bench bench-placement bench-strategies bench-controlplane bench-determinism bench-engines bench-hostile bench-schedule bench-goodput bench-router bench-router-peers bench-router-traffic bench-serving bench-instances-watch proto crds e2e-k8s test-kube clean

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PY) -m venv $(VENV) || python3 -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev]'
	@touch $(STAMP)

# torch is opt-in: only the reference runtime (agents/runtime) and its CPU tests (gloo) use it.
# `make install-torch` (or `make install WITH_TORCH=1`) adds it; `make test` does, so the
# README's test command runs those tests too. On this machine image pip takes the 2.13.0 CPU
# wheel from the local wheel directory. NO_TORCH=1 skips it (those tests then skip).
$(TORCH_STAMP): $(STAMP)
	@if [ -n "$$NO_TORCH" ]; then echo "NO_TORCH set: torch not installed, reference-runtime tests will skip"; \
	elif $(BIN)/python -m pip install -q 'torch==2.13.0'; then touch $(TORCH_STAMP); \
	else echo "torch not installed: reference-runtime tests will skip"; fi

install: $(STAMP) $(if $(WITH_TORCH),$(TORCH_STAMP))

install-torch: $(TORCH_STAMP)

# The declared minimum versions of every dependency (pyproject `>=` floors) in a second venv.
test-min-versions:
	bash .ci/min_versions.sh

demo: install
	PYTHONPATH=examples $(BIN)/python -m demo

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: install
	$(BIN)/mypy

layers: install
	$(BIN)/lint-imports

pytest: install-torch
	$(BIN)/pytest -q

# The static checks, then the suite without the tests marked `slow` (end-to-end runs of
# several processes, minutes on 2 cores): <= 15 min on an idle 2-core machine, the 15
# slowest tests listed at the end. `make test-slow` runs the `slow` ones alone and
# `make test-all` both; CI runs `make test` then `make test-slow` (.ci/run).
# No test asserts a wall-clock time; solves in tests stop on work limits alone (conftest.py).
static-checks: install-torch
	$(BIN)/ruff check .
	$(BIN)/mypy
	$(BIN)/lint-imports
	$(BIN)/python -m operators.crdgen --check
	$(BIN)/python proto/protogen.py --check

test: static-checks
	$(BIN)/pytest -q -m "not slow" --durations=15

test-slow: install-torch
	$(BIN)/pytest -q -m slow --durations=15

test-all: test test-slow

# The engines' own code against mixfleet's exports and replica-choice models: downloads the
# pinned SGLang and vLLM wheels (pip download --no-deps) and the light packages their modules
# import into .conformance/ (a cache, ignored by git; nothing goes into the venv), then runs the
# suite on the CPU. Without the cache those tests skip, so `make test` stays fast.
conformance: install
	$(BIN)/python tests/conformance/prepare.py
	$(BIN)/pytest -q -m conformance tests/conformance

bench: install bench-placement bench-engines bench-strategies bench-controlplane bench-determinism

bench-placement: install
	$(BIN)/python -m bench.placement --scenario all --out bench/results/placement.json --docs docs/benchmarks.md

bench-engines: install
	$(BIN)/python -m bench.engines --scenario all --out bench/results/engines.json --docs docs/engines-benchmark.md

bench-determinism: install
	$(BIN)/python -m bench.determinism --scenario mixed-24-decode --form engine --out bench/results/determinism.json

# Hostile files through every reader and generated requests to every RPC (docs/security.md).
bench-hostile: install
	$(BIN)/python -m bench.hostile --out bench/results/hostile.json

bench-controlplane: install
	$(BIN)/python -m bench.controlplane --agents 100,500,2000 --out bench/results/controlplane.json --docs docs/controlplane-benchmark.md

# The request router: added latency at 100/500/2,000 streams, short requests/s, share error,
# and the mixed-24 plan's step time with the achieved shares (docs/router.md).
bench-router: install
	$(BIN)/python -m bench.router --out bench/results/router.json

# mixfleet-router side by side with sglang-router and vllm-router (installed from PyPI into
# bench/.peers-venv when missing) in one run; and 8 concurrent 30 MiB bodies (docs/router.md).
bench-router-peers: install
	$(BIN)/python -m bench.router --peers --streams 100,500 --rounds 5 --seconds 8 --short-s 3 --out bench/results/router-peers.json
	$(BIN)/python -m bench.router_memory --out bench/results/router-memory.json

# The router's CPU per streamed request with static instances, with weights from the
# controller, and with instances from the controller (--deployment) (docs/router.md).
bench-router-traffic: install
	$(BIN)/python -m bench.router_traffic --rounds 7 --out bench/results/router-traffic.json

bench-strategies: install
	$(BIN)/python -m bench.strategies --scenario all --out bench/results/strategies.json --docs docs/strategies.md

bench-schedule: install
	$(BIN)/python -m bench.schedule --scenario all --out bench/results/schedule.json

bench-goodput: install
	$(BIN)/python -m bench.goodput --scenario all --timing --out bench/results/goodput.json
	$(BIN)/python -m bench.goodput_headroom --scenario all --out bench/results/goodput_headroom.json
	$(BIN)/python -m bench.goodput_headroom --scenario all --burst-cv 2 --out bench/results/goodput_headroom_bursty.json
	$(BIN)/python -m bench.goodput --scenario all --no-queueing --out bench/results/goodput_flat.json

# The serving simulator's CPU time per 10,000 and 100,000 requests (docs/serving.md).
bench-serving: install
	$(BIN)/python -m bench.serving_sim --scenario all --out bench/results/serving-sim.json

# The controller's side of WatchInstances (fan-out to 100 streams) and ReportTraffic (CPU
# per report) (docs/api.md).
bench-instances-watch: install
	$(BIN)/python -m bench.instances_watch --out bench/results/instances-watch.json

crds: install
	$(BIN)/python -m operators.crdgen

# The real-cluster variants of tests/operators against the cluster of KUBECONFIG (or
# MIXFLEET_E2E_KUBECONFIG): kind, k3s, a cloud cluster (docs/kubernetes.md). Fails when none
# is given. test-kube starts a throwaway API server from ../shared/kube/up.sh (UP_SH=...) and
# runs them with its token and its client-certificate kubeconfig, as CI does (.ci/kube.sh).
e2e-k8s: install
	@kc="$${MIXFLEET_E2E_KUBECONFIG:-$(KUBECONFIG)}"; \
	if [ -z "$$kc" ]; then \
	  echo "error: e2e-k8s needs a cluster: run 'make e2e-k8s KUBECONFIG=/path/to/kubeconfig'" \
	    "(docs/kubernetes.md), or 'make test-kube' to start a throwaway API server" >&2; exit 2; fi; \
	if [ ! -f "$$kc" ]; then echo "error: kubeconfig $$kc: no such file" >&2; exit 2; fi; \
	echo "real-cluster suite against $$kc"; \
	MIXFLEET_E2E_KUBECONFIG="$$kc" $(BIN)/pytest -q tests/operators -k real

test-kube: install
	bash .ci/kube.sh

proto: install
	$(BIN)/python proto/protogen.py

clean:
	rm -rf $(VENV) build *.egg-info .mypy_cache .pytest_cache .ruff_cache
