# The two commands a new machine needs:  make demo   and   make test
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup demo test test-fast lint bench-enqueue bench-e2e bench-held-snapshot bench-churn bench-fairness bench-archive bench-spark bench-adopt bench-maintenance bench-ratelimit clean-local

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e ".[dev]"
	touch $(STAMP)

setup: $(STAMP) ## create the virtualenv and install everything

demo: $(STAMP) ## start local shards and show events flowing (data in .qm-local)
	$(BIN)/qm demo --dir .qm-local

test: $(STAMP) ## the whole suite: unit, integration (real PostgreSQL), Spark
	$(BIN)/python -m pytest -q

test-fast: $(STAMP) ## without the Spark tests
	$(BIN)/python -m pytest -q -m "not spark"

lint: $(STAMP) ## ruff, mypy --strict and the import contracts (pyproject.toml)
	$(BIN)/ruff check queue_manager receivers spark_jobs tests benchmarks
	$(BIN)/mypy
	$(BIN)/lint-imports

bench-enqueue: $(STAMP) ## enqueue throughput vs a plain table (JSON on stdout)
	$(BIN)/python benchmarks/enqueue.py

bench-e2e: $(STAMP) ## one shard end to end: drain, latency, fire accuracy, vs PgQueuer/Procrastinate (JSON on stdout)
	$(BIN)/python benchmarks/e2e.py

bench-held-snapshot: $(STAMP) ## dispatch while a long transaction holds back vacuum, 500/s and 2000/s, ~10 min (JSON on stdout)
	$(BIN)/python benchmarks/held_snapshot.py

bench-churn: $(STAMP) ## 10 min of churn with retention on, clean and with a snapshot held 2 min, ~25 min (JSON on stdout)
	$(BIN)/python benchmarks/churn.py

bench-fairness: $(STAMP) ## a quiet tenant's pickup delay alone and beside a 100k-event noisy tenant, ~8 min (JSON on stdout)
	$(BIN)/python benchmarks/fairness.py

bench-spark: $(STAMP) ## Spark bulk enqueue of 1M events into two shards vs Spark's JDBC writer and COPY (JSON on stdout)
	$(BIN)/python benchmarks/spark_load.py

bench-maintenance: $(STAMP) ## what a maintenance slice costs, and the acks beside reconciliation slices (JSON on stdout)
	$(BIN)/python benchmarks/maintenance.py

bench-archive: $(STAMP) ## archive 200k settled events of two shards to Parquet and delete them (JSON on stdout)
	$(BIN)/python benchmarks/archive.py

bench-adopt: $(STAMP) ## qm queue adopt: 100k legacy rows into two shards, by slice size (JSON on stdout)
	$(BIN)/python benchmarks/adopt.py

bench-ratelimit: $(STAMP) ## max_qps 200 across two shards: both managers, one killed, restarted, ~2 min (JSON on stdout)
	$(BIN)/python benchmarks/ratelimit.py

clean-local: ## stop and delete the demo's local shards
	-$(BIN)/qm local stop --dir .qm-local
	rm -rf .qm-local
