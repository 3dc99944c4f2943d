"""Step time of one optimizer update: optax-decoupled vs Optax vs PyTorch, side by side.

Every contender runs the same jitted step, ``params, state = step(params, state, grads)`` with
the parameters and the state donated (``jax.jit(step, donate_argnums=(0, 1))``), on the same
parameters. PyTorch's ``AdamW`` (``foreach`` and ``fused``, 1 thread and the default number of
threads) runs when torch is installed. A bandwidth reference is measured in the same run on
arrays of the same size, with in-place (donated) kernels like the step itself: ``scale``
(``a = -a``, 8 B/element) and ``axpy`` (``a = a + s*c``, 12 B/element: STREAM's triad in
place). An AdamW step must move at least 28 B per fp32 parameter (read θ, g, μ, ν; write θ,
μ, ν), so

    limit = 28 B x N / axpy bandwidth

(from the fastest axpy sample: bandwidth is a property of the machine, and the fastest sample
is the one load disturbed least); ``vs limit`` is how far a contender's median is from that.
Contenders alternate (round robin) so that load drifts hit them alike; the tables report
medians, and minima beside them. ``HLO B/param`` is the traffic of the compiled step
estimated from its optimized HLO (kernels x bytes each reads and writes).

    python benchmarks/update_step.py --quick     # < 1 minute: 1e6 parameters, 1 and 20 leaves
    python benchmarks/update_step.py             # full: 1 and 200 leaves x 1e6, 1e7, 5e7
    python benchmarks/update_step.py --sizes 1e8 2e8 --gpu     # what benchmarks/gpu.sh runs
    python benchmarks/update_step.py --packed-target   # ~1 minute: the packed-path target

Writes ``benchmarks/results/update_step.json`` and a Markdown table (also printed) for
``docs/performance.md``.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common as C  # noqa: E402

DEFAULT_JAX = [
    "optax.adamw",
    "od.adamw",
    "od.contrib.packed(adamw)",
    "od.contrib.packed(adamw) all leaves",
    "od.contrib.packed(adamw) flat",
    "od.amsgrad",
    "od.lion",
    "optax.lion",
    "od.adamw(int8)",
    "optax.adamw (again)",
]
#: Run on the one-leaf layouts only unless named with --contenders (slow to compile per leaf).
SINGLE_LEAF_ONLY = {"od.adamw(int8)"}
#: On many leaves, run at the smallest size only unless named with --contenders: their
#: per-leaf structure is AdamW's, and each size of each layout is a minute of compiling.
MANY_LEAVES_SMALLEST_ONLY = {"od.amsgrad", "od.lion", "optax.lion"}
TORCH = [
    "torch AdamW foreach 1t",
    "torch AdamW fused 1t",
    "torch AdamW foreach",
    "torch AdamW fused",
]

#: ``--packed-target``: the layout and contenders of the packed-path target : 200
#: leaves / 1e6 parameters, packed with pytree and with flat parameters, against Optax, with the
#: per-leaf floor of pytree steps and Optax built again (the run's noise floor).
PACKED_TARGET = [
    "optax.adamw",
    "od.contrib.packed(adamw)",
    "od.contrib.packed(adamw) flat",
    "floor: optax.sgd",
    "optax.adamw (again)",
]

#: Nominal peak memory bandwidth (GB/s) by ``device_kind``, for the GPU report.
PEAK_GBPS = {
    "NVIDIA H200": 4800,
    "NVIDIA H100 80GB HBM3": 3350,
    "NVIDIA H100 PCIe": 2000,
    "NVIDIA A100-SXM4-80GB": 2039,
    "NVIDIA A100-SXM4-40GB": 1555,
    "NVIDIA A100 80GB PCIe": 1935,
    "NVIDIA A100-PCIE-40GB": 1555,
    "NVIDIA L4": 300,
    "NVIDIA A10G": 600,
    "NVIDIA L40S": 864,
    "Tesla V100-SXM2-16GB": 900,
    "Tesla V100-SXM2-32GB": 900,
    "Tesla T4": 320,
    "NVIDIA GeForce RTX 4090": 1008,
    "NVIDIA GeForce RTX 3090": 936,
}


# ---------------------------------------------------------------------------------------------
# Torch contenders (optional)
# ---------------------------------------------------------------------------------------------


def torch_or_none():
    try:
        import torch
    except ImportError:
        return None
    return torch


_DEFAULT_THREADS: list[int] = []


def _default_threads(torch) -> int:
    """torch's default intra-op thread count, read once before any step changes it."""
    if not _DEFAULT_THREADS:
        _DEFAULT_THREADS.append(torch.get_num_threads())
    return _DEFAULT_THREADS[0]


class TorchStep:
    def __init__(self, torch, name: str, params, grads, device: str):
        self.torch, self.name, self.device = torch, name, device
        self.threads = 1 if name.endswith(" 1t") else None
        self.default_threads = _default_threads(torch)
        kind = "fused" if "fused" in name else "foreach"
        self.params = []
        for p, g in zip(jax.tree.leaves(params), jax.tree.leaves(grads), strict=True):
            t = torch.tensor(np.asarray(p), device=device)
            t.grad = torch.tensor(np.asarray(g), device=device)
            self.params.append(t)
        self.opt = torch.optim.AdamW(self.params, lr=C.LR, weight_decay=C.WD, **{kind: True})
        self.n = C.num_params(params)
        self()  # creates the state

    def _set_threads(self):
        want = self.threads or self.default_threads
        if self.torch.get_num_threads() != want:
            self.torch.set_num_threads(want)

    def __call__(self):
        with self.torch.no_grad():
            self.opt.step()

    def block(self):
        self._set_threads()
        if self.device == "cuda":
            self.torch.cuda.synchronize()


def torch_timer(step: TorchStep, inner: int) -> Callable[[], float]:
    def timer() -> float:
        step.block()
        t0 = time.perf_counter()
        for _ in range(inner):
            step()
        if step.device == "cuda":
            step.torch.cuda.synchronize()
        return (time.perf_counter() - t0) / inner

    return timer


# ---------------------------------------------------------------------------------------------
# Bandwidth reference
# ---------------------------------------------------------------------------------------------


def bandwidth_timers(n: int, inner: int) -> dict[str, tuple[Callable[[], float], int]]:
    """Two in-place JAX kernels on ``n`` fp32 elements, like an optimizer step (donated, so
    nothing is allocated): ``scale`` ``a = -a`` (8 B/element) and ``axpy`` ``a = a + s*c``
    (12 B/element, STREAM's triad in place). Returns a timer (seconds per call) and the bytes
    of one call for each."""
    rng = np.random.default_rng(0)
    c = jnp.asarray(rng.standard_normal(n, np.float32))
    state = {"scale": c + 1.0, "axpy": c + 2.0}
    kernels = {
        "scale": jax.jit(lambda a: -a, donate_argnums=0),
        "axpy": jax.jit(lambda a, c: a + 1e-3 * c, donate_argnums=0),
    }
    args = {"scale": (), "axpy": (c,)}

    def timer_for_kernel(name):
        def timer() -> float:
            state[name].block_until_ready()
            t0 = time.perf_counter()
            for _ in range(inner):
                state[name] = kernels[name](state[name], *args[name])
            state[name].block_until_ready()
            return (time.perf_counter() - t0) / inner

        return timer

    return {"scale": (timer_for_kernel("scale"), 8 * n), "axpy": (timer_for_kernel("axpy"), 12 * n)}


# ---------------------------------------------------------------------------------------------
# One group: a layout and a size
# ---------------------------------------------------------------------------------------------


def run_group(n_leaves: int, n: int, jax_names, torch_names, args) -> dict:
    params = C.make_params(n_leaves, n)
    grads = C.grads_like(params)
    torch = torch_or_none() if torch_names else None
    steps: dict[str, Callable[[], float]] = {}
    hlo: dict[str, dict] = {}
    compile_s: dict[str, float] = {}
    # Steps per sample: enough to amortize the dispatch and the final block.
    inner = max(1, int(2e6 // n)) if not args.gpu else max(10, int(2e9 // n))

    for name in jax_names:
        if name not in C.JAX_CONTENDERS and name != "od.contrib.packed(adamw) flat":
            continue
        if not args.contenders and n_leaves > 1:
            if name in SINGLE_LEAF_ONLY:
                continue
            if name in MANY_LEAVES_SMALLEST_ONLY and n > min(args.sizes_run):
                continue
        t0 = time.perf_counter()
        step = C.jax_contender(name, params, grads)
        compiled = step.compiled()
        step()
        step.block()
        compile_s[name] = time.perf_counter() - t0
        hlo[name] = C.bytes_per_param(compiled, step.n)
        steps[name] = C.timer_for(step, inner)
        print(f"    built {name:24s} in {compile_s[name]:6.1f} s  {hlo[name]}", flush=True)

    device = "cuda" if args.gpu else "cpu"
    if torch is not None and (not args.gpu or torch.cuda.is_available()):
        for name in torch_names:
            if args.gpu and name.endswith(" 1t"):
                continue
            steps[name] = torch_timer(TorchStep(torch, name, params, grads, device), inner)
    bw = bandwidth_timers(n, inner)
    for name, (timer, _) in bw.items():
        steps[f"[{name}]"] = timer

    times = C.time_round_robin(steps, args.repeats, budget_s=args.group_budget)
    med = {k: C.median(v) for k, v in times.items()}
    # Bandwidth is a property of the machine: take the fastest sample, which load slows least.
    bw_gbps = {k: bw[k][1] / min(times[f"[{k}]"]) / 1e9 for k in bw}
    limit_s = 28 * n / (bw_gbps["axpy"] * 1e9)
    ref = med.get("optax.adamw")
    torch_ref = med.get("torch AdamW fused 1t")
    rows = []
    for name in steps:
        if name.startswith("["):
            continue
        rows.append(
            {
                "leaves": n_leaves,
                "params": n,
                "contender": name,
                "median_ms": med[name] * 1e3,
                "min_ms": min(times[name]) * 1e3,
                "p10_ms": float(np.percentile(times[name], 10)) * 1e3,
                "min_vs_optax": min(times[name]) / min(times["optax.adamw"]) if ref else None,
                "samples": len(times[name]),
                "vs_optax": med[name] / ref if ref else None,
                "vs_limit": med[name] / limit_s,
                "vs_torch_fused_1t": med[name] / torch_ref if torch_ref else None,
                "achieved_GBps_at_28B": 28 * n / med[name] / 1e9,
                "hlo": hlo.get(name),
                "compile_s": compile_s.get(name),
            }
        )
    return {
        "leaves": n_leaves,
        "params": n,
        "bandwidth_GBps": bw_gbps,
        "limit_ms": limit_s * 1e3,
        "rows": rows,
    }


def markdown(groups) -> str:
    lines = [
        "| leaves | N | contender | median ms | vs optax.adamw | vs limit | vs torch fused 1t "
        "| min ms | min vs optax | HLO B/param | kernels |",
        "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]

    def f(x, spec="{:.2f}x"):
        return spec.format(x) if x is not None else "-"

    for g in groups:
        for r in g["rows"]:
            h = r["hlo"] or {}
            lines.append(
                f"| {r['leaves']} | {r['params']:.0e} | `{r['contender']}` | "
                f"{r['median_ms']:.3f} | {f(r['vs_optax'])} | {f(r['vs_limit'])} | "
                f"{f(r['vs_torch_fused_1t'])} | {r['min_ms']:.3f} | {f(r['min_vs_optax'])} | "
                f"{h.get('bytes_per_param', '-')} | "
                f"{h.get('kernels', '-')} |"
            )
        bw = g["bandwidth_GBps"]
        lines.append(
            f"| {g['leaves']} | {g['params']:.0e} | *limit: 28 B/param at axpy "
            f"{bw['axpy']:.1f} GB/s (scale {bw['scale']:.1f} GB/s)* | {g['limit_ms']:.3f} "
            "| | 1.00x | | | | 28 | |"
        )
    return "\n".join(lines)


def gpu_report(groups) -> str:
    kind = jax.devices()[0].device_kind
    peak = PEAK_GBPS.get(kind)
    lines = [f"GPU: {kind}; nominal peak bandwidth: {peak or 'unknown (pass --peak-gbps)'} GB/s"]
    for g in groups:
        scale = g["bandwidth_GBps"]["scale"]
        for r in g["rows"]:
            frac_peak = r["achieved_GBps_at_28B"] / peak if peak else float("nan")
            lines.append(
                f"  {g['leaves']:4d} leaves N={g['params']:.0e} {r['contender']:24s} "
                f"{r['achieved_GBps_at_28B']:8.1f} GB/s at 28 B/param = {frac_peak:6.1%} of peak, "
                f"{r['achieved_GBps_at_28B'] / scale:6.1%} of a scale kernel ({scale:.0f} GB/s)"
            )
    return "\n".join(lines)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="1e6 parameters, 1 and 20 leaves")
    ap.add_argument(
        "--packed-target",
        action="store_true",
        help="200 leaves / 1e6 parameters, packed contenders only, no torch ",
    )
    ap.add_argument("--sizes", type=float, nargs="*", default=None)
    ap.add_argument("--leaves", type=int, nargs="*", default=None)
    ap.add_argument("--contenders", nargs="*", default=None, help="JAX contenders to run")
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--group-budget", type=float, default=None, help="seconds of timing per group")
    ap.add_argument("--gpu", action="store_true", help="report the fraction of peak bandwidth")
    ap.add_argument("--peak-gbps", type=float, default=None)
    ap.add_argument(
        "--out",
        default=None,
        help="default benchmarks/results/update_step.json (update_step_packed.json with "
        "--packed-target)",
    )
    args = ap.parse_args(argv)
    if args.gpu and jax.default_backend() != "gpu":
        ap.error(f"--gpu, but JAX's backend is {jax.default_backend()!r} ({jax.devices()}).")
    if args.peak_gbps:
        PEAK_GBPS[jax.devices()[0].device_kind] = args.peak_gbps
    if args.packed_target:
        args.sizes = args.sizes or [1e6]
        args.leaves = args.leaves or [200]
        args.contenders = args.contenders or PACKED_TARGET
        args.no_torch = True
    if args.out is None:
        name = "update_step_packed.json" if args.packed_target else "update_step.json"
        args.out = f"benchmarks/results/{name}"
    sizes = [int(s) for s in (args.sizes or ([1e6] if args.quick else [1e6, 1e7, 5e7]))]
    args.sizes_run = sizes
    leaves = args.leaves or ([1, 20] if args.quick else [1, 200])
    args.repeats = args.repeats or 200
    args.group_budget = args.group_budget or (4.0 if args.quick else 25.0)
    jax_names = args.contenders or DEFAULT_JAX
    torch_names = [] if args.no_torch else TORCH
    if torch_names and torch_or_none() is None:
        print("# torch is not installed: skipping the torch.optim.AdamW contenders")
        torch_names = []

    info = C.machine_info()
    info["torch"] = getattr(torch_or_none(), "__version__", None)
    print(f"# update step, {info.get('cpu')} x{info['cpu_count']}, backend {info['backend']}, "
          f"jax {info['jax']}, optax {info['optax']}, torch {info['torch']}, "
          f"load {info['load_average_at_start']}")  # fmt: skip
    groups = []
    t_start = time.perf_counter()
    for n in sizes:
        for n_leaves in leaves:
            print(f"  group: {n_leaves} leaves, N={n:.0e}", flush=True)
            groups.append(run_group(n_leaves, n, jax_names, torch_names, args))
            gc.collect()
            # After every group, so that a run stopped by a time limit (gpu_checks.sh's
            # `timeout`) keeps what it measured; "complete" says whether the run finished.
            C.write_json(args.out, {"machine": info, "groups": groups, "complete": False})
    info["load_average_at_end"] = C.load_average()
    info["wall_s"] = time.perf_counter() - t_start
    table = markdown(groups)
    print(table)
    payload = {"machine": info, "groups": groups, "markdown": table, "complete": True}
    if args.gpu:
        report = gpu_report(groups)
        print(report)
        payload["gpu_report"] = report
    C.write_json(args.out, payload)
    print(f"wrote {args.out} ({info['wall_s']:.0f} s)")
    return payload


if __name__ == "__main__":
    main()
