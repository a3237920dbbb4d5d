# One command each: `make setup`, `make demo`, `make test`, `make lint`, `make bench`.
# Every target sets up its own virtual environment first, so each works on a fresh machine.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup demo test lint bench upstream-tests clean

setup: $(STAMP)

$(STAMP): requirements/requirements.txt requirements/requirements-dev.txt setup.py
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools wheel
	$(PY) -m pip install -q -r requirements/requirements-dev.txt
	$(PY) -m pip install -q --no-build-isolation --no-deps -e .
	touch $(STAMP)

# The main job: ZeRO-3 on 2 CPU processes (gloo), through our own launcher.
demo: setup
	$(VENV)/bin/deepspeed --num_procs 2 examples/zero3_demo.py

test: setup
	$(PY) -m pytest tests -q -rs -p no:cacheprovider

lint: setup
	$(VENV)/bin/ruff check deepspeed tests benchmarks examples
	$(VENV)/bin/ruff format --check deepspeed tests benchmarks examples

# All benchmarks in one go (~25 min on 2 shared cores): benchmarks/results/latest.{json,md,png}.
bench: setup
	$(PY) -m pip install -q -r requirements/requirements-bench.txt
	bash benchmarks/setup_upstream.sh
	$(PY) benchmarks/run_all.py

# Upstream DeepSpeed's own ZeRO unit tests, unchanged, against this package (docs/upstream_tests.md).
# UPSTREAM_GIT: a bare snapshot of deepspeedai/DeepSpeed (e.g. the search tool's fetch);
# the tests are extracted into a temporary folder, never into this tree.
UPSTREAM_GIT ?=
UPSTREAM_TESTS_OUT ?= upstream-tests-out
UPSTREAM_RUNNER ?= ../shared/upstream-tests/run.sh
upstream-tests: setup
	@test -n "$(UPSTREAM_GIT)" || { echo "usage: make upstream-tests UPSTREAM_GIT=/path/to/DeepSpeed/repo (a bare git snapshot)"; exit 2; }
	@test -d "$(UPSTREAM_GIT)" || { echo "UPSTREAM_GIT=$(UPSTREAM_GIT) is not a directory"; exit 2; }
	@test -f "$(UPSTREAM_RUNNER)" || { echo "runner $(UPSTREAM_RUNNER) not found; set UPSTREAM_RUNNER=path/to/run.sh"; exit 2; }
	mkdir -p "$(UPSTREAM_TESTS_OUT)"
	PYTHONPATH=$(CURDIR) bash $(UPSTREAM_RUNNER) "$(abspath $(UPSTREAM_GIT))" "$(abspath $(VENV))" "$(abspath $(UPSTREAM_TESTS_OUT))"

clean:
	rm -rf $(VENV) build *.egg-info
