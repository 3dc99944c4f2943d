# optax-decoupled: everything a user or CI runs goes through these targets.
# A fresh machine needs only python3 (>= 3.10) with venv; `make` creates .venv and installs.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
SCALE  ?= quick
OUT    ?= results

.PHONY: install test test-integration test-all lint report example docs notebooks clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e ".[experiments,notebooks,dev]"
	touch $(STAMP)

install: $(STAMP)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# Tests run in TEST_WORKERS pytest-xdist processes: one per core, at most 4 (each is a JAX
# process of its own, a GiB or two; 0 runs them in this process).
TEST_WORKERS ?= $(shell $(PYTHON) -c "import os; n = min(4, len(os.sched_getaffinity(0))); print(n if n > 1 else 0)" 2>/dev/null || echo 0)
# The tests share JAX's persistent compilation cache in .jax_cache/ (ignored by git; `make
# clean` empties it): a program that several tests, both workers or both tiers compile is
# compiled once, and a second `make test` loads most programs from it. A
# JAX_COMPILATION_CACHE_DIR of your own is used instead.
JAX_CACHE ?= $(CURDIR)/.jax_cache
PYTEST := OPTAX_DECOUPLED_SMOKE=1 JAX_COMPILATION_CACHE_DIR="$${JAX_COMPILATION_CACHE_DIR:-$(JAX_CACHE)}" \
	JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0 $(BIN)/python -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist worksteal

# The test command of the README and of CI: lint, then the unit tier (every reference,
# golden, property and bad-input test, the experiments' small tests and the doctests of the
# package's docstrings; the experiments' modules are left out of the doctest collection, so
# it needs only the core's dependencies). About 4 minutes on 2 cores.
test: lint
	$(PYTEST) tests optax_decoupled --doctest-modules -m "not slow" --durations=15 \
		--ignore=tests/integration --ignore=optax_decoupled/experiments

# The integration tier (tests/integration/): every notebook at smoke size, the wheel in a
# clean virtual environment, multi-device programs, whole training runs, the CLI end to end
# and the benchmark scripts at toy size; then the unit tests marked slow (compile-heavy
# variants) and the property and fuzz tests with the thorough Hypothesis profile.
test-integration: $(STAMP)
	$(PYTEST) tests/integration --nbmake notebooks
	$(PYTEST) tests -m slow --ignore=tests/integration
	HYPOTHESIS_PROFILE=thorough $(PYTEST) tests/test_properties.py tests/test_fuzz.py

test-all: test test-integration

# The main job: the comparison report at its CPU-sized default scale.
report: $(STAMP)
	$(BIN)/optax-decoupled report --scale $(SCALE) --out $(OUT)

# The README's Flax NNX example, end to end.
example: $(STAMP)
	$(BIN)/python examples/nnx_train_step.py

# Run every notebook top to bottom at its default size and store the outputs in the .ipynb files
# (what the docs site shows; tests/integration/test_notebooks.py checks them).
notebooks: $(STAMP)
	env -u OPTAX_DECOUPLED_SMOKE $(BIN)/jupyter nbconvert --to notebook --execute --inplace \
		--ExecutePreprocessor.timeout=1800 notebooks/*.ipynb

# The documentation site (Sphinx + MyST-NB, docstrings via autodoc) -> build/docs/html, with
# warnings as errors as in CI. Notebooks are rendered with their stored outputs (`make
# notebooks` regenerates them); NB_EXECUTE=cache or =force runs them again inside the build.
docs: $(STAMP)
	$(BIN)/python -c "import sphinx, myst_nb, furo" 2>/dev/null || $(BIN)/python -m pip install -q -e ".[docs]"
	$(BIN)/sphinx-build -W --keep-going -b html -D nb_execution_mode=$(or $(NB_EXECUTE),off) docs build/docs/html

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache .ruff_cache .jax_cache
