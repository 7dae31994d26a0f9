PYTHON ?= python3.11
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
ARGS ?=
ifeq ($(DATA_DIR),)
ifneq ($(wildcard ../shared/datasets),)
export DATA_DIR := $(abspath ../shared/datasets)
endif
endif

.PHONY: setup train test test-slow tables analysis bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[test]"
	touch $(STAMP)

train: setup
	$(PY) train.py $(ARGS)

test: setup
	$(PY) -m pytest -q $(ARGS)

test-slow: setup
	$(PY) -m pytest -q -m slow $(ARGS)

tables: setup
	$(PY) scripts/make_tables.py

analysis: setup
	$(PY) scripts/analyze_frequency.py $(ARGS)

clean:
	rm -rf $(VENV) outputs multirun

SUITE ?= cpu
bench: setup
	$(PY) scripts/bench.py --config configs/bench/$(SUITE).yaml $(ARGS)
