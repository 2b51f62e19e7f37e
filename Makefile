# The two commands a new user runs: `make demo` and `make test`. Only python3 is needed.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint format protos bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	@# setuptools' note on editable installs is informational only: keep the install quiet.
	PYTHONWARNINGS='ignore:Editable installation' $(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

# e.g. `make demo DEMO_ARGS=--stay`: the detectors' web pages stay up after the demo, until Ctrl-C.
demo: $(STAMP)
	@$(BIN)/stablewatch demo $(DEMO_ARGS)

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python -m pytest

lint: $(STAMP)
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

protos: $(STAMP)
	$(BIN)/python protos/generate.py

bench: $(STAMP)
	$(BIN)/python bench/predicates.py

clean:
	rm -rf $(VENV) build *.egg-info
