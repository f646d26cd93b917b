# The template's two commands (see README.md). Everything is installed into
# .venv from nothing: only python3 with venv/pip is assumed.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

# torch first, as the CPU wheel: an unpinned torch would pull a multi-GB CUDA
# build. The rest is what the template tests need to bake, lint and run the
# baked projects in one shared environment.
TORCH     := torch==2.13.0
TEST_DEPS := "cookiecutter>=2.6,<3" "pytest>=8" "ruff>=0.17,<0.18" \
             "hydra-core>=1.3.2,<1.4" "omegaconf>=2.3,<2.4" "accelerate>=1.2" \
             "safetensors>=0.4" "xxhash>=3.1" "numpy>=1.24" "tqdm>=4.66" "rich>=13" "pyyaml>=6" \
             "hydra-submitit-launcher>=1.2" "cruft>=2.15" "pytest-xdist>=3.5" \
             "uv>=0.13.8,<0.14"

.PHONY: demo test bench clean

# The engine (training_engine/, its own distribution) editable: the bakes' tests in
# this environment run the working tree's engine, as the baked pins name it.
$(STAMP): Makefile training_engine/pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/pip install -q $(TORCH)
	$(BIN)/pip install -q $(TEST_DEPS)
	$(BIN)/pip install -q --no-deps -e training_engine
	# bytecode, as pip writes it for an installed release: under PYTHONDONTWRITEBYTECODE
	# every process of the tests would compile the editable engine again (~0.16 s each)
	$(BIN)/python -m compileall -q training_engine/src
	touch $@

# Bake the template with its defaults, install the project, train the example.
demo: $(STAMP)
	rm -rf build/demo
	$(BIN)/cookiecutter --no-input --output-dir build/demo .
	$(BIN)/pip install -q -e build/demo/digit_trainer
	cd build/demo/digit_trainer && $(abspath $(BIN))/python train.py run_name=demo
	@$(BIN)/python -c "import json; s = json.load(open('build/demo/digit_trainer/runs/demo/summary.json')); \
	print(f\"\nrun dir: build/demo/digit_trainer/runs/demo\nval/acc: {s['metrics']['val/acc']:.4f}\")"

# The template's benchmark (bench/README.md) on a bake of the defaults: every figure
# against bare PyTorch, a few minutes. BENCH_ARGS=--quick for one tiny round.
bench: $(STAMP)
	rm -rf build/bench
	$(BIN)/cookiecutter --no-input --output-dir build/bench .
	$(BIN)/python bench/bench.py --project build/bench/digit_trainer $(BENCH_ARGS)

# The whole test suite: bakes every option value, lints and tests each bake,
# installs the default bake into a fresh virtual environment.
test: $(STAMP)
	$(BIN)/python -m pytest tests

clean:
	rm -rf build $(VENV)
