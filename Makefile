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

.PHONY: setup train test test-slow test-wheel test-portable tables analysis bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints.txt -e ".[test]"
	touch $(STAMP)

train: setup
	$(PY) train.py $(ARGS)

test: setup
	$(PY) -m pytest -q $(ARGS)

test-slow: setup
	$(PY) -m pytest -q -m slow $(ARGS)

# the wheel, installed into fresh environments outside the checkout (Python 3.11 and 3.12 where present)
WHEEL_PYTHONS ?= 3.11 3.12
test-wheel: setup
	DIVISION_WHEEL_PYTHONS="$(WHEEL_PYTHONS)" $(PY) -m pytest -q -m slow tests/test_wheel.py $(ARGS)

# the codec tests with the C kernels built as for CPUs without AVX-512, then without AVX-512 and BMI2
PORTABLE_TESTS = tests/test_codecs.py tests/test_compact.py tests/test_fused.py
test-portable: setup
	DIVISION_KERNEL_FLAGS="-mno-avx512f" $(PY) -m pytest -q $(PORTABLE_TESTS) $(ARGS)
	DIVISION_KERNEL_FLAGS="-mno-avx512f -mno-bmi2" $(PY) -m pytest -q $(PORTABLE_TESTS) $(ARGS)

tables: setup
	$(PY) scripts/make_tables.py

analysis: setup
	$(PY) scripts/analyze_frequency.py $(ARGS)

clean:
	rm -rf $(VENV) outputs multirun

SUITE ?= cpu
bench: setup
	$(PY) scripts/bench.py --config src/division/configs/bench/$(SUITE).yaml $(ARGS)
