# mixfleet developer targets. Everything installs into a local .venv from pyproject.toml.
PY ?= python3.11
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install demo test lint typecheck layers pytest bench bench-placement bench-strategies bench-controlplane proto crds e2e-k8s clean

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PY) -m venv $(VENV) || python3 -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev]'
	# torch for the reference runtime's CPU tests (gloo); on this machine image pip takes the
	# 2.13.0 CPU wheel from the local wheel directory. NO_TORCH=1 skips it (those tests skip).
	@if [ -z "$$NO_TORCH" ]; then $(BIN)/python -m pip install -q 'torch==2.13.0' || echo "torch not installed: reference-runtime tests will skip"; fi
	@touch $(STAMP)

install: $(STAMP)

demo: install
	PYTHONPATH=examples $(BIN)/python -m demo

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: install
	$(BIN)/mypy

layers: install
	$(BIN)/lint-imports

pytest: install
	$(BIN)/pytest -q

test: install
	$(BIN)/ruff check .
	$(BIN)/mypy
	$(BIN)/lint-imports
	$(BIN)/python -m operators.crdgen --check
	$(BIN)/python proto/protogen.py --check
	$(BIN)/pytest -q

bench: install bench-placement bench-strategies bench-controlplane

bench-placement: install
	$(BIN)/python -m bench.placement --scenario all --out bench/results/placement.json --docs docs/benchmarks.md

bench-controlplane: install
	$(BIN)/python -m bench.controlplane --agents 100,500,2000 --out bench/results/controlplane.json --docs docs/controlplane-benchmark.md

bench-strategies: install
	$(BIN)/python -m bench.strategies --scenario all --out bench/results/strategies.json --docs docs/strategies.md

crds: install
	$(BIN)/python -m operators.crdgen

e2e-k8s: install
	MIXFLEET_E2E_KUBECONFIG=$(KUBECONFIG) $(BIN)/pytest -q tests/operators -k real

proto: install
	$(BIN)/python proto/protogen.py

clean:
	rm -rf $(VENV) build *.egg-info .mypy_cache .pytest_cache .ruff_cache
