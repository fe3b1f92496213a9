# corral developer tasks. From a fresh clone, `make demo` and `make test` need nothing done first:
# both create the virtual environment (.venv) on first use.
#
#   make venv         create .venv and install corral with its dev extras (again when pyproject.toml changes)
#   make test         run the whole test suite (unit and integration; root for the local backend), on
#                     TEST_WORKERS=2 workers, and print where its time went
#   make coding-clis  install the coding CLIs (Qwen Code, Pi, ...) from npm at their pinned versions into
#                     CODING_CLIS_PREFIX (root: /opt/corral-clis; else ~/.cache/corral-clis); make test runs it
#   make test-unit    run the unit tests only (no root, no daemon process, no system packages), on TEST_WORKERS workers
#   make demo         run examples/demo.py
#   make lint         ruff (lint and format), mypy, import-linter, and the generated sync client's check
#   make format       ruff format and ruff's import sorting, in place
#   make sync-client  regenerate sdk/sync_client.py and sdk/sync_rollouts.py from their asyncio sources
#   make protos       regenerate the Python modules from proto/corral/v1/*.proto
#   make lint-protos  buf lint, plus buf breaking against the base commit when there is one
#   make clean        remove the virtual environment, node_modules and build/test leftovers
#
# Every pip install passes `-c constraints.txt`, which pins the torch release the extras that need it use.

SHELL := /bin/bash

PYTHON ?= python3
VENV := .venv
VENV_PY := $(VENV)/bin/python
PIP_CONSTRAINTS := -c constraints.txt

# buf comes from npm; it is installed into ./node_modules on first use.
BUF_NPM_PACKAGE ?= @bufbuild/buf@1.75.0
BUF := node_modules/.bin/buf
# Compare against this git ref in `buf breaking`; empty: origin/main (merge base), else HEAD~.
BUF_AGAINST ?=

.PHONY: venv test test-unit demo lint format typecheck sync-client protos lint-protos clean system-deps coding-clis

# Where the coding CLIs are installed (docs/coding-clis.md): root's default is the directory the
# local backend's "host" sandboxes are shown (local.host_paths); an ordinary user gets one of theirs.
# The tests find them through CORRAL_CODING_CLIS.
ifdef CORRAL_CODING_CLIS
CODING_CLIS_PREFIX ?= $(CORRAL_CODING_CLIS)
else ifeq ($(shell id -u),0)
CODING_CLIS_PREFIX ?= /opt/corral-clis
else
CODING_CLIS_PREFIX ?= $(HOME)/.cache/corral-clis
endif
export CORRAL_CODING_CLIS := $(CODING_CLIS_PREFIX)

# Extra pytest arguments for `make test` (e.g. PYTEST_ARGS='-k shells').
PYTEST_ARGS ?=
# `make test` runs test modules on this many pytest-xdist workers, a module's tests on one worker
# (its module-scoped fixtures, such as the vLLM engine or the Ray cluster, start once); 0 runs
# them all in one process. tests/README.md, "Workers", has the measurements behind the default.
TEST_WORKERS ?= 2

# Extras installed into .venv; CI adds the trainer and harness packages: make test EXTRAS=dev,verl,tunix,minisweagent,swerex
EXTRAS ?= dev
comma := ,
STAMP := $(VENV)/.installed-$(subst $(comma),-,$(EXTRAS))

venv: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	@if ! $(VENV_PY) -m pip --version >/dev/null 2>&1; then \
	  rm -rf $(VENV); \
	  echo "$(PYTHON) -m venv $(VENV)"; \
	  if ! $(PYTHON) -m venv $(VENV); then \
	    rm -rf $(VENV); \
	    echo >&2; \
	    echo "error: '$(PYTHON) -m venv' failed. On Debian/Ubuntu install the venv module first:" >&2; \
	    echo "         apt-get install python3-venv" >&2; \
	    exit 1; \
	  fi; \
	fi
	$(VENV_PY) -m pip install --quiet --upgrade $(PIP_CONSTRAINTS) pip
	$(VENV_PY) -m pip install $(PIP_CONSTRAINTS) -e '.[$(EXTRAS)]'
	@touch $@

# The Debian packages demo and test need (bubblewrap, python3-ipykernel, ...), installed when missing
# and root; else it says what is missing. CORRAL_SKIP_SYSTEM_DEPS=1 skips it.
system-deps:
	@PYTHON='$(PYTHON)' bash scripts/install_system_deps.sh

# The packages first, then the venv (which may need python3-venv), in that order even under -j.
# Then the suite, and where its time went (tests/timing.py wrote it; tests/README.md, "The budget"),
# printed whether it passed or not.
test: system-deps
	@$(MAKE) --no-print-directory venv
	@$(MAKE) --no-print-directory coding-clis
	@status=0; $(VENV_PY) -m pytest -q --durations=20 -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS) || status=$$?; \
	  $(VENV_PY) scripts/test_durations.py "$${CORRAL_TEST_DURATIONS:-build/test-durations.json}" || true; \
	  exit $$status

# The coding CLIs from npm (python -m corral.rollout.coding_clis install; idempotent: nothing is
# fetched when they are there at their pinned versions). Without node and npm, or without the
# registry, it says why and the CLI tests skip, unless CORRAL_REQUIRE_CODING_CLIS names them.
coding-clis: venv
	@$(VENV_PY) -m corral.rollout.coding_clis install --prefix '$(CODING_CLIS_PREFIX)' \
	  || { [ -z "$${CORRAL_REQUIRE_CODING_CLIS:-}" ] && echo "coding CLIs not installed: their tests skip" >&2; }

test-unit: venv
	$(VENV_PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile tests/unit

demo: system-deps
	@$(MAKE) --no-print-directory venv
	$(VENV_PY) examples/demo.py

lint: venv
	$(VENV_PY) -m ruff check .
	$(VENV_PY) -m ruff format --check .
	$(VENV_PY) scripts/typecheck.py
	$(VENV)/bin/lint-imports
	$(VENV_PY) scripts/unasync.py --check

format: venv
	$(VENV_PY) -m ruff check --select I --fix .
	$(VENV_PY) -m ruff format .

typecheck: venv
	$(VENV_PY) scripts/typecheck.py

sync-client: venv
	$(VENV_PY) scripts/unasync.py

protos: venv
	$(VENV_PY) scripts/gen_protos.py

$(BUF):
	@command -v npm >/dev/null 2>&1 || { echo "error: npm not found (apt-get install npm)" >&2; exit 1; }
	npm install --prefix . --no-save --no-audit --no-fund --ignore-scripts $(BUF_NPM_PACKAGE)

# buf breaking compares proto/ as it is now with proto/ at a base commit: BUF_AGAINST if set, else
# the merge base with origin/main (when HEAD is ahead of it), else HEAD~. With none of these (a
# single-commit or shallow clone) the check is skipped. The base's proto/ is read with git archive
# and checked with today's buf.yaml, so the comparison also works in worktrees and for bases that
# predate buf.yaml.
lint-protos: $(BUF)
	$(BUF) lint
	@set -euo pipefail; \
	base="$(BUF_AGAINST)"; label="$$base"; \
	if [ -z "$$base" ] && git rev-parse -q --verify origin/main^{commit} >/dev/null 2>&1; then \
	  base=$$(git merge-base HEAD origin/main 2>/dev/null || true); label="merge base with origin/main"; \
	  if [ "$$base" = "$$(git rev-parse HEAD)" ]; then base=""; fi; \
	fi; \
	if [ -z "$$base" ] && git rev-parse -q --verify HEAD~^{commit} >/dev/null 2>&1; then base=HEAD~; label=HEAD~; fi; \
	if [ -z "$$base" ]; then echo "buf breaking: no base commit (no origin/main, no HEAD~); skipped"; exit 0; fi; \
	sha=$$(git rev-parse --verify "$$base^{commit}"); \
	if ! git cat-file -e "$$sha:proto" 2>/dev/null; then echo "buf breaking: $$base has no proto/; skipped"; exit 0; fi; \
	tmp=$$(mktemp -d); trap 'rm -rf "$$tmp"' EXIT; \
	git archive "$$sha" proto | tar -x -C "$$tmp"; \
	cp buf.yaml "$$tmp/buf.yaml"; \
	echo "$(BUF) breaking --against <proto/ at $$label, $${sha:0:12}>"; \
	$(BUF) breaking --against "$$tmp"

clean:
	rm -rf $(VENV) node_modules build dist .pytest_cache .mypy_cache .ruff_cache *.egg-info
	find . -path ./.git -prune -o -type d -name __pycache__ -prune -exec rm -rf {} +
