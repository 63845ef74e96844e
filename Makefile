# Fresh machine: `make demo` runs the main job, `make test` runs the tests.
# Both install into .venv first (once; again when a dependency or native source changes).
# `make install PYTHON_ENV=/path/to/bin/python` installs into that environment instead
# (no .venv, no requirements.txt): fastkv built against the Paddle it holds.

PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
NATIVE := $(wildcard fastkv/*.c fastkv/scheduler/*.c fastkv/storage/*.c fastkv/storage/*.h custom_ops/csrc/*) \
	fastkv/ops/native_build.py fastkv/ops/cuda_build.py
# Mooncake Store's wheel links these; `ip` brings up loopback in the test namespaces.
SYSTEM_PACKAGES := libibverbs1 libnuma1 libcurl4 iproute2 libssl-dev
SHARED_TRACE := ../shared/traces/conversation_trace.jsonl
TRACE ?= $(if $(wildcard $(SHARED_TRACE)),$(SHARED_TRACE),synthetic)

.PHONY: install install-venv install-env system-packages test gpu-test fd-venv fd-test \
	demo replay bench lint clean

PYTHON_ENV ?=
ifeq ($(strip $(PYTHON_ENV)),)
install: install-venv
else
install: install-env
endif

install-venv: system-packages $(STAMP)

# Into an environment that already has its Paddle (e.g. FastDeploy's, with
# paddlepaddle-gpu): built by that interpreter with no build isolation, so the CUDA
# toolkit check sees that Paddle (a toolkit of another CUDA major version is refused)
# and the Paddle ops link its libpaddle.so. Needs pip and setuptools there; numpy is
# fastkv's only dependency. CUDA_HOME picks the toolkit.
install-env:
	@test -x "$$(command -v $(PYTHON_ENV))" || \
		{ echo "PYTHON_ENV=$(PYTHON_ENV): no such interpreter"; exit 1; }
	@{ $(PYTHON_ENV) -c "import setuptools" && $(PYTHON_ENV) -m pip --version; } >/dev/null 2>&1 || \
		{ echo "PYTHON_ENV=$(PYTHON_ENV) lacks pip or setuptools, which a build without"; \
		  echo "isolation needs: $(PYTHON_ENV) -m pip install setuptools wheel"; exit 1; }
	$(PYTHON_ENV) -m pip install --no-build-isolation .

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

test: install-venv
	$(PY) -m pytest -q -rs tests
	@# On a GPU runner the GPU tests run for real (make gpu-test), never skipped.
	@if nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then $(MAKE) --no-print-directory gpu-test; fi
	@# Against FastDeploy's real code wherever its source is here (make fd-test).
	@if [ -n "$(FD_SRC)" ]; then $(MAKE) --no-print-directory fd-test; \
	else echo "fd-test SKIPPED: no FastDeploy source (neither ../shared/third_party/FastDeploy nor \$$FASTDEPLOY_SRC)"; fi

# FastDeploy's real engine code (its Python package, never copied here) on
# PYTHONPATH, in a venv of its own (FastDeploy's pins differ from .venv's), with
# fastkv built in place against that venv's Paddle. tests/fastdeploy_real/ runs
# only here: .venv's run over tests/ does not collect it (tests/conftest.py).
FD_SRC := $(or $(FASTDEPLOY_SRC),$(wildcard ../shared/third_party/FastDeploy))
FD_VENV := build/venv-fd
FD_PY := $(FD_VENV)/bin/python
FD_STAMP := $(FD_VENV)/.installed
FD_REQ := tests/fastdeploy_real/requirements.txt

$(FD_STAMP): $(FD_REQ) setup.py $(NATIVE)
	@start=$$(date +%s); \
	test -x $(FD_PY) || $(PYTHON) -m venv $(FD_VENV); \
	$(FD_PY) -m pip install --quiet -r $(FD_REQ) && \
	$(FD_PY) -m pip install --quiet --no-build-isolation --no-deps -e . && \
	$(FD_PY) -c "import numpy, paddle, fastkv._chain_hash, fastkv.ops.paddle_ops; from fastkv.ops import core; core.cuda_info(); \
		print('fd venv: numpy', numpy.__version__, 'paddle', paddle.__version__)" && \
	echo "fd venv installed in $$(( $$(date +%s) - start )) s" && touch $(FD_STAMP)

fd-venv: $(FD_STAMP)

fd-test: $(FD_STAMP)
	@test -d "$(FD_SRC)/fastdeploy" || { echo "fd-test: no fastdeploy/ under '$(FD_SRC)'"; exit 1; }
	@start=$$(date +%s); \
	PYTHONPATH="$(abspath $(FD_SRC))" $(FD_PY) -m pytest -q -rs -p no:cacheprovider tests/fastdeploy_real; \
	rc=$$?; echo "fd-test ran in $$(( $$(date +%s) - start )) s"; exit $$rc

# GPU machine: GPU_PYTHON (default python3) must already import CuPy, numpy and pytest
# (and paddlepaddle-gpu for the Paddle-op tests); it is used as it is: no venv, nothing
# installed or fetched (tools/gpu_preflight.py says what is missing). Builds only the
# core (and the Paddle ops where paddle imports), with the standard library and the
# compilers, for the GPUs nvidia-smi lists plus GPU_ARCHS (e.g. GPU_ARCHS="80"), not
# every default target: the tests run on this GPU alone. Then runs every `gpu` test
# through the C ABI with skips as failures, except a test that needs more GPUs than
# the machine has.
GPU_PYTHON ?= python3
GPU_ARCHS ?=
gpu-test:
	$(GPU_PYTHON) tools/gpu_preflight.py
	archs="$$($(GPU_PYTHON) tools/gpu_preflight.py --archs '$(GPU_ARCHS)')" && \
	FASTKV_WITH_CUDA=1 FASTKV_CUDA_ARCHS="$$archs" FASTKV_CUDA_EXTRA_ARCHS= \
		$(GPU_PYTHON) fastkv/ops/native_build.py
	$(GPU_PYTHON) -c "from fastkv.ops import core; print(core.cuda_info().describe())"
	@# The in-place libraries were just built for GPU_PYTHON's Paddle (if any): make
	@# the next `make install` rebuild them for .venv's.
	rm -f $(STAMP)
	FASTKV_REQUIRE_GPU=1 $(GPU_PYTHON) -m pytest -q -m gpu -rs -p no:cacheprovider tests/ops tests/worker
	@cat build/gpu-test-first-call.json 2>/dev/null || true
	@cat build/gpu-test-free-behind-stuck-stream.json 2>/dev/null || true

demo: install-venv
	$(PY) tools/demo.py

replay: install-venv
	$(PY) tools/replay_trace.py $(TRACE) --device-blocks 1000 10000 30000 100000
	$(PY) tools/replay_trace.py $(TRACE) --device-blocks 10000 --host-blocks 20000 --write-policy write_back

bench: install-venv
	$(PY) tools/bench_scheduler.py

lint: install-venv
	$(VENV)/bin/ruff check fastkv tests tools examples
	$(VENV)/bin/ruff format --check fastkv tests tools examples

clean:
	rm -rf $(VENV) build *.egg-info fastkv/*.so fastkv/ops/*.so
