# One entry point for people and CI. `make test` does all set-up on a fresh machine.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
SERVICES := $(PYTHON) deploy/local/services.py
# Parallel workers for the suite; every test has its own schema and topics.
PYTEST_WORKERS ?= 2
PYTEST_ARGS ?=

.PHONY: help venv services-up services-down services-status lint test test-fast demo prometheus-install prometheus-check bench clean

help:
	@echo "make demo           run the product end to end on local services"
	@echo "make test           venv + lint + services + the whole test suite (what CI runs)"
	@echo "make lint           ruff check, ruff format --check, mypy (tracker/, harvester/)"
	@echo "make services-up    start local Postgres, PgBouncer, Kafka and a Spark master + 2 workers (idempotent); prints DSNs, bootstrap, master"
	@echo "make services-down  stop them"
	@echo "make prometheus-check  promtool check + unit tests of deploy/prometheus/rules.yml (installs Debian's prometheus)"

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test,spark]'
	touch $@

venv: $(VENV)/.installed

services-up:
	$(SERVICES) up

services-down:
	$(SERVICES) down

services-status:
	$(SERVICES) status

# The gates: ruff (lint + format check) over the repository, mypy over tracker/ and harvester/.
lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

# The fixtures use OUTBOX_TEST_DSN / KAFKA_BOOTSTRAP when set, else these local services.
test: venv lint services-up
	$(PY) -m pytest -n $(PYTEST_WORKERS) --dist loadgroup $(PYTEST_ARGS)

test-fast: venv services-up
	$(PY) -m pytest -n $(PYTEST_WORKERS) --dist loadgroup -m "not slow" $(PYTEST_ARGS)

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
	$(SERVICES) down
	rm -rf .local $(VENV)
