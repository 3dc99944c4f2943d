# optax-decoupled: everything a user or CI runs goes through these targets.
# A fresh machine needs only python3 (>= 3.10) with venv; `make` creates .venv and installs.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
SCALE  ?= quick
OUT    ?= results

.PHONY: install test lint report example docs notebooks clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e ".[experiments,notebooks,dev]"
	touch $(STAMP)

install: $(STAMP)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# The test command of the README and of CI: lint, the suite, and every notebook at smoke size.
# Tests run in TEST_WORKERS pytest-xdist processes: one per core, at most 4 (each is a JAX
# process of its own, a GiB or two; 0 runs them in this process). Compiling is single-threaded,
# so two workers take the suite from 11.5 to 8.5 minutes on 2 cores (AMD EPYC, Zen 5; 11-19
# minutes on 2 cores of an Intel Xeon, 16-18 on a Zen 4 EPYC, 18 on a Zen 3, 20-24 on a Zen 1).
TEST_WORKERS ?= $(shell $(PYTHON) -c "import os; n = min(4, len(os.sched_getaffinity(0))); print(n if n > 1 else 0)" 2>/dev/null || echo 0)

test: lint
	OPTAX_DECOUPLED_SMOKE=1 $(BIN)/python -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) \
		tests --nbmake notebooks

# The main job: the comparison report at its CPU-sized default scale.
report: $(STAMP)
	$(BIN)/optax-decoupled report --scale $(SCALE) --out $(OUT)

# The README's Flax NNX example, end to end.
example: $(STAMP)
	$(BIN)/python examples/nnx_train_step.py

# Run every notebook top to bottom at its default size and store the outputs in the .ipynb files
# (what the docs site shows; tests/test_notebooks.py checks they are there and error-free).
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
	rm -rf $(VENV) build dist *.egg-info .pytest_cache .ruff_cache
