"""The 8-bit kernel's work per block for AdamW: Adam's output in a pass of its own or in the others.

Compiles ``benchmarks/kernel_pipeline.cc`` (which includes the kernel's source,
``optax_decoupled/csrc/requantize_cpu.cc``) with the flags ``setup.py`` builds the kernel
with and runs what one of the kernel's paths (``--path``: the AVX-512 VBMI one, default, the
AVX-512F one or the AVX2 one) does for each block of 256 elements of an AdamW update with
its output (the gradient an argument of the step, or a training step): decode and update mu
and nu, compute Adam's output, encode both moments. Two ways, side by side in one run, in
turns: ``separate``, the output as a pass of its own after the moments' (``AdamOutBlock``;
the VBMI and AVX2 paths' way before 2026-12-06's nineteenth session, and still the portable
path's), and ``in_passes``, nu's pass storing the output's denominator and mu's pass, run
after it, the output (``AdamPart``, their way now). On the AVX-512F path ``separate`` is
that path's code before the twenty-first session, whose moments' passes also left each
block's max to a pass of its own (``AbsMaxBits``); ``in_passes`` is its code now. Prints
nanoseconds per element for each (one core, 128 KiB of gradient-like inputs, best of
``--repeats`` steps) and whether their codes, scales and outputs agree bit for bit.

    python benchmarks/kernel_pipeline.py [--path vbmi|avx512f|avx2] [--repeats 300]
    python benchmarks/kernel_pipeline.py --path avx512f --json out.json

Needs a C++ compiler (``CXX``, default ``g++``), jax (for the XLA FFI headers) and an x86-64
CPU with the path's instructions (AVX-512 VBMI and VBMI2, AVX-512F, or AVX2); elsewhere it
says so and times nothing.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys
import tempfile

import numpy as np

from optax_decoupled import cpu_kernel, quantization

HERE = pathlib.Path(__file__).parent

#: The kernel's paths the harness runs: the AVX-512 VBMI decode and encoder, the AVX-512F
#: register-permute decode and gather encoder, and the AVX2 ones.
PATHS = ("vbmi", "avx512f", "avx2")
#: What each needs.
NEEDS = {"vbmi": "AVX-512 VBMI and VBMI2", "avx512f": "AVX-512F", "avx2": "AVX2"}
#: The two ways (the JSON's ``{key}_ns``), in the order the binary times them.
WAYS = [("separate", "output as a pass of its own"), ("in_passes", "output in the passes")]


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--path", choices=PATHS, default="vbmi", help="the kernel's path")
    parser.add_argument("--repeats", type=int, default=300, help="steps per way (the best counts)")
    parser.add_argument("--json", help="write the result here")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")
    sys.path.insert(0, str(HERE))
    import _common as C

    with tempfile.TemporaryDirectory() as tmp:
        binary = pathlib.Path(tmp) / "kernel_pipeline"
        C.build_kernel_harness(HERE / "kernel_pipeline.cc", binary)
        files = []
        for kind in ("table", "map"):
            for signed in (True, False):
                path = pathlib.Path(tmp) / f"{kind}_{'signed' if signed else 'unsigned'}.bin"
                if kind == "table":
                    cpu_kernel.encoder_table(signed).astype(np.int32).tofile(path)
                else:
                    quantization.dynamic_map(signed).astype(np.float32).tofile(path)
                files.append(str(path))
        out = subprocess.run(
            [str(binary), *files, str(args.repeats), args.path],
            check=True,
            capture_output=True,
            text=True,
        )
        result = json.loads(out.stdout)
    env = {"cpu": C.machine_info().get("cpu"), "load_average_at_start": C.load_average(),
           "compiler": C.compiler(), "flags": C.KERNEL_FLAGS, "repeats": args.repeats}  # fmt: skip
    print(f"CPU: {env['cpu']}; {env['compiler']} {' '.join(env['flags'])}; path: {args.path}")
    if not result["available"]:
        print(f"this CPU has no {NEEDS[args.path]}: the kernel's {args.path} path does not run")
    else:
        result["ratio"] = result["in_passes_ns"] / result["separate_ns"]
        print("| " + " | ".join(f"{label} (ns/element)" for _, label in WAYS) + " | ratio | same |")
        print("|---:|---:|---:|---|")
        print(
            f"| {result['separate_ns']:.3f} | {result['in_passes_ns']:.3f} "
            f"| {result['ratio']:.3f} | {result['same_results']} |"
        )
    if args.json:
        C.write_json(args.json, {"env": env, "result": result})
    if result["available"] and not result["same_results"]:
        raise SystemExit("the two ways gave different codes, scales or outputs")
    return result


if __name__ == "__main__":
    main()
