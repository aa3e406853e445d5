# make demo | make test — each sets up .venv when needed (CPU torch 2.13 when no torch is
# present, then this package with its test extras), then runs the job.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.dsv41attn-installed

.PHONY: demo test test-fast env clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[test]"
	touch $(STAMP)

env: $(STAMP)

demo: $(STAMP)
	$(PY) -m dsv41attn demo

test: $(STAMP)
	$(PY) -m pytest -q

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow"

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
