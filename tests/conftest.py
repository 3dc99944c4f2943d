"""Settings that make the suite mean the same on every backend.

* Float32 matrix products at full precision: on GPUs, XLA's default lets them run in TF32
  (about 1e-3 relative), which the tests' float64 and one-by-one comparisons would read as
  errors in the code under test. On CPU this changes nothing.
* ``--xla_gpu_deterministic_ops``: bit-exact checks (a resumed run equals an uninterrupted
  one) need GPU kernels without atomics-order nondeterminism; it is ignored on CPU. A
  user's own ``XLA_FLAGS`` are kept.
* Under pytest-xdist (the Makefile runs one worker per core), several processes share a GPU:
  each allocates on demand instead of taking 75% of its memory up front (a user's own
  ``XLA_PYTHON_CLIENT_PREALLOCATE`` is kept). On CPU this changes nothing.
"""

import os

_DETERMINISTIC = "--xla_gpu_deterministic_ops=true"
if "xla_gpu_deterministic_ops" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_DETERMINISTIC}".strip()

if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402  (after XLA_FLAGS: the backend reads them when it starts)
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

# Hypothesis: the unit tier (`make test`) draws few examples per property; the integration
# tier runs the property and fuzz tests again with HYPOTHESIS_PROFILE=thorough. Tests scale
# their counts from `settings.default.max_examples`, the loaded profile's.
from hypothesis import HealthCheck, settings  # noqa: E402

settings.register_profile("unit", max_examples=6, deadline=None)
settings.register_profile(
    "thorough", max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "unit"))


def pytest_collection_modifyitems(items):
    """A test module's ``SLOW_VARIANTS`` (test-name suffixes, such as chex's
    ``"__without_jit"``) marks those generated variants ``slow``: they run in the integration
    tier. Parametrized cases use ``pytest.param(..., marks=pytest.mark.slow)`` instead."""
    for item in items:
        suffixes = getattr(getattr(item, "module", None), "SLOW_VARIANTS", ())
        if suffixes and item.name.endswith(tuple(suffixes)):
            item.add_marker(pytest.mark.slow)
