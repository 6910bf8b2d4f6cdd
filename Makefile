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

.PHONY: install demo test test-slow gpu-wheels gpu-check clean

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

# The GPU check, on a machine with one GPU and torch with CUDA, transformers and pytest already
# there (no network, no .venv): the cuda tests, a train per strategy, the codecs and the sync on
# the device, one table. Elastic runs need torchft: `make gpu-wheels` here first, then carry
# .whl/ along (the check installs those wheels and nothing else).
GPU_PY ?= python3
gpu-check:
	PYTHON=$(GPU_PY) bash scripts/gpu_check.sh

# torchft and what it imports, as Python 3.12 wheels for the GPU machine, into .whl/
GPU_WHEELS := torchft-nightly==2026.10.26 opentelemetry-api==1.45.2 opentelemetry-sdk==1.45.2 \
	opentelemetry-exporter-otlp-proto-http==1.45.2 opentelemetry-exporter-otlp-proto-common==1.45.2 \
	opentelemetry-proto==1.45.2 opentelemetry-semantic-conventions==0.66b2 \
	opentelemetry-exporter-http-transport==0.66b2 opentelemetry-exporter-otlp-common==0.66b2 \
	googleapis-common-protos==1.76.0
gpu-wheels: install
	$(BIN)/pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		--platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl $(GPU_WHEELS)

clean:
	rm -rf $(VENV) runs build src/*.egg-info
