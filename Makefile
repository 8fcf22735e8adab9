# The two commands a newcomer needs: `make demo` (the main job on simulated engines) and
# `make test`. Each sets up what it needs on a fresh machine first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
KVDIAG := $(VENV)/bin/kvdiag
STAMP := $(VENV)/.installed

.PHONY: demo test setup system-deps generate bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev,torch]'
	touch $(STAMP)

setup: $(STAMP)

system-deps:
	bash scripts/system-deps.sh

demo: $(STAMP)
	$(KVDIAG) demo

test: $(STAMP) system-deps
	bash scripts/engine-src.sh .cache/engine-src
	KVDIAG_ENGINE_SRC=$(CURDIR)/.cache/engine-src $(PY) -m pytest -q

generate: $(STAMP)
	$(KVDIAG) render

bench: $(STAMP)
	$(PY) bench/bench_exposition.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
