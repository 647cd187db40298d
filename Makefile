# The two commands a newcomer needs: `make run` and `make test`. Both install what they need.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install test lint run bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(BIN)/python -m pytest -q --durations=15 $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

run: $(STAMP)
	$(BIN)/flexlb up $(RUN_ARGS)

bench: $(STAMP)
	$(BIN)/python bench/workers_bench.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
