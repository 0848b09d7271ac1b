# autotune: `make demo` runs the main job end to end; `make test` runs the whole suite.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# CPU build of torch, installed only when the venv has no torch yet
TORCH_SPEC ?= torch==2.13.0

.PHONY: install test lint typecheck demo clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# uv installs torch, the project and its extras in a fraction of pip's time (pip stays the
# fallback: 21 s against 3.5 s for torch alone); torch comes first, from a local wheel file where
# the machine has one ($PIP_FIND_LINKS, which pip reads and uv is given). Every installed package
# gets its bytecode as it is installed (uv --compile-bytecode; pip compiles by default): where
# PYTHONDONTWRITEBYTECODE is set, a package without it is compiled from source in every process
# that imports it (the service's imports took 2.9 CPU-seconds so, 1.1-1.3 with bytecode). uv's
# compile took 14 s on 2 cores where a compileall over site-packages after the install took 20.
# The Makefile is a prerequisite, so a venv made by an older one is brought up to date.
FIND_LINKS := $(if $(PIP_FIND_LINKS),--find-links $(PIP_FIND_LINKS))
UV_INSTALL := $(BIN)/uv pip install -q --compile-bytecode --python $(BIN)/python
$(VENV)/.installed: $(BIN)/python pyproject.toml Makefile
	@$(BIN)/python -m pip install -q uv || true
	@$(BIN)/python -c "import torch" 2>/dev/null \
		|| $(UV_INSTALL) $(FIND_LINKS) "$(TORCH_SPEC)" \
		|| $(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(UV_INSTALL) -e ".[dev,dashboard,hf]" || $(BIN)/python -m pip install -q -e ".[dev,dashboard,hf]"
	@touch $@

# The project's own bytecode (an editable install has none; compileall skips what is up to date).
# api and migrations by name: autotune/api and autotune/migrations are links, which compileall
# does not follow (every service start compiled the service's 36 modules from source so).
BYTECODE := $(BIN)/python -m compileall -q -j 0 autotune api migrations bench > /dev/null

install: $(VENV)/.installed

RUFF := $(BIN)/ruff check autotune api tests bench
MYPY := $(BIN)/mypy autotune bench  # autotune/api is the repository's api/

lint: install
	$(RUFF)
	$(MYPY)

# pytest-xdist: one test process more than there are cores (the tests wait on their services,
# workers and probe children about a tenth of the time: on 2 cores, three processes took 409 s
# where two took 441 right after); each takes the next module (a module-scoped fixture is set
# up once) as it gets free, the modules with slow tests first: tests/conftest.py orders them.
# `PYTEST_ARGS=-n0 make test` runs everything in one process.
TEST_PROCESSES := $(shell $(PYTHON) -c 'import os; print((os.cpu_count() or 1) + 1)')
PYTEST_ARGS ?= -n $(TEST_PROCESSES) --dist loadscope --no-loadscope-reorder
# mypy runs beside the suite (it fills the moments the tests wait on their subprocesses), at the
# lowest priority: with no cache (a clean clone) it takes ~40 CPU-seconds, which at equal priority
# it took from the tests while all three test processes were busy; its output follows the tests',
# and either failing fails `make test`.
# pytest runs with PYTHONDONTWRITEBYTECODE unset (where a host sets it): each test process then
# reads the test modules as pytest's assertion rewriting cached them (tests/**/__pycache__, ignored
# by git) instead of rewriting and compiling all of them again: collecting took 9.9 CPU-s a
# process so against 18.7 (a 2-core AMD EPYC host), from a run's second time on.
test: install
	@$(BYTECODE)
	$(RUFF)
	@nice -n 19 $(MYPY) > $(VENV)/mypy.log 2>&1 & mypy=$$!; \
	echo "$(BIN)/python -m pytest -q $(PYTEST_ARGS)   ($(MYPY) beside it)"; \
	env -u PYTHONDONTWRITEBYTECODE $(BIN)/python -m pytest -q $(PYTEST_ARGS); tests=$$?; \
	wait $$mypy; types=$$?; echo "$(MYPY)"; cat $(VENV)/mypy.log; \
	test $$tests -eq 0 && test $$types -eq 0

demo: install
	@$(BYTECODE)
	$(BIN)/autotune demo

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache demo-work
