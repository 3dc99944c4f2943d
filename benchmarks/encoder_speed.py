"""The 8-bit kernel's encoders timed side by side: the portable loop, the AVX-512 and the VBMI one.

Compiles ``benchmarks/encoder_speed.cc`` (which includes the kernel's source,
``optax_decoupled/csrc/requantize_cpu.cc``) with the flags ``setup.py`` builds the kernel
with, runs it on both maps, and prints nanoseconds per element for each encoder (one core,
256 KiB of gradient-like inputs in blocks of 256, best of ``--repeats`` passes, the encoders
in turns) and whether their codes agree. The portable loop is what the compiler makes of it
with ``-mtune=native`` on this CPU: where GCC does not know the CPU (e.g. an Intel Xeon of
family 6, model 207, with GCC 12), generic tuning, which writes the table lookup as scalar
loads (docs/memory_log.md).

    python benchmarks/encoder_speed.py [--repeats 300] [--json out.json]

Needs a C++ compiler (``CXX``, default ``g++``) and jax (for the XLA FFI headers).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys
import tempfile

from optax_decoupled import cpu_kernel

HERE = pathlib.Path(__file__).parent

#: The encoders the kernel has (the JSON's ``{key}_ns``), in the order the binary times them;
#: those the CPU cannot run are left out of its line.
ENCODERS = [
    ("portable", "portable loop"),
    ("avx2", "AVX2 gather"),
    ("avx512", "AVX-512 gather"),
    ("vbmi", "AVX-512 VBMI"),
]


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=300)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(HERE))
    import _common as C

    with tempfile.TemporaryDirectory() as tmp:
        binary = pathlib.Path(tmp) / "encoder_speed"
        C.build_kernel_harness(HERE / "encoder_speed.cc", binary)
        results = []
        for signed in (True, False):
            table = pathlib.Path(tmp) / f"table_{signed}.bin"
            cpu_kernel.encoder_table(signed).tofile(table)
            name = "signed" if signed else "unsigned"
            out = subprocess.run(
                [str(binary), str(table), name, str(args.repeats)],
                check=True, capture_output=True, text=True,
            )  # fmt: skip
            results.append(json.loads(out.stdout))
    env = {"cpu": C.machine_info().get("cpu"), "load_average_at_start": C.load_average(),
           "compiler": C.compiler(), "flags": C.KERNEL_FLAGS, "repeats": args.repeats}  # fmt: skip
    print(f"CPU: {env['cpu']}; {env['compiler']} {' '.join(env['flags'])}")
    columns = [(key, label) for key, label in ENCODERS if any(f"{key}_ns" in r for r in results)]
    print(
        "| map | "
        + " | ".join(f"{label} (ns/element)" for _, label in columns)
        + " | portable/fastest | same codes |"
    )
    print("|---|" + "---:|" * (len(columns) + 1) + "---|")
    for r in results:
        times = [r.get(f"{key}_ns") for key, _ in columns]
        cells = [f"{t:.3f}" if t else "—" for t in times]
        fastest = min(t for t in times if t)
        print(
            f"| {r['map']} | {' | '.join(cells)} | {r['portable_ns'] / fastest:.2f} "
            f"| {r['same_codes']} |"
        )
    if args.json:
        C.write_json(args.json, {"env": env, "results": results})
    if not all(r["same_codes"] for r in results):
        raise SystemExit("the encoders gave different codes")
    return results


if __name__ == "__main__":
    main()
