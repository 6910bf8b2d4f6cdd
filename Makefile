# Fresh machine: `make demo` or `make test`; both create .venv and install first. The hf and
# torchft extras (about 1.5 minutes from PyPI) are part of it, so the Hugging Face and torchft
# peer tests run in CI too.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
# torch 2.13.0 from pip's configured index. PyPI's Linux wheel of it is the CUDA build (several
# GB); for the CPU-only build: make install TORCH_INDEX=https://download.pytorch.org/whl/cpu
TORCH := torch==2.13.0
TORCH_INDEX ?=

.PHONY: install demo test test-slow clean

$(BIN)/activate: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(TORCH) $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(BIN)/pip install -q -e '.[test,hf,torchft]'
	@# the codecs' fused CPU kernels (plain C, the system compiler); without one the torch path
	@# gives the same bits, slower
	$(BIN)/python -c "from lowcomm.codecs import _native; print('codec kernels:', _native.build())" \
		|| echo "codec kernels not built (no C compiler?): the torch path is used"
	touch $(BIN)/activate

install: $(BIN)/activate

# Every strategy on the same model, data and seed: 2 workers, small model, 200 inner steps each.
DEMO_STRATEGIES := ddp,loco,diloco:sync_every=25,streaming:sync_every=25,sparseloco,co2:sync_every=25
demo: install
	$(BIN)/lowcomm compare --strategies $(DEMO_STRATEGIES) --model small --workers 2 --steps 200 \
		--out runs/demo batch_size=8 eval_every=50 eval_batches=8 warmup_steps=20

test: install
	$(BIN)/ruff check src tests
	$(BIN)/ruff format --check src tests
	$(BIN)/python -m pytest

test-slow: install
	$(BIN)/python -m pytest -m slow

clean:
	rm -rf $(VENV) runs build src/*.egg-info
