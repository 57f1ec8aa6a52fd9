# Every target creates .venv and installs what it needs on its own.
PY := .venv/bin/python
STAMP := .venv/.installed-$(shell cksum pyproject.toml | cut -d' ' -f1)

.PHONY: install demo demo-cluster test soak lint bench clean

$(STAMP): pyproject.toml
	python3 -m venv .venv && $(PY) -m pip install -q --upgrade pip && $(PY) -m pip install -q -e '.[dev,bench]' && touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) -m sessionactors demo

demo-cluster: $(STAMP)
	$(PY) -m sessionactors demo-cluster

test: $(STAMP)
	$(PY) -m pytest -q -m "not soak"

soak: $(STAMP)
	$(PY) -m pytest -q -m soak

lint: $(STAMP)
	$(PY) -m ruff check src tests benchmarks docs && $(PY) -m ruff format --check src tests benchmarks docs && $(PY) -m mypy

bench: $(STAMP)
	$(PY) benchmarks/run.py

clean:
	rm -rf .venv .pytest_cache .mypy_cache .ruff_cache
