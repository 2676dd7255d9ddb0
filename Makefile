# The README's two commands: `make demo` and `make test`. Everything they need is set up here.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
export OMP_NUM_THREADS ?= 1
export TOKENIZERS_PARALLELISM := false
export RAY_USAGE_STATS_ENABLED := 0

.PHONY: demo test test-fast test-sglang lint bench clean setup

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	# torch first and pinned (SGLang 0.5.23 pins it): the dev machines carry its wheel locally.
	$(BIN)/python -m pip install --quiet torch==2.14.1
	# SGLang beside slimrl, as on GPU clusters: the real server is the referee of the test suite.
	$(BIN)/python -m pip install --quiet -e ".[dev,sglang]"
	$(BIN)/python -m pip check
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python launch/demo.py

# Two workers (the CI machine's two cores): each test module is one unit of work, the heaviest
# first (tests/conftest.py); a single worker leaves a quarter of the machine idle while tests wait
# on servers and processes start.
XDIST := -n 2 --dist loadfile --no-loadscope-reorder

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/python -m pytest tests -q $(XDIST)

# A change's first check: everything but the slow end-to-end tests.
test-fast: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/python -m pytest tests -q -m "not slow" $(XDIST)

# The real-SGLang tier alone (SGLang 0.5.23's server and code as the referee).
test-sglang: $(STAMP)
	$(BIN)/python -m pytest tests -q -m sglang

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

bench: $(STAMP)
	$(BIN)/python bench/run_all.py

clean:
	rm -rf runs .pytest_cache
