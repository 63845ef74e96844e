# Fresh machine: `make demo` runs the main job, `make test` runs the tests.
# Both install into .venv first (once; again when a dependency or native source changes).

PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
NATIVE := $(wildcard fastkv/*.c fastkv/storage/*.c fastkv/storage/*.h custom_ops/csrc/*)
# Mooncake Store's wheel links these; `ip` brings up loopback in the test namespaces.
SYSTEM_PACKAGES := libibverbs1 libnuma1 libcurl4 iproute2 libssl-dev
SHARED_TRACE := ../shared/traces/conversation_trace.jsonl
TRACE ?= $(if $(wildcard $(SHARED_TRACE)),$(SHARED_TRACE),synthetic)

.PHONY: install system-packages test gpu-test fd-venv fd-test demo replay bench lint clean

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
