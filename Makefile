# Fresh machine: `make demo` or `make test`; both create .venv and install first.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
# The CPU build of torch 2.13.0 lies on this disk; naming it stops pip from pulling a CUDA build.
TORCH := torch==2.13.0

.PHONY: install demo test test-slow clean

$(BIN)/activate: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(TORCH)
	$(BIN)/pip install -q -e '.[test]'
	touch $(BIN)/activate

install: $(BIN)/activate

demo: install
	$(BIN)/lowcomm compare --strategies ddp,diloco --model small --workers 4 --steps 300 --out runs/demo sync_every=50

test: install
	$(BIN)/python -m pytest

test-slow: install
	$(BIN)/python -m pytest -m slow

clean:
	rm -rf $(VENV) runs build src/*.egg-info
