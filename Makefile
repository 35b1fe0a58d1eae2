# The two commands users run: `make run` and `make test`. Each does all its own set-up.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
DEVSTAMP:= $(VENV)/.installed-dev
# CPU machines take the CPU wheel of torch (the +cpu local version, so a CUDA build is never
# pulled by accident): from pip's configured sources first (a local wheel), else from the
# PyTorch CPU index. GPU users install their own build first (README).
TORCH   ?= torch==2.13.0+cpu
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
# The extras `make run` and `make bench` need (rich for the demo, transitions for `bench engine`,
# numpy for the object collectives of `bench tp`);
# `make test` installs `dev`, which holds every extra (pyproject.toml).
EXTRAS  := cli,reference,distributed

.PHONY: run test lint typecheck pytest verify check audit diagrams docs bench clean system-deps

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q "$(TORCH)" \
		|| $(BIN)/pip install -q --index-url "$(TORCH_INDEX)" "$(TORCH)"
	$(BIN)/pip install -q -e ".[$(EXTRAS)]"
	touch $@

$(DEVSTAMP): pyproject.toml $(STAMP)
	$(BIN)/pip install -q -e ".[dev]"
	touch $@

run: $(STAMP)
	$(BIN)/fsm-cache demo

system-deps:
	@bash .ci/system-deps

lint: $(DEVSTAMP)
	$(BIN)/ruff check fsm_cache tests specs docs/hooks
	$(BIN)/ruff format --check fsm_cache tests specs docs/hooks
	$(BIN)/lint-imports

typecheck: $(DEVSTAMP)
	$(BIN)/mypy

pytest: $(DEVSTAMP)
	$(BIN)/pytest -q

verify: $(DEVSTAMP)
	$(BIN)/fsm-cache verify

check: $(DEVSTAMP)
	$(BIN)/fsm-cache check

audit: $(DEVSTAMP)
	$(BIN)/fsm-cache audit fsm_cache

diagrams: $(DEVSTAMP)
	$(BIN)/fsm-cache diagram --check

docs: $(DEVSTAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir site

bench: $(STAMP)
	$(BIN)/fsm-cache bench

test: system-deps $(DEVSTAMP)
	$(MAKE) lint typecheck pytest verify check audit diagrams docs

clean:
	rm -rf $(VENV) site .pytest_cache .mypy_cache .ruff_cache .import_linter_cache
