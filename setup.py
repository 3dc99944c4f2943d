"""Builds the optional C++ CPU kernel (``optax_decoupled/csrc/requantize_cpu.cc``).

Everything else is configured in pyproject.toml. The kernel is an XLA FFI handler compiled
against the FFI headers that jaxlib ships (``jax.ffi.include_dir()``). It is optional: without
a C++ compiler the build goes on without it and 8-bit state uses XLA's own program
(``optax_decoupled.cpu_kernel.available()`` is then ``False``).
"""

import hashlib
import os
import pathlib
import runpy
import tempfile

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

#: COMPILE_FLAGS and TUNING_FLAGS (the latter kept only where the compiler accepts them), shared
#: with the benchmarks' C++ harnesses. Read by path: the package is not importable mid-build.
_FLAGS = runpy.run_path(
    str(pathlib.Path(__file__).resolve().parent / "optax_decoupled" / "csrc" / "build_flags.py")
)
TUNING_FLAGS = _FLAGS["TUNING_FLAGS"]

#: The kernel's one source file. Its SHA-256 is compiled into the library
#: (``cpu_kernel.source_matches_build``): the extension is optional, so a change that does not
#: compile leaves the previous library in place, silently, and a checkout could run it.
SOURCE = "optax_decoupled/csrc/requantize_cpu.cc"


def _source_sha256():
    return hashlib.sha256(
        (pathlib.Path(__file__).resolve().parent / SOURCE).read_bytes()
    ).hexdigest()


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
    flags = list(_FLAGS["COMPILE_FLAGS"])
    return [
        Extension(
            "optax_decoupled._requantize_cpu",
            sources=[SOURCE],
            include_dirs=[include],
            define_macros=[("OD_SOURCE_SHA256", f'"{_source_sha256()}"')],
            language="c++",
            extra_compile_args=flags,
            optional=True,
        )
    ]


def _compiler_accepts(compiler, flag):
    with tempfile.TemporaryDirectory() as tmp:
        source = os.path.join(tmp, "flag_check.cc")
        with open(source, "w") as f:
            f.write("int main() { return 0; }\n")
        try:
            compiler.compile([source], output_dir=tmp, extra_postargs=[flag])
        except Exception:  # noqa: BLE001 - any failure: leave the flag out
            return False
    return True


class _BuildExt(build_ext):
    """build_ext that adds the TUNING_FLAGS this compiler accepts."""

    def build_extensions(self):
        tuning = [f for f in TUNING_FLAGS if _compiler_accepts(self.compiler, f)]
        for ext in self.extensions:
            ext.extra_compile_args = list(ext.extra_compile_args) + tuning
        super().build_extensions()


setup(ext_modules=_extensions(), cmdclass={"build_ext": _BuildExt})
