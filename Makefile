# The two commands a newcomer needs: `make run` and `make test`. Both install what they need.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
ENGINE_STAMP := $(VENV)/.installed-engine
TORCH_PIN := torch==2.13.0

.PHONY: install install-engine lock test lint run bench client clean

# constraints.txt: the versions the suite last passed with (its header says why; `make lock` refreshes it).
$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -c constraints.txt -e '.[dev]'
	touch $(STAMP)

# The real-model engine's extra (torch + transformers): `make test` needs it, `make install` does
# not. torch goes first, pinned: an unpinned resolve would pull a multi-GB CUDA build.
$(ENGINE_STAMP): $(STAMP) pyproject.toml constraints.txt
	$(BIN)/python -m pip install -q '$(TORCH_PIN)'
	$(BIN)/python -m pip install -q -c constraints.txt -e '.[dev,engine]'
	touch $(ENGINE_STAMP)

install: $(STAMP)

install-engine: $(ENGINE_STAMP)

# Re-resolve every dependency to its newest release and record it: run `make test` after, and
# commit constraints.txt only if it passes.
lock:
	rm -rf .venv-lock && $(PY) -m venv .venv-lock
	.venv-lock/bin/python -m pip install -q '$(TORCH_PIN)'
	.venv-lock/bin/python -m pip install -q -e '.[dev,engine]'
	{ sed -n '/^#/p' constraints.txt; .venv-lock/bin/python -m pip freeze | grep -v -i -E '^-e|^flexlb|^torch=='; } > constraints.new
	mv constraints.new constraints.txt && rm -rf .venv-lock

# Two pytest-xdist workers, one test file each at a time (module fixtures stay one per file): the
# suite mostly waits on the processes it starts (Triton workers, gateways, fixed fault windows),
# and serial it kept ~0.5 of 2 cores busy (test_gateway_cluster, since split into
# test_gateway_cluster_state and test_gateway_admin: 38 s of CPU in 80 s). Each worker has its own
# session pool of Triton workers and embedded Redis. TEST_WORKERS=0: one process.
TEST_WORKERS ?= 2
test: $(ENGINE_STAMP)
	FLEXLB_REQUIRE_ENGINE=1 $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=15 $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

run: $(STAMP)
	$(BIN)/flexlb up $(RUN_ARGS)

bench: $(STAMP)
	$(BIN)/python bench/workers_bench.py

# A Python client generated from a gateway's OpenAPI document (docs/api.md); the generator lives in
# its own venv, away from the project's pins. OPENAPI_URL=... for another gateway.
OPENAPI_URL ?= http://127.0.0.1:8000/openapi.json
client:
	test -x .venv-client/bin/openapi-python-client || \
	  { $(PY) -m venv .venv-client && .venv-client/bin/pip install -q openapi-python-client; }
	PATH="$(CURDIR)/$(BIN):$$PATH" .venv-client/bin/openapi-python-client generate --url $(OPENAPI_URL) --output-path flexlb-client --overwrite

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
