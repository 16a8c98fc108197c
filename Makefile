# The two commands a new machine needs:  make demo (light: the runtime and the dashboard)   and   make test
# (everything: the dev tools, Spark, Playwright and the system packages)      make help lists every target
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
#: the demo's own, lighter stamp: the runtime and the dashboard only (no dev tools, Spark, Playwright)
DEMO_STAMP := $(VENV)/.installed-demo
#: what the demo installs: the runtime's dependencies and the dashboard's (pyproject.toml's extras)
DEMO_EXTRAS := web
#: the peers' own virtualenv for bench-e2e's comparison (PgQueuer, Procrastinate; git-ignored)
PEERS_VENV ?= .venv-peers
PEERS_STAMP := $(PEERS_VENV)/.installed
#: pytest workers for `make test`: the suite is CPU-bound on 2 cores once its waits overlap (543 s of CPU in all,
#: its workers ending within 11 s of each other, measured); 3 workers were the fastest of 2, 3 and 4 (the
#: suite's time: README.md, "Contributing"); TEST_WORKERS=0: one process
TEST_WORKERS ?= 3
#: extra options for `make demo` (make demo ARGS="--duration 60") or a bench-* target (make bench-e2e ARGS="--quick --no-peers")
ARGS ?=
PYTEST := $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadscope --durations=10

.PHONY: help setup system demo test test-fast test-reshard-faults lint faults bench-peers-setup bench-enqueue bench-e2e bench-scheduled bench-fire bench-schedules bench-held-snapshot bench-churn bench-fairness bench-priority bench-archive bench-spark test-spark-cluster bench-adopt bench-maintenance bench-ratelimit bench-reshard bench-web bench-trigger-cost bench-cli bench-first-run clean-local schema conformance bench-ts-receiver

help: ## list the targets
	@awk 'BEGIN {FS = ":[^#]*## "} /^[a-z][a-z0-9-]*:.*## / {printf "  make %-22s %s\n", $$1, $$2}' $(MAKEFILE_LIST)

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e ".[dev,web,otel]"
	touch $(STAMP) $(DEMO_STAMP)

# the demo's: a virtualenv with what the demo runs, and nothing else; no pip upgrade (not needed) and no
# byte-compiling of every installed file (a fifth of the install's CPU; Python compiles what it imports)
$(DEMO_STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --no-compile -e ".[$(DEMO_EXTRAS)]"
	touch $(DEMO_STAMP)

#: the TypeScript receiver: its npm packages (package-lock.json) and its build (tsc)
TS := clients/typescript
TS_STAMP := $(TS)/dist/.built

$(TS_STAMP): $(TS)/package.json $(TS)/package-lock.json $(TS)/tsconfig.json $(wildcard $(TS)/src/*.ts $(TS)/test/*.ts)
	@if command -v npm >/dev/null 2>&1; then \
		cd $(TS) && npm ci --no-audit --no-fund --silent && npm run --silent build && touch dist/.built; \
	else echo "setup: npm is missing: the TypeScript receiver is not built (its tests are skipped)" >&2; fi

setup: system $(STAMP) $(TS_STAMP) ## install everything: the system packages the tests need when missing, the virtualenv, the TypeScript receiver

system: ## Java 17 and the PostgreSQL JDBC jar when missing (as root; otherwise says what to run)
	@scripts/system-packages.sh

demo: $(DEMO_STAMP) ## the whole system live on 2 local shards until Ctrl-C (installs the runtime and the dashboard only; ARGS="--duration 60", data in .qm-local)
	$(BIN)/qm demo --dir .qm-local $(ARGS)

test: setup ## the whole suite: unit, integration (real PostgreSQL), Spark (a local session, and a standalone cluster of three JVMs); ends with the 10 slowest tests
	$(PYTEST)

test-fast: setup ## the suite without the Spark tests (local and cluster)
	$(PYTEST) -m "not spark"

test-spark-cluster: setup ## the Spark standalone-cluster tests in rounds: executors and whole workers SIGKILLed mid-stage and mid-publish, loader (plain, --atomic) and archive; ROUNDS=2 (13 tests a round: 27 min at load 13-28 on 2 cores)
	QM_SPARK_CLUSTER_ROUNDS=$(or $(ROUNDS),2) QM_SPARK_CLUSTER_FULL=1 QM_SPARK_CLUSTER_TARGETS=executor,worker \
		$(BIN)/python -m pytest -q -n 0 -p no:cacheprovider --timeout 3600 tests/spark_cluster --durations=0

test-reshard-faults: setup ## the reshard process SIGKILLed after each recorded step, then rerun; the targets' server restarted and a manager SIGKILLed mid-copy and mid-switch (in make test too; about 25 s)
	$(BIN)/python -m pytest -q -n 0 tests/integration/test_reshard_faults.py

schema: $(STAMP) ## regenerate docs/protocol.schema.json from the typed frames (queue_manager/wire/frames.py)
	$(BIN)/python -m queue_manager.wire.schema

lint: $(STAMP) ## ruff, mypy --strict and the import contracts (pyproject.toml)
	$(BIN)/ruff check queue_manager receivers spark_jobs tests benchmarks faults conformance
	$(BIN)/mypy
	$(BIN)/lint-imports

conformance: setup ## the qm.v1 conformance suite against the Python and the TypeScript receivers: a JSON line per (client, case) (docs/conformance.md; in make test too)
	$(BIN)/python -m conformance $(ARGS)

faults: $(STAMP) ## the fault suite: nemesis rounds on 2 shards x 2 managers, a checker over the history; ARGS="--rounds 10", "--minutes 30", "--scenario NAME" (JSON lines on stdout, docs/faults.md)
	$(BIN)/python -m faults $(ARGS)

bench-enqueue: $(STAMP) ## enqueue throughput vs a plain table (JSON on stdout)
	$(BIN)/python -m benchmarks.enqueue $(ARGS)

$(PEERS_STAMP): benchmarks/peers/requirements.txt
	$(PY) -m venv $(PEERS_VENV)
	$(PEERS_VENV)/bin/pip install -q --upgrade pip
	$(PEERS_VENV)/bin/pip install -q -r benchmarks/peers/requirements.txt
	touch $(PEERS_STAMP)

bench-peers-setup: $(PEERS_STAMP) ## the peers' virtualenv .venv-peers (pinned PgQueuer and Procrastinate from PyPI) for bench-e2e

bench-trigger-cost: $(STAMP) ## the enqueue triggers' server time per row vs a plain table, and vs OTHER=<checkout> when given (JSON on stdout)
	$(BIN)/python -m benchmarks.trigger_cost $(if $(OTHER),--other $(OTHER)) $(ARGS)

bench-e2e: $(STAMP) $(PEERS_STAMP) ## one shard end to end: drain, latency, fire accuracy, vs PgQueuer/Procrastinate; ARGS=--tracing adds the drain with OpenTelemetry off and on (JSON on stdout)
	PEERS_PYTHON=$(PEERS_VENV)/bin/python $(BIN)/python -m benchmarks.e2e $(ARGS)

bench-scheduled: $(STAMP) ## 2M events scheduled over the next hour, fired at 1000/s and 4000/s: lateness, memory, cache reads; ARGS="--events 10000000" (JSON on stdout)
	$(BIN)/python -m benchmarks.scheduled $(ARGS)

bench-fire: $(STAMP) ## scheduled fires in rounds (300 events 0.5-5 s ahead, a standby, maintenance slices due): lateness p50/p99/max and over 20 ms per round; OTHER=<checkout> alternated (JSON on stdout)
	$(BIN)/python -m benchmarks.fire_rounds $(if $(OTHER),--other $(OTHER)) $(ARGS)

bench-schedules: $(STAMP) ## 10 000 schedules every second on two shards: slot lateness p50/p99/max, early, missing, the managers' and the server's CPU per slot; ARGS="--schedules 2000 --seconds 10" (JSON on stdout)
	$(BIN)/python -m benchmarks.schedules $(ARGS)

bench-held-snapshot: $(STAMP) ## dispatch while a long transaction holds back vacuum, 500/s and 2000/s, ~10 min (JSON on stdout)
	$(BIN)/python -m benchmarks.held_snapshot $(ARGS)

bench-churn: $(STAMP) ## 10 min of churn with retention on, clean and with a snapshot held 2 min, ~25 min (JSON on stdout)
	$(BIN)/python -m benchmarks.churn $(ARGS)

bench-fairness: $(STAMP) ## a quiet tenant's pickup delay alone and beside a 100k-event noisy tenant, ~8 min (JSON on stdout)
	$(BIN)/python -m benchmarks.fairness $(ARGS)

bench-priority: $(STAMP) ## a priority-1 stream alone and beside a 100k backlog of priority 3, a priority-5 event's wait vs the aging bound, the drain vs OTHER=<checkout> without priorities, ~10 min (JSON on stdout)
	$(BIN)/python -m benchmarks.priority $(if $(OTHER),--other $(OTHER)) $(ARGS)

bench-spark: setup ## Spark bulk enqueue of 1M events into two shards vs Spark's JDBC writer and COPY (JSON on stdout)
	$(BIN)/python -m benchmarks.spark_load $(ARGS)

bench-maintenance: $(STAMP) ## what a maintenance slice costs, and the acks beside reconciliation slices (JSON on stdout)
	$(BIN)/python -m benchmarks.maintenance $(ARGS)

bench-archive: setup ## archive 200k settled events of two shards to Parquet and delete them (JSON on stdout)
	$(BIN)/python -m benchmarks.archive $(ARGS)

bench-adopt: $(STAMP) ## qm queue adopt: 100k legacy rows into two shards, by slice size (JSON on stdout)
	$(BIN)/python -m benchmarks.adopt $(ARGS)

bench-reshard: $(STAMP) ## 2 shards split to 4, 6 cut-overs back and forth, merged to 2, under 500 ev/s, 100k backlog, ~6 min; ARGS="--rate 300 --cutover-rounds 20", "--only-copy" (JSON on stdout)
	$(BIN)/python -m benchmarks.reshard $(ARGS)

bench-ratelimit: $(STAMP) ## max_qps 200 across two shards: both managers, one killed, restarted, ~2 min (JSON on stdout)
	$(BIN)/python -m benchmarks.ratelimit $(ARGS)

bench-ts-receiver: setup ## the TypeScript receiver vs the Python library draining 100k events, no-op handlers, alternated (JSON on stdout)
	$(BIN)/python -m benchmarks.ts_receiver $(ARGS)

bench-web: $(STAMP) ## the web dashboard on 10M events: each page's p50/p99, an open overview's PostgreSQL CPU (JSON on stdout)
	$(BIN)/python -m benchmarks.web $(ARGS)

bench-cli: $(STAMP) ## the CPU a qm command costs before any work (qm --help, qm enqueue's imports) vs a bare interpreter; OTHER=<checkout> alongside (JSON on stdout)
	$(BIN)/python -m benchmarks.cli_startup $(if $(OTHER),--other $(OTHER)) $(ARGS)

bench-first-run: $(STAMP) ## fresh clones of HEAD to events flowing in make demo, and the demo virtualenv's packages, ~1 min a run (JSON on stdout)
	$(BIN)/python -m benchmarks.first_run $(ARGS)

clean-local: ## stop and delete the demo's local shards
	-$(BIN)/qm local stop --dir .qm-local
	rm -rf .qm-local
