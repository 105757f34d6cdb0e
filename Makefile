# Fleetpilot — `make run` and `make test` are all a fresh clone needs.
# Set-up installs into .venv with pip and is idempotent: it reruns only when pyproject.toml changes.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# The CPU wheel of torch (a plain `torch` would pull several GB of CUDA).
TORCH  := torch==2.13.0

.DEFAULT_GOAL := help
.PHONY: help setup run test bench bench-fleet-sweep contracts lint clean

help: ## List the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-18s %s\n", $$1, $$2}'

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip setuptools wheel
	$(BIN)/python -m pip install --quiet $(TORCH)
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

setup: $(STAMP) ## Create .venv and install Fleetpilot (only when needed)

# A demo judges about 150 placements: the learner learns from every 30 new ones once 60 are
# judged (200 and 50 on a real fleet), so the run shows its models and the policy using them.
run: $(STAMP) ## Whole fleet on an embedded NATS: services, simulated fleet, demo workload, closing report
	FLEETPILOT_LEARNER_MIN_EXAMPLES=60 FLEETPILOT_LEARNER_RETRAIN_EVERY=30 FLEETPILOT_LEARNER_CHECK_INTERVAL_S=2 \
	$(BIN)/fleetpilot up --demo $${DEMO_TASKS:-150} --rate 10 --duration $${DURATION:-45} --fingerprinter-partitions 2

# Most tests wait on real processes and sockets rather than the CPU, so one worker per core
# (at most 4) halves the suite on two cores; every test has its own nats-server, port,
# folder and PostgreSQL schema. `pytest` alone runs them one at a time. Four workers on two
# cores took 376 s against 614 s, but two of five such runs failed on a race the load
# exposed (both fixed: e5ca3e5, d4587f8); CI keeps the steadier pace.
test: $(STAMP) ## Every test (unit, service over real nats-server, end to end, PostgreSQL)
	$(BIN)/python -m pytest -q -n auto --maxprocesses 4 --dist worksteal

bench: $(STAMP) ## Benchmarks with their figures (ratios against baselines measured in the same run)
	$(BIN)/python -m fleetpilot.bench.sim_tick
	$(BIN)/python -m fleetpilot.bench.executor_telemetry
	$(BIN)/python -m fleetpilot.bench.dispatch
	$(BIN)/python -m fleetpilot.bench.fleet_view
	$(BIN)/python -m fleetpilot.bench.policy_latency
	$(BIN)/python -m fleetpilot.bench.fingerprint_eval
	$(BIN)/python -m fleetpilot.bench.learner_eval
	$(BIN)/python -m fleetpilot.maintenance.eval
	mkdir -p out
	$(BIN)/python -m fleetpilot.bench.fleet --fleet three-site --seed 7 --json out/fleet-three-site.json --plot-dir out/
	$(BIN)/python -m fleetpilot.bench.fleet --fleet three-site --seed 7 --baseline kai-share --json out/fleet-three-site-kai-share.json
	$(BIN)/python -m fleetpilot.bench.fleet --fleet openb --seed 7 --json out/fleet-openb.json --plot-dir out/
	$(BIN)/python -m fleetpilot.bench.openb --seeds 42-51 --jobs 2 --plot out/openb.png --json out/openb.json

bench-fleet-sweep: $(STAMP) ## The fleet benchmark on the README table's 46 workloads, summed up (10 to 25 minutes on 2 cores, by the machine)
	$(BIN)/python -m fleetpilot.bench.fleet_sweep --out out/fleet-sweep --jobs 2 --markdown

contracts: $(STAMP) ## Regenerate proto/ (JSON Schema + AsyncAPI) from the code
	$(BIN)/python -m fleetpilot.contracts.schema --write

lint: $(STAMP) ## ruff
	$(BIN)/ruff check libs services tests conftest.py

clean: ## Remove local state (not the venv)
	rm -rf .fleetpilot out .pytest_cache
