# The two commands a newcomer needs: `make demo` (the main job on simulated engines) and
# `make test`. Each sets up what it needs on a fresh machine first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
KVDIAG := $(VENV)/bin/kvdiag
# Two installs: the light one is what kvdiag itself needs (the demo) and mypy, which compiles the
# reference pool (scripts/build-native.py); the full one adds the test tools and torch, which only
# the reference pool's storage tests use.
LIGHT := $(VENV)/.installed-light
FULL := $(VENV)/.installed-full

.PHONY: demo test setup system-deps native generate bench clean real-envs validate-real test-whatif-real

$(LIGHT): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[native]'
	touch $@

# The torch extra pins the CPU build (torch==2.13.0+cpu, a local wheel on the project's
# machines); a CUDA build must never get in: it is gigabytes and the tests would not be the
# ones CI runs, so the install fails loudly if torch reports CUDA.
$(FULL): $(LIGHT)
	$(PY) -m pip install -q -e '.[dev,torch]'
	$(PY) -c 'import sys, torch; sys.exit("torch " + torch.__version__ + " is a CUDA build (CUDA " + str(torch.version.cuda) + "): the tests need the CPU build torch==2.13.0+cpu") if torch.version.cuda else None'
	touch $@

setup: $(FULL)

system-deps:
	bash scripts/system-deps.sh

# The reference pool's compiled build (kvdiag/refpool/native.py): the script returns at once when
# the build on disk is current. The demo runs from source where it cannot compile (no C compiler);
# the tests need it (tests/refpool/test_native.py fails under CI without it).
native: $(LIGHT)
	$(PY) scripts/build-native.py

demo: $(LIGHT)
	-$(PY) scripts/build-native.py
	$(KVDIAG) demo

# The real engines' environments (scripts/real-env.sh): built once per machine into a per-user
# cache outside the clone (about 3.5 GB each, 4 minutes each the first time), a no-op when current.
real-envs:
	bash scripts/real-env.sh vllm >/dev/null
	bash scripts/real-env.sh sglang >/dev/null

# The whole real catalogue on both real engines (docs/real-engines.md), about an hour on 2 cores.
validate-real: $(LIGHT) real-envs
	$(KVDIAG) validate --real

# whatif against real re-runs of each remedy (issue 29): about 25 minutes of real-engine runs, so
# outside `make test` until its pairs hold; docs/whatif-real.md has the last table.
test-whatif-real: $(FULL) real-envs
	CI=true $(PY) -m pytest -q tests/real/test_whatif_real.py

test: $(FULL) system-deps native real-envs
	bash scripts/engine-src.sh .cache/engine-src
	bash scripts/oracle-env.sh .cache/oracle-venv
	KVDIAG_ENGINE_SRC=$(CURDIR)/.cache/engine-src $(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder \
		--ignore=tests/real/test_whatif_real.py

generate: $(LIGHT)
	$(KVDIAG) render

bench: native
	$(PY) bench/bench_exposition.py
	$(PY) bench/bench_cli.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis .cache/native-build kvdiag/refpool/native.json
	find kvdiag -name '*.so' -delete
