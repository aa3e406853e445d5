# make demo | make test | make env — each sets up .venv when needed, then runs the job.
# Two install stamps: the package alone (CPU torch 2.13 when no torch is present, then this
# package and its dependencies), which is all `demo` and `env` need, and the test extra on top
# of it (pytest, triton for the kernel tests under the interpreter, matplotlib for `inspect`'s
# figure), which only `test` installs: a CPU-only `make demo` never fetches the triton wheel.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PACKAGE_STAMP := $(VENV)/.dsv41attn-package
TEST_STAMP := $(VENV)/.dsv41attn-test-extra

.PHONY: demo test test-fast test-sharded env clean

$(PACKAGE_STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e .
	touch $@

$(TEST_STAMP): $(PACKAGE_STAMP)
	$(PY) -m pip install -q -e ".[test]"
	touch $@

demo: $(PACKAGE_STAMP)
	$(PY) -m dsv41attn demo

env: $(PACKAGE_STAMP)
	$(PY) -m dsv41attn env

# test: the suite over TEST_JOBS pytest processes, one per core of a CI machine (kernels under
# Triton's interpreter where no GPU is present, each distinct launch recorded), then every
# recorded kernel specialisation compiled for sm_90a (no GPU) by the test extra's Triton and by
# the GPU image's (TRITON_GPU, installed beside the venv's and put first on PYTHONPATH for that
# step only).
LAUNCHES := .pytest_cache/sm90-launches.jsonl
TRITON_GPU := 3.6.0
TRITON_GPU_DIR := $(VENV)/triton-$(TRITON_GPU)
$(TRITON_GPU_DIR)/.stamp: $(TEST_STAMP)
	$(PY) -m pip install -q --no-deps --target $(TRITON_GPU_DIR) triton==$(TRITON_GPU)
	touch $@

TEST_JOBS ?= 2
test: $(TEST_STAMP) $(TRITON_GPU_DIR)/.stamp
	rm -f $(LAUNCHES) && mkdir -p .pytest_cache
	DSV41ATTN_LAUNCH_RECORD=$(CURDIR)/$(LAUNCHES) $(PY) tests/sharded.py -j $(TEST_JOBS) \
		--durations 15 --log-tail 200
	$(PY) tests/sm90_compile.py $(LAUNCHES)
	PYTHONPATH=$(CURDIR)/$(TRITON_GPU_DIR) $(PY) tests/sm90_compile.py $(LAUNCHES)

test-fast: $(TEST_STAMP)
	$(PY) -m pytest -q -m "not slow"

# The suite over one pytest process per core or so (tests/sharded.py): for GPU machines, where
# the kernel tests compile one kernel at a time per process. ARGS: e.g. ARGS="-j 8 tests/test_gpu_roles.py".
test-sharded: $(TEST_STAMP)
	$(PY) tests/sharded.py $(ARGS)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
