"""Where and with what an experiment runs: versions, devices, host, and the size asked for.

:func:`versions` and :func:`environment` are recorded with every ``results.json``;
:func:`smoke_requested` reads ``OPTAX_DECOUPLED_SMOKE``, with which CI runs every experiment
at its smallest size.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import os
import platform
from typing import Any

import jax
import numpy as np
import optax

import optax_decoupled as od


def smoke_requested() -> bool:
    """True if the environment variable ``OPTAX_DECOUPLED_SMOKE`` is 1, true or yes."""
    return os.environ.get("OPTAX_DECOUPLED_SMOKE", "").strip().lower() in ("1", "true", "yes")


def versions() -> dict[str, str]:
    """Versions of Python, jax, jaxlib, optax, numpy and this package."""
    return {
        "python": platform.python_version(),
        "jax": jax.__version__,
        "jaxlib": _jaxlib_version(),
        "optax": optax.__version__,
        "numpy": np.__version__,
        "optax_decoupled": od.__version__,
    }


def environment() -> dict[str, Any]:
    """Versions, device and host, for the report's header and every results file."""
    devices = jax.devices()
    return {
        "optax_decoupled": od.__version__,
        "jax": jax.__version__,
        "jaxlib": _jaxlib_version(),
        "optax": optax.__version__,
        "python": platform.python_version(),
        "backend": jax.default_backend(),
        "devices": [str(d) for d in devices],
        "device_kind": devices[0].device_kind,
        "cpu_count": os.cpu_count(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def _jaxlib_version() -> str:
    """The installed jaxlib's version (from its distribution's metadata)."""
    try:
        return importlib.metadata.version("jaxlib")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"
