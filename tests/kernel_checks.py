"""Shared by the tests of the compiled CPU kernels (``test_cpu_kernel.py`` for 8-bit state,
``test_cpu_kernel_bf16.py`` for bfloat16 state): the skip for builds without the kernel, and
what a compiled program copies."""

import os

import pytest

NO_KERNEL = os.environ.get("OPTAX_DECOUPLED_NO_KERNEL") == "1"
needs_kernel = pytest.mark.skipif(
    NO_KERNEL, reason="OPTAX_DECOUPLED_NO_KERNEL=1: package built without the CPU kernel"
)


def entry_copies(hlo_text: str, type_prefix: str) -> list[str]:
    """The `copy` instructions of the entry computation of a compiled HLO module whose
    result type starts with `type_prefix` (copies inside fusions are not buffers)."""
    entry = hlo_text[hlo_text.index("\nENTRY ") :]
    return [
        line.strip()
        for line in entry.splitlines()
        if " copy(" in line and line.split("=", 1)[-1].strip().startswith(type_prefix)
    ]
