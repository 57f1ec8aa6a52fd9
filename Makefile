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

# The tests run in three processes (pytest-xdist), on 2 cores too, as much of their time
# is spent waiting on servers, subprocesses and timeouts: in two processes they kept 1.4
# of 2 cores busy and took 633 s, in three 1.7 cores and 529-540 s. The soak runs, longer
# fault runs, keep to two. TEST_PROCESSES=0 runs the tests in this one. (.ci/run starts
# one set of Redis servers for each test process.)
TEST_PROCESSES ?= 3
SOAK_PROCESSES ?= 2
# Many tests run the command line, a server or a worker in a process of its own: the
# package is compiled once first, or each such process compiles it again where Python
# writes no bytecode (PYTHONDONTWRITEBYTECODE set), about 0.2 s of CPU each.
COMPILE := $(PY) -m compileall -q sessionactors tests

test: .venv/.extra-test-$(HASH)
	$(COMPILE)
	$(PY) -m pytest -q -m "not soak" -n $(TEST_PROCESSES)

soak: .venv/.extra-test-$(HASH)
	$(COMPILE)
	$(PY) -m pytest -q -m soak -n $(SOAK_PROCESSES)

lint: .venv/.extra-lint-$(HASH)
	$(PY) -m ruff check sessionactors tests benchmarks docs && $(PY) -m ruff format --check sessionactors tests benchmarks docs && $(PY) -m mypy && $(PY) tests/check_layers.py

bench: .venv/.extra-bench-$(HASH)
	$(PY) benchmarks/run.py

# bad inputs, corrupt stores and faults through the public API: benchmarks/results/edges.md
survey: .venv/.extra-test-$(HASH)
	$(PY) benchmarks/survey_edges.py

clean:
	rm -rf .venv .pytest_cache .mypy_cache .ruff_cache
