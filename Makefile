# Every target creates .venv and installs what it needs, and only that.
PY := .venv/bin/python
HASH := $(shell cksum pyproject.toml | cut -d' ' -f1)
VENV := .venv/.created-$(HASH)

.PHONY: demo demo-cluster test soak lint bench survey clean

$(VENV): pyproject.toml
	python3 -m venv .venv && $(PY) -m pip install -q --upgrade pip && $(PY) -m pip install -q -e . && touch $@

.venv/.extra-%-$(HASH): $(VENV)
	$(PY) -m pip install -q -e '.[$*]' && touch $@

demo: $(VENV)
	$(PY) -m sessionactors demo

demo-cluster: .venv/.extra-redis-$(HASH)
	$(PY) -m sessionactors demo-cluster

# The tests (and the soak runs) run in three processes (pytest-xdist): much of their
# time is spent waiting on servers, subprocesses and timeouts, so three are faster than
# two on 2 cores (clean-clone runs: 482-576 s of pytest against 604-633 s).
# TEST_PROCESSES=0 runs them in this one.
# (.ci/run starts one set of Redis servers for each process.)
TEST_PROCESSES ?= 3
# Many tests run the command line, a server or a worker in a process of its own: the
# package is compiled once first, or each such process compiles it again where Python
# writes no bytecode (PYTHONDONTWRITEBYTECODE set), about 0.2 s of CPU each.
COMPILE := $(PY) -m compileall -q sessionactors tests

test: .venv/.extra-test-$(HASH)
	$(COMPILE)
	$(PY) -m pytest -q -m "not soak" -n $(TEST_PROCESSES)

soak: .venv/.extra-test-$(HASH)
	$(COMPILE)
	$(PY) -m pytest -q -m soak -n $(TEST_PROCESSES)

lint: .venv/.extra-lint-$(HASH)
	$(PY) -m ruff check sessionactors tests benchmarks docs && $(PY) -m ruff format --check sessionactors tests benchmarks docs && $(PY) -m mypy && $(PY) tests/check_layers.py

bench: .venv/.extra-bench-$(HASH)
	$(PY) benchmarks/run.py

# bad inputs, corrupt stores and faults through the public API: benchmarks/results/edges.md
survey: .venv/.extra-test-$(HASH)
	$(PY) benchmarks/survey_edges.py

clean:
	rm -rf .venv .pytest_cache .mypy_cache .ruff_cache
