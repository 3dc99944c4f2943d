"""The compiler flags of the C++ CPU kernel, in one place.

Read (not imported: the package may not be importable while it is being built) by
``setup.py``, which builds ``requantize_cpu.cc`` with them, and by the benchmarks' C++
harnesses (``benchmarks/_common.py``: ``encoder_speed``, ``kernel_pipeline``), which include
the kernel's source and compile it the same way. Plain data: no imports.
"""

#: Always passed. Neither ``-fno-math-errno`` nor ``-fno-trapping-math`` changes a result (no
#: errno from libm, no FP exception flags to preserve; they let ``std::ceil`` vectorize);
#: ``-ffp-contract=off`` multiplies and adds separately, as ``jnp`` writes them (a fused
#: multiply-add rounds once).
COMPILE_FLAGS = [
    "-O3",
    "-std=c++17",
    "-fvisibility=hidden",
    "-Wno-sign-compare",
    "-fno-math-errno",
    "-fno-trapping-math",
    "-ffp-contract=off",
]

#: Flags that only tune instruction choice and scheduling for the CPU that builds the package
#: (where pip installs it, as a rule). They change no result and no instruction set: the
#: kernel's target clones still pick AVX-512, AVX2 or baseline code at run time. On Zen 5,
#: -mtune=native makes the kernel about 9% faster (docs/memory.md). Passed only where the
#: compiler accepts them.
TUNING_FLAGS = ["-mtune=native"]
