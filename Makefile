# Two commands start everything on a fresh machine with Python >= 3.10 and pip:
#   make demo   set up .venv and run `moremoe demo`
#   make test   set up .venv and run the whole test suite
# and one more that CI runs after them:
#   make test-cpus  the numerics-sensitive tests again as another CPU would run them: ATen's
#                   default and AVX2 kernels, one and two threads
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PYTEST_ARGS ?=

.PHONY: demo test test-cpus setup clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml scripts/install_torch.sh
	$(PYTHON) -m venv $(VENV)
	sh scripts/install_torch.sh $(BIN)/python
	$(BIN)/python -m pip install -e ".[test]"
	touch $@

demo: setup
	$(BIN)/moremoe demo

test: setup
	$(BIN)/python -m pytest $(PYTEST_ARGS)

NUMERICS = tests/kernels tests/ops tests/nn tests/model tests/hf tests/training/test_checkpoint.py \
           tests/training/test_lm_training.py tests/test_pipeline.py
test-cpus: setup
	ATEN_CPU_CAPABILITY=default OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q $(NUMERICS)
	ATEN_CPU_CAPABILITY=avx2 OMP_NUM_THREADS=2 $(BIN)/python -m pytest -q $(NUMERICS)

clean:
	rm -rf $(VENV) runs .pytest_cache
