# Fresh machine: `make demo` runs the main job, `make test` runs the tests.
# Both install into .venv first (once; again when a dependency or native source changes).

PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
NATIVE := $(wildcard fastkv/*.c custom_ops/csrc/*)
SHARED_TRACE := ../shared/traces/conversation_trace.jsonl
TRACE ?= $(if $(wildcard $(SHARED_TRACE)),$(SHARED_TRACE),synthetic)

.PHONY: install test demo replay bench lint clean

install: $(STAMP)

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
	$(VENV)/bin/ruff check fastkv tests tools examples
	$(VENV)/bin/ruff format --check fastkv tests tools examples

clean:
	rm -rf $(VENV) build *.egg-info fastkv/*.so fastkv/ops/*.so
