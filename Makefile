# The two commands of README.md: `make run` (the main job) and `make test` (the test suite).
VENV ?= .venv
PY := $(VENV)/bin/python
WORKERS ?= 2
PORT ?= 8000

.PHONY: install run test bench

$(PY):
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'

install: $(PY)

run: $(PY)
	$(VENV)/bin/kvroute up --workers $(WORKERS) --model tests/fixtures/tiny-model --served-model-name tiny --port $(PORT)

test: $(PY)
	$(PY) -m pytest -q -p no:cacheprovider tests
