# The README's two commands: `make serve` and `make test`. Both create .venv when missing and
# install the project (torch pinned to the local CPU build through constraints.txt).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
PIP    := $(BIN)/python -m pip
ARGS   ?=
PYTEST_ARGS ?=

.PHONY: install serve test lint typecheck pytest test-slow bench-protocol bench-engine bench-server clean

$(STAMP): pyproject.toml constraints.txt
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet -c constraints.txt -e '.[dev]'
	@touch $(STAMP)

install: $(STAMP)

serve: install
	$(BIN)/seedance serve $(ARGS)

lint: install
	$(BIN)/ruff check seedance tests tools

typecheck: install
	$(BIN)/mypy --strict seedance

pytest: install
	$(BIN)/pytest $(PYTEST_ARGS)

test: lint typecheck pytest

test-slow: install
	HYPOTHESIS_PROFILE=slow $(BIN)/pytest -m slow $(PYTEST_ARGS)

bench-protocol: install
	$(BIN)/python tools/bench_protocol.py

bench-engine: install
	$(BIN)/python tools/bench_engine.py

bench-server: install
	$(BIN)/python tools/bench_server.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache
