"""Builds the optional C++ CPU kernel (``optax_decoupled/csrc/requantize_cpu.cc``).

Everything else is configured in pyproject.toml. The kernel is an XLA FFI handler compiled
against the FFI headers that jaxlib ships (``jax.ffi.include_dir()``). It is optional: without
a C++ compiler the build goes on without it and 8-bit state uses XLA's own program
(``optax_decoupled.cpu_kernel.available()`` is then ``False``).
"""

import os

from setuptools import Extension, setup


def _ffi_include_dir():
    try:
        import jax.ffi

        return jax.ffi.include_dir()
    except Exception:  # noqa: BLE001 - no jax in the build environment: no kernel
        return None


def _extensions():
    include = _ffi_include_dir()
    if include is None or os.environ.get("OPTAX_DECOUPLED_NO_KERNEL") == "1":
        return []
    flags = ["-O3", "-std=c++17", "-fvisibility=hidden", "-Wno-sign-compare"]
    # Neither changes a result: no errno from libm, no FP exception flags to preserve (they let
    # std::ceil vectorize).
    flags += ["-fno-math-errno", "-fno-trapping-math"]
    # Multiply and add separately, as jnp writes them (a fused multiply-add rounds once).
    flags.append("-ffp-contract=off")
    return [
        Extension(
            "optax_decoupled._requantize_cpu",
            sources=["optax_decoupled/csrc/requantize_cpu.cc"],
            include_dirs=[include],
            language="c++",
            extra_compile_args=flags,
            optional=True,
        )
    ]


setup(ext_modules=_extensions())
