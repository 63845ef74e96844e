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

.PHONY: install system-packages test demo replay bench lint clean

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
	$(PY) -m pytest -q tests

demo: install
	$(PY) tools/demo.py

replay: install
	$(PY) tools/replay_trace.py $(TRACE) --device-blocks 1000 10000 30000 100000
	$(PY) tools/replay_trace.py $(TRACE) --device-blocks 10000 --host-blocks 20000 --write-policy write_back

bench: install
	$(PY) tools/bench_scheduler.py

lint: install
	$(VENV)/bin/ruff check fastkv tests tools
	$(VENV)/bin/ruff format --check fastkv tests tools

clean:
	rm -rf $(VENV) build *.egg-info fastkv/*.so fastkv/ops/*.so
