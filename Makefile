# One entry point for people and CI. `make test` does all set-up on a fresh machine.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
SERVICES := $(PYTHON) deploy/local/services.py
# Parallel workers for the suite; every test has its own schema and topics. Three on two cores:
# many tests wait on failovers, restarts and subprocesses, and a third worker fills that time
# (the whole suite on two cores: 33 min with two workers, 28 min with three).
PYTEST_WORKERS ?= 3
PYTEST_ARGS ?=

.PHONY: help venv caches services-up services-down services-status cluster-up cluster-down lint test test-fast test-cold docs docs-build demo prometheus-install prometheus-check bench clean

help:
	@echo "make demo           run the product end to end on local services"
	@echo "make test           venv + lint + downloads + services + the whole test suite (what CI runs)"
	@echo "make test-cold      the same from a clean clone of HEAD with every cache moved aside, as on a fresh machine"
	@echo "make lint           ruff check, ruff format --check, mypy (tracker/, harvester/)"
	@echo "make docs           build the documentation site strictly and serve it on http://127.0.0.1:8000"
	@echo "make services-up    start local Postgres, PgBouncer, Kafka and a Spark master + 2 workers (idempotent); prints DSNs, bootstrap, master"
	@echo "make services-down  stop them (and the cluster)"
	@echo "make cluster-up     three Kafka brokers, three KRaft controllers + a Postgres primary with a synchronous standby, own ports (idempotent)"
	@echo "make prometheus-check  promtool check + unit tests of deploy/prometheus/rules.yml (installs Debian's prometheus)"

# One installer at a time (flock; the one that waited finds the stamp and stops); a venv whose
# creation was interrupted (no working pip) is made anew; the stamp is written only after
# everything installed.
$(VENV)/.installed: pyproject.toml
	flock $(VENV).lock sh -c '\
	  [ "$@" -nt pyproject.toml ] && exit 0; \
	  { $(PY) -m pip --version >/dev/null 2>&1 || { rm -rf $(VENV) && $(PYTHON) -m venv $(VENV); }; } && \
	  $(PY) -m pip install -q --upgrade pip && \
	  $(PY) -m pip install -q -e ".[test,spark]" && \
	  touch $@'

venv: $(VENV)/.installed

# Every first-use download, once, before the test workers start (Kafka's jars, Spark's Kafka
# connector, the Node, Go and JDBC clients, Debian's prometheus and Chromium), all at once: each is
# safe beside the others and on demand from several processes (deploy/local/first_use.py, or Go's
# own caches), so a cold machine waits for the slowest, not their sum (deploy/local/caches.py).
caches: venv
	$(PY) deploy/local/caches.py

services-up:
	$(SERVICES) up

services-down: cluster-down
	$(SERVICES) down

# The fault tests' topology (tests/test_cluster_faults.py): started before the workers, so no
# test waits for three JVMs; the tests' fixture starts it too when run alone, and stops it after
# them (on CI always: idle, its brokers would take a sixth of a core from the rest of the suite).
cluster-up:
	$(SERVICES) cluster up

cluster-down:
	$(SERVICES) cluster down

services-status:
	$(SERVICES) status

# The gates: ruff (lint + format check) over the repository, mypy over tracker/ and harvester/.
lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

# The fixtures use OUTBOX_TEST_DSN / KAFKA_BOOTSTRAP when set, else these local services. Every
# test's time goes to .local/test-report.xml, to see where a run went.
test: venv lint caches services-up cluster-up
	$(PY) -m pytest -n $(PYTEST_WORKERS) --dist loadgroup --durations=30 --junitxml=.local/test-report.xml $(PYTEST_ARGS)

test-fast: venv caches services-up
	$(PY) -m pytest -n $(PYTEST_WORKERS) --dist loadgroup -m "not slow and not cluster" $(PYTEST_ARGS)

# As on a fresh machine: a clean clone of HEAD whose .venv, .local, project cache and the pip, npm
# and Maven caches are all new and empty, then CI's own command (.ci/run). Stops this checkout's
# services first, since the clone starts its own on the same ports.
test-cold:
	bash deploy/local/test_cold.sh

# The documentation site (docs/, Sphinx): regenerate nothing, build strictly (warnings and broken
# links fail, as in `make test`), then serve the result locally.
DOCS_PORT ?= 8000
docs-build: venv
	$(PY) -m sphinx -W --keep-going -n -q -b html docs .local/docs-site

docs: docs-build
	@echo "serving .local/docs-site on http://127.0.0.1:$(DOCS_PORT) (Ctrl-C stops)"
	$(PY) -m http.server --bind 127.0.0.1 --directory .local/docs-site $(DOCS_PORT)

# From nothing: venv, local services (stopped again afterwards if the demo started them), two
# reapers, an example app and consumers; 100,000 items, a leader killed midway, the completion event.
demo: venv
	$(PY) -m demo $(DEMO_ARGS)

# Debian's prometheus package (the tests install it on demand too) and the rule checks.
prometheus-install:
	$(PYTHON) deploy/prometheus/local.py install

prometheus-check:
	$(PYTHON) deploy/prometheus/local.py check

clean:
	$(SERVICES) cluster down
	$(SERVICES) down
	rm -rf .local $(VENV) $(VENV).lock
