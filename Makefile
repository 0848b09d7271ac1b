# autotune: `make demo` runs the main job end to end; `make test` runs the whole suite.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# CPU build of torch, installed only when the venv has no torch yet
TORCH_SPEC ?= torch==2.13.0

.PHONY: install test lint typecheck demo clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# uv installs the project and its extras in a fraction of pip's time (pip stays the fallback);
# torch comes first through pip, which finds a local wheel file where the machine has one.
$(VENV)/.installed: $(BIN)/python pyproject.toml
	@$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	@$(BIN)/python -m pip install -q uv || true
	$(BIN)/uv pip install -q --python $(BIN)/python -e ".[dev,dashboard]" \
		|| $(BIN)/python -m pip install -q -e ".[dev,dashboard]"
	@touch $@

install: $(VENV)/.installed

RUFF := $(BIN)/ruff check autotune api tests bench
MYPY := $(BIN)/mypy autotune api bench

lint: install
	$(RUFF)
	$(MYPY)

# pytest-xdist: one test process per core; each takes the next module (a module-scoped fixture is
# set up once) as it gets free, the modules with slow tests first: tests/conftest.py orders them.
# `PYTEST_ARGS=-n0 make test` runs everything in one process.
PYTEST_ARGS ?= -n auto --dist loadscope --no-loadscope-reorder
# mypy runs beside the suite (it fills the moments the tests wait on their subprocesses); its
# output follows the tests', and either failing fails `make test`.
test: install
	$(RUFF)
	@$(MYPY) > $(VENV)/mypy.log 2>&1 & mypy=$$!; \
	echo "$(BIN)/python -m pytest -q $(PYTEST_ARGS)   ($(MYPY) beside it)"; \
	$(BIN)/python -m pytest -q $(PYTEST_ARGS); tests=$$?; \
	wait $$mypy; types=$$?; echo "$(MYPY)"; cat $(VENV)/mypy.log; \
	test $$tests -eq 0 && test $$types -eq 0

demo: install
	$(BIN)/autotune demo

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache demo-work
