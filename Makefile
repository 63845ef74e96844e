# Fresh machine: `make demo` runs the main job, `make test` runs the tests.
# Both install into .venv first (once; again when a dependency or native source changes).

PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
NATIVE := $(wildcard fastkv/*.c fastkv/storage/*.c custom_ops/csrc/*)
# Mooncake Store's wheel links these; `ip` brings up loopback in the test namespaces.
SYSTEM_PACKAGES := libibverbs1 libnuma1 libcurl4 iproute2
SHARED_TRACE := ../shared/traces/conversation_trace.jsonl
TRACE ?= $(if $(wildcard $(SHARED_TRACE)),$(SHARED_TRACE),synthetic)

.PHONY: install system-packages test gpu-test demo replay bench lint clean

install: system-packages $(STAMP)

# Idempotent and quiet: one dpkg query per package when everything is there.
system-packages:
	@missing=""; for p in $(SYSTEM_PACKAGES); do \
		dpkg-query -W -f='$${Status}' $$p 2>/dev/null | grep -q " installed" || missing="$$missing $$p"; \
	done; \
	if [ -n "$$missing" ]; then \
		echo "installing system packages:$$missing"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null; \
	fi

$(STAMP): requirements.txt setup.py $(NATIVE)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet -r requirements.txt
	$(PY) -m pip install --quiet --no-build-isolation --no-deps -e .
	touch $(STAMP)

test: install
	$(PY) -m pytest -q -rs tests
	@# On a GPU runner the GPU tests run for real (make gpu-test), never skipped.
	@if nvidia-smi -L >/dev/null 2>&1; then $(MAKE) --no-print-directory gpu-test; fi

# GPU machine with CuPy (and optionally paddlepaddle-gpu) in GPU_PYTHON's site-packages:
# a venv that sees them, the core built for this GPU too, and every `gpu` test run
# through the C ABI (and the Paddle ops when Paddle has CUDA) with skips as failures.
GPU_PYTHON ?= python3
GPU_VENV := build/venv-gpu
GPU_PY := $(GPU_VENV)/bin/python
gpu-test:
	test -x $(GPU_PY) || $(GPU_PYTHON) -m venv --system-site-packages $(GPU_VENV)
	$(GPU_PY) -c "import numpy, pytest, setuptools" 2>/dev/null || \
		$(GPU_PY) -m pip install --quiet numpy pytest setuptools
	@# In place, with no packaging step: works offline and with any setuptools.
	FASTKV_CUDA_EXTRA_ARCHS="$$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | sort -u | tr '\n' ' ')" \
		$(GPU_PY) setup.py --quiet build_ext --inplace
	$(GPU_PY) -c "from fastkv.ops import core; print(core.cuda_info().describe())"
	@# The in-place libraries were just built for this venv's Paddle (if any): make
	@# the next `make install` rebuild them for .venv's.
	rm -f $(STAMP)
	FASTKV_REQUIRE_GPU=1 $(GPU_PY) -m pytest -q -m gpu -rs -p no:cacheprovider tests/ops tests/worker
	@cat build/gpu-test-first-call.json 2>/dev/null || true

demo: install
	$(PY) tools/demo.py

replay: install
	$(PY) tools/replay_trace.py $(TRACE) --device-blocks 1000 10000 30000 100000
	$(PY) tools/replay_trace.py $(TRACE) --device-blocks 10000 --host-blocks 20000 --write-policy write_back

bench: install
	$(PY) tools/bench_scheduler.py

lint: install
	$(VENV)/bin/ruff check fastkv tests tools examples
	$(VENV)/bin/ruff format --check fastkv tests tools examples

clean:
	rm -rf $(VENV) build *.egg-info fastkv/*.so fastkv/ops/*.so
