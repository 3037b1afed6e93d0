# `make demo` and `make test` work on a fresh machine: the first use creates .venv/ and installs
# everything pinned (requirements.txt), then builds verl_mega (and its kernels) without build isolation,
# so the build uses the pinned torch already in the venv instead of pulling another one.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast venv clean

$(STAMP): requirements.txt setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip==25.3 setuptools==80.9.0 wheel==0.45.1
	$(PY) -m pip install -q -r requirements.txt
	$(PY) -m pip install -q --no-build-isolation --no-deps -e .
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m verl_mega.demo

test: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m pytest -q tests

# Skips the tests marked slow (multi-process and end-to-end); CI runs everything.
test-fast: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -m "not slow" tests

clean:
	rm -rf $(VENV) build *.egg-info
