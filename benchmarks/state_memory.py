"""8-bit block-wise vs float32 (and bfloat16) AdamW state: step time and state bytes.

One run measures every size side by side. For each size N the parameters are one float32
matrix of shape (round(N / 1024), 1024) (a multiple of the block size, as real layers are);
``--ragged`` adds a (N / 1000, 1000) matrix whose size is not a multiple of 256 (padding path).
``--leaves K`` splits the N parameters into K such matrices, (round(N / K / 1024), 1024)
each, as a model's layers are: the optimizer then runs K kernel calls per step (in order,
``optax_decoupled.storage.KernelOrder``), and the program's temporaries are one leaf's.
The timed step is ``update`` + ``apply_updates`` of ``optax_decoupled.adamw`` (or, with
``--optimizer``, ``amsgrad`` or ``lion``), jitted with the parameters and the state donated
(updated in place), as in a training loop. Each other
dtype is timed in turns with float32, in blocks of ``--block`` steps of one program (fp32 x5,
int8 x5, fp32 x5, ...; then fp32, bf16, ...), the first step of each block not counted, so
that a machine shared with other jobs slows both alike while each program is timed as a
training loop runs it, one program step after step. Its ratio is taken against the float32
steps of its own turns; medians of the ``--repeats`` blocks' steps are reported. ``int8`` is
the default 8-bit storage (on CPU the compiled kernel, ``optax_decoupled.cpu_kernel``);
``int8-loop`` is the same storage with ``cpu_kernel=False`` (XLA's chunk loop). Likewise
``bfloat16`` is the default bfloat16 storage (on CPU the compiled kernel for bfloat16
moments), ``bfloat16-xla`` the same with ``cpu_kernel=False`` (XLA's own program) and
``bfloat16-sr`` bfloat16 storage with stochastic rounding (on CPU the same kernel). ``--dtypes``
times a subset (float32 always).

Why blocks: a step right after another program's step is not a training loop's step. On
the project's 2-core Xeon (docs/memory_log.md) the float32 step at 1e7 took 9.2 ms in a
loop of its own and 10.6-12.2 ms alternating step by step with the 8-bit one, whose step
slowed less (15 against 16 ms): alternating single steps (``--rotation pairs``, the
protocol before 2026-12-02's third session) flattered the 8-bit ratio at 1e7 by about 10%.
The first step of a block still shows it (10.6 ms, then 9.3-9.7), so it is not counted.
``--rotation all`` times all dtypes in one rotation of single steps (fp32, bf16, bf16-xla,
int8, int8-loop, fp32, ...), which also makes the programs with big temporaries slower, as
glibc's allocator then maps fresh memory for them more often. For the same reason the
allocator's settings matter: under glibc, XLA's per-step temporaries above 32 MiB are mapped
afresh on every step unless e.g. ``GLIBC_TUNABLES=glibc.malloc.arena_max=1:glibc.malloc.``
``mmap_max=0:glibc.malloc.trim_threshold=4000000000`` is set (docs/memory.md, Allocator
settings); the run
records them.

``--step train`` times a training step instead: the same update after the gradient of
``sum(tanh(x @ w))`` for a batch ``x`` of 4 rows, computed in the step. There the gradient is
a temporary of the program, and the 8-bit kernel writes the transform's output in its buffer
(``optax_decoupled.cpu_kernel.requantize_ema``); with the gradient an argument it cannot.
``--wrap apply_if_finite`` times every program with its transform wrapped in
``optax.apply_if_finite(tx, 3)`` (the update inside ``jax.lax.cond``, where the 8-bit kernel
writes a copy of the old codes instead of the output even in a training step).

    python benchmarks/state_memory.py                    # 1e6, 1e7, 5e7
    python benchmarks/state_memory.py --sizes 1e6 --repeats 5 --json out.json
    python benchmarks/state_memory.py --rotation pairs  # single steps in turns (before)
    python benchmarks/state_memory.py --step train --dtypes int8
    python benchmarks/state_memory.py --step train --wrap apply_if_finite --dtypes int8
    python benchmarks/state_memory.py --sizes 2e7 --leaves 20   # 20 matrices of 1e6
    python benchmarks/state_memory.py --decode avx512f   # the 8-bit kernel's AVX-512F path
    python benchmarks/state_memory.py --optimizer lion --dtypes int8

Targets (issue 6): int8 state <= 0.27x float32 for large tensors; step time <= 1.5x float32.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import optax_decoupled as od
from optax_decoupled import cpu_kernel, memory
from optax_decoupled._src.storage import BlockwiseInt8Storage, FloatStorage

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common as C  # noqa: E402

#: The state dtypes this benchmark can time (float32 first: the anchor) and their column labels.
LABELS = {
    "float32": "fp32",
    "bfloat16": "bf16",
    "bfloat16-xla": "bf16, XLA",
    "bfloat16-sr": "bf16 stochastic",
    "int8": "int8",
    "int8-loop": "int8, XLA loop",
}
STATE_DTYPES = tuple(LABELS)
#: Environment variables that tune glibc's or jemalloc's allocator (recorded with the results).
MALLOC_ENV = ("GLIBC_TUNABLES", "MALLOC_", "LD_PRELOAD")


def _storage(name):
    # "int8" and "bfloat16" are the default storages (on CPU: the compiled kernels when they
    # are built); "int8-loop" and "bfloat16-xla" the same storages with XLA's own programs.
    if name == "int8-loop":
        return BlockwiseInt8Storage(cpu_kernel=False)
    if name == "bfloat16-xla":
        return FloatStorage(jnp.bfloat16, "bfloat16", cpu_kernel=False)
    if name == "bfloat16-sr":
        return FloatStorage(jnp.bfloat16, "bfloat16", rounding="stochastic")
    return name


#: What ``--wrap`` puts around the transform: nothing, or Optax's non-finite-gradient guard.
WRAPS = ("none", "apply_if_finite")

#: ``--optimizer``: the transform each program runs, with the state dtype its storage (the
#: float32 anchor the same optimizer's float32 state). AdamW is issue 6's benchmark; AMSGrad
#: (PyTorch's convention, decoupled decay) keeps a third moment, the running max of nu, and
#: Lion one moment, whose output is a sign.
OPTIMIZERS = {
    "adamw": lambda sd: od.adamw(1e-3, weight_decay=0.1, mask=None, state_dtype=sd),
    "amsgrad": lambda sd: od.amsgrad(1e-3, weight_decay=0.1, mask=None, state_dtype=sd),
    "lion": lambda sd: od.lion(1e-4, weight_decay=1.0, mask=None, state_dtype=sd),
}

#: Rows of the batch of ``--step train``: small, so that the gradient costs little next to
#: the update, yet is a matrix product's output, materialised in every program.
TRAIN_BATCH = 4


def make_step(state_dtype, kind: str = "update", wrap: str = "none", optimizer: str = "adamw"):
    """``(tx, step)``: ``step(params, state, data)`` jitted with the parameters and the state
    donated. ``kind="update"``: ``data`` is the gradient (an argument of the program).
    ``kind="train"``: ``data`` is a batch ``x`` of shape ``(TRAIN_BATCH, rows)`` and the
    step computes the gradient of ``sum(tanh(x @ w))`` itself, as a training step does.
    ``wrap="apply_if_finite"``: the transform is ``optax.apply_if_finite(tx, 3)``.
    ``optimizer``: one of :data:`OPTIMIZERS`."""
    if wrap not in WRAPS:
        raise ValueError(f"wrap: one of {WRAPS}, got {wrap!r}")
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer: one of {tuple(OPTIMIZERS)}, got {optimizer!r}")
    tx = OPTIMIZERS[optimizer](_storage(state_dtype))
    if wrap == "apply_if_finite":
        tx = optax.apply_if_finite(tx, max_consecutive_errors=3)

    def update(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    def train(params, state, x):
        def loss(p):
            return sum(jnp.sum(jnp.tanh(x @ w)) for w in jax.tree.leaves(p))

        return update(params, state, jax.grad(loss)(params))

    return tx, jax.jit(update if kind == "update" else train, donate_argnums=(0, 1))


def bench_size(
    shape,
    repeats: int,
    rotation: str = "blocks",
    dtypes: tuple[str, ...] = STATE_DTYPES,
    kind: str = "update",
    block: int = 5,
    wrap: str = "none",
    leaves: int = 1,
    optimizer: str = "adamw",
) -> dict:
    """Times the step of each of ``dtypes`` at ``shape`` (see the module docstring):
    ``repeats`` turns of ``block`` steps per program with ``rotation="blocks"``, the first
    step of each block not counted; single steps with ``"pairs"`` and ``"all"``. With
    ``leaves`` > 1 the parameters are that many matrices of ``shape``; ``optimizer``: one of
    :data:`OPTIMIZERS`."""
    if rotation != "blocks":
        block = 1
    elif block < 2:
        raise ValueError(f"block: at least 2 steps with rotation='blocks', got {block}")
    skip = 1 if block > 1 else 0
    key = jax.random.key(0)
    # One matrix keeps its name and random key from before --leaves existed.
    keys = (
        {"w": key}
        if leaves == 1
        else {f"w{i}": jax.random.fold_in(key, 10 + i) for i in range(leaves)}
    )
    params0 = {k: jax.random.normal(kk, shape, jnp.float32) for k, kk in keys.items()}
    if kind == "update":  # what the step takes besides params and state: the gradient
        data = {
            k: 0.01 * jax.random.normal(jax.random.fold_in(kk, 1), shape, jnp.float32)
            for k, kk in keys.items()
        }
    else:  # or the batch
        data = jax.random.normal(jax.random.fold_in(key, 2), (TRAIN_BATCH, shape[0]))
    runs = {}
    for sd in dtypes:
        tx, step = make_step(sd, kind, wrap, optimizer)
        params = jax.tree.map(jnp.copy, params0)
        state = tx.init(params)
        sb = memory.state_bytes(state, params)
        t0 = time.perf_counter()
        params, state = step(params, state, data)  # compile + first step
        jax.block_until_ready((params, state))
        compile_s = time.perf_counter() - t0
        runs[sd] = {"step": step, "carry": (params, state), "bytes": sb, "compile_s": compile_s}
    others = [sd for sd in dtypes if sd != "float32"]
    rotations = [dtypes] if rotation == "all" else [("float32", sd) for sd in others]
    times = {sd: [] for sd in dtypes}
    anchor = {}  # the float32 times of the rotation each dtype was timed in
    for turn in rotations:
        f32_times = []
        for _ in range(repeats):
            for sd in turn:
                r = runs[sd]
                for k in range(block):
                    t0 = time.perf_counter()
                    r["carry"] = r["step"](*r["carry"], data)
                    jax.block_until_ready(r["carry"])
                    if k >= skip:
                        dt = time.perf_counter() - t0
                        (f32_times if sd == "float32" else times[sd]).append(dt)
        times["float32"] += f32_times
        anchor.update({sd: f32_times for sd in turn if sd != "float32"})
    n = leaves * int(np.prod(shape))
    out = {"shape": list(shape), "num_params": n, "rotation": rotation, "step": kind, "wrap": wrap}
    out["leaves"], out["optimizer"] = leaves, optimizer
    out["block"], out["timed_steps"] = block, len(times["float32"])
    for sd in dtypes:
        sb = runs[sd]["bytes"]
        out[sd] = {
            "state_bytes": sb.total,
            "bytes_per_param": sb.per_param,
            "step_ms_median": 1e3 * float(np.median(times[sd])),
            "step_ms_min": 1e3 * float(np.min(times[sd])),
            "compile_s": runs[sd]["compile_s"],
        }
    f32 = out["float32"]
    for sd in others:
        out[sd]["state_ratio"] = out[sd]["state_bytes"] / f32["state_bytes"]
        out[sd]["float32_step_ms_median"] = 1e3 * float(np.median(anchor[sd]))
        out[sd]["time_ratio"] = out[sd]["step_ms_median"] / out[sd]["float32_step_ms_median"]
    return out


def markdown(results: list[dict]) -> str:
    """One row per size: state bytes (fp32, bf16, int8 where timed), the int8/fp32 state
    ratio, each dtype's median step and its ratio to its float32 turns."""
    dtypes = [sd for sd in STATE_DTYPES if sd in results[0]]
    others = [sd for sd in dtypes if sd != "float32"]
    stored = [sd for sd in ("float32", "bfloat16", "int8") if sd in dtypes]
    head = ["parameters", "shape", *(f"state {LABELS[sd]}" for sd in stored)]
    head += ["int8/fp32 state"] if "int8" in dtypes else []
    head += [f"step {LABELS[sd]} (ms)" for sd in dtypes]
    head += [f"{LABELS[sd]}/fp32 time" for sd in others]
    lines = ["| " + " | ".join(head) + " |", "|---:|---|" + "---:|" * (len(head) - 2)]
    for r in results:
        leaves = r.get("leaves", 1)
        shape = str(tuple(r["shape"])) if leaves == 1 else f"{leaves} x {tuple(r['shape'])}"
        cells = [f"{r['num_params']:,}", shape]
        cells += [memory.format_bytes(r[sd]["state_bytes"]) for sd in stored]
        cells += [f"{r['int8']['state_ratio']:.4f}"] if "int8" in dtypes else []
        cells += [f"{r[sd]['step_ms_median']:.1f}" for sd in dtypes]
        cells += [f"{r[sd]['time_ratio']:.2f}" for sd in others]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", type=float, default=[1e6, 1e7, 5e7])
    parser.add_argument(
        "--repeats", type=int, default=7, help="turns per dtype (blocks, or single steps)"
    )
    parser.add_argument("--ragged", action="store_true", help="also (N/1000, 1000) matrices")
    parser.add_argument(
        "--leaves", type=int, default=1, help="split each size into this many matrices"
    )
    parser.add_argument(
        "--dtypes", nargs="+", choices=STATE_DTYPES[1:], default=list(STATE_DTYPES[1:]),
        help="state dtypes to time against float32 (default: all)",
    )  # fmt: skip
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument(
        "--rotation",
        choices=("blocks", "pairs", "all"),
        default="blocks",
        help="time each dtype in turns with float32 in blocks of --block steps (default), in "
        "single steps (pairs), or all dtypes in one rotation of single steps",
    )
    parser.add_argument(
        "--block",
        type=int,
        default=5,
        help="steps per block with --rotation blocks, the first not counted (default 5)",
    )
    parser.add_argument(
        "--step",
        choices=("update", "train"),
        default="update",
        help="time the update step with the gradient as an argument (default), or a training "
        "step that computes the gradient (of sum(tanh(x @ w)), a batch of 4) itself",
    )
    parser.add_argument(
        "--wrap",
        choices=WRAPS,
        default="none",
        help="wrap every program's transform in optax.apply_if_finite(tx, 3) (default: none)",
    )
    parser.add_argument(
        "--decode",
        choices=tuple(cpu_kernel._DECODE_LIMITS),
        default="best",
        help="the 8-bit kernel's path: the best this CPU has (default), or at most the AVX-512F, "
        "AVX2 or portable one (optax_decoupled.cpu_kernel.DECODE), e.g. to time a Skylake-class "
        "CPU's path on a CPU with AVX-512 VBMI",
    )
    parser.add_argument(
        "--optimizer",
        choices=tuple(OPTIMIZERS),
        default="adamw",
        help="the optimizer every program runs (default adamw, issue 6's benchmark)",
    )
    args = parser.parse_args(argv)
    if args.block < 2 and args.rotation == "blocks":
        parser.error("--block must be at least 2 (the first step of each block is not counted)")
    if args.leaves < 1:
        parser.error("--leaves must be at least 1")
    shapes = []
    for n in args.sizes:
        shapes.append((max(1, round(n / args.leaves / 1024)), 1024))
        if args.ragged:
            shapes.append((max(1, round(n / args.leaves / 1000)), 1000))
    cpu_kernel.DECODE = args.decode  # read when each program is traced
    load_at_start = C.load_average()
    machine = C.machine_info()
    env = {
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "device": str(jax.devices()[0].device_kind),
        "cpu_count": os.cpu_count(),
        # The kernels' speed depends on the CPU model, not only its features (docs/memory.md).
        "cpu": machine.get("cpu"),
        "date_utc": machine["date_utc"],
        "load_average_at_start": load_at_start,
        "python": platform.python_version(),
        "repeats": args.repeats,
        "rotation": args.rotation,
        "block": args.block if args.rotation == "blocks" else 1,
        "step": args.step,
        "wrap": args.wrap,
        "optimizer": args.optimizer,
        "leaves": args.leaves,
        "dtypes": ["float32", *dict.fromkeys(args.dtypes)],
        # The allocator's settings change how much the temporaries cost (docs/memory.md,
        # Allocator settings).
        "malloc_env": {k: v for k, v in os.environ.items() if k.startswith(MALLOC_ENV)},
        "cpu_kernel": cpu_kernel.available(),
        "cpu_kernel_avx512": cpu_kernel.uses_avx512(),
        "cpu_kernel_avx512_vbmi": cpu_kernel.uses_avx512_vbmi(),
        "decode": args.decode,
    }
    results = []
    for shape in shapes:
        dtypes = ("float32", *dict.fromkeys(args.dtypes))
        results.append(
            bench_size(
                shape,
                args.repeats,
                args.rotation,
                dtypes,
                args.step,
                args.block,
                args.wrap,
                args.leaves,
                args.optimizer,
            )
        )
        print(markdown(results[-1:]).splitlines()[-1], flush=True)
        if args.json:  # after every size: a run stopped by a time limit keeps what it measured
            C.write_json(args.json, {"env": env, "results": results, "complete": False})
    print()
    print(f"jax {env['jax']} on {env['backend']} ({env['device']}, {env['cpu_count']} CPUs)")
    print(f"CPU: {env['cpu']}; load average at the start: {env['load_average_at_start']}")
    kernel = "built" if env["cpu_kernel"] else f"not available: {cpu_kernel.unavailable_reason()}"
    if args.decode != "best":
        kernel += f" (8-bit kernel limited to its {args.decode} path: --decode {args.decode})"
    elif env["cpu_kernel_avx512_vbmi"]:
        kernel += " (AVX-512 VBMI decode)"
    elif env["cpu_kernel_avx512"]:
        kernel += " (AVX-512 decode)"
    print(f"compiled CPU kernels for int8 and bfloat16 moments: {kernel}")
    rotation = {
        "blocks": f"in turns with float32, one dtype at a time, in blocks of {args.block} steps "
        "(the first of each not counted)",
        "pairs": "in turns with float32, one dtype at a time, single steps",
        "all": "all dtypes in one rotation of single steps",
    }[args.rotation]
    print(f"timing: {rotation}; ratios against the float32 steps of the same turns")
    what = (
        "the update step (gradient an argument)"
        if args.step == "update"
        else f"a training step (gradient of sum(tanh(x @ w)) computed in it, batch {TRAIN_BATCH})"
    )
    what += f", {args.optimizer}"
    if args.wrap != "none":
        what += f", the transform wrapped in optax.{args.wrap}(tx, 3)"
    print(f"timed: {what}")
    if env["malloc_env"]:
        print(f"allocator settings: {env['malloc_env']}")
    print(markdown(results))
    if args.json:
        C.write_json(args.json, {"env": env, "results": results, "complete": True})
    return results


if __name__ == "__main__":
    main()
