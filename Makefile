# Two commands start everything on a fresh machine with Python >= 3.10 and pip:
#   make demo   set up .venv and run `moremoe demo`
#   make test   set up .venv and run the whole test suite
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PYTEST_ARGS ?=

.PHONY: demo test setup clean

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

clean:
	rm -rf $(VENV) runs .pytest_cache
