"""Shared helpers of the benchmark scripts: model layouts, contenders, timing, HLO traffic.

Not part of the package (benchmarks may import torch; the core never does).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import platform
import re
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import optax_decoupled as od
from optax_decoupled.contrib import PackedLayout, packed, packed_layout

# ---------------------------------------------------------------------------------------------
# Layouts
# ---------------------------------------------------------------------------------------------


def leaf_sizes(num_leaves: int, total: int, seed: int = 0) -> list[int]:
    """``num_leaves`` sizes summing to ``total``: log-normal, like a real model's mix of big
    matrices and small biases/norm scales, each a multiple of 8 (as hidden sizes are).

    XLA:CPU does not vectorize an elementwise loop of odd length (about 3x slower), so odd
    sizes would measure that, not the optimizers; ``--sizes 1000001 --leaves 1`` shows it.
    """
    if num_leaves == 1:
        return [total]
    rng = np.random.default_rng(seed)
    w = rng.lognormal(0.0, 1.0, num_leaves)
    sizes = np.maximum(8, np.floor(w / w.sum() * total / 8) * 8).astype(int)
    sizes[np.argmax(sizes)] += total - int(sizes.sum())
    return [int(s) for s in sizes]


def _shape_for(size: int, i: int, num_leaves: int) -> tuple[int, ...]:
    """Every third leaf (from the second on) is a vector (a bias); the others are matrices of
    exactly ``size`` elements, as square as the size allows."""
    if (num_leaves > 1 and i % 3 == 1) or size < 4:
        return (size,)
    a = int(np.sqrt(size))
    while size % a:
        a -= 1
    return (a, size // a)


def make_params(num_leaves: int, total: int, dtype=jnp.float32, seed: int = 0) -> dict:
    """A flat dict of ``num_leaves`` parameters, ``total`` elements in all.

    Names end in ``bias`` for vectors and ``kernel`` for matrices, so ``mask="auto"`` decays
    the matrices only, as in a real model (a single leaf is a matrix).
    """
    sizes = leaf_sizes(num_leaves, total, seed)
    rng = np.random.default_rng(seed + 1)
    params = {}
    for i, size in enumerate(sizes):
        shape = _shape_for(size, i, num_leaves)
        name = f"layer{i:04d}/" + ("bias" if len(shape) == 1 else "kernel")
        params[name] = jnp.asarray(rng.standard_normal(shape, np.float32), dtype)
    return params


def grads_like(params: Any, seed: int = 2) -> Any:
    rng = np.random.default_rng(seed)
    return jax.tree.map(
        lambda p: jnp.asarray(0.01 * rng.standard_normal(p.shape, np.float32), p.dtype), params
    )


def num_params(tree: Any) -> int:
    return int(sum(np.size(x) for x in jax.tree.leaves(tree)))


# ---------------------------------------------------------------------------------------------
# Contenders: each builds a jitted, donated step on (params, state, grads)
# ---------------------------------------------------------------------------------------------

LR, WD = 1e-3, 0.1


@dataclasses.dataclass
class JaxStep:
    """A jitted ``step(params, state, grads) -> (params, state)`` and its current arguments."""

    name: str
    fn: Callable
    params: Any
    state: Any
    grads: Any
    n: int

    executable: Any = None

    def __call__(self) -> None:
        fn = self.executable or self.fn
        self.params, self.state = fn(self.params, self.state, self.grads)

    def block(self) -> None:
        jax.block_until_ready((self.params, self.state))

    def compiled(self):
        """Compiles the step once; later calls run that executable."""
        if self.executable is None:
            self.executable = self.fn.lower(self.params, self.state, self.grads).compile()
        return self.executable


def make_step(tx: optax.GradientTransformation) -> Callable:
    """The step every contender runs, jitted with the params and the state donated."""

    def step(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    return jax.jit(step, donate_argnums=(0, 1))


def _fresh(tree: Any) -> Any:
    return jax.tree.map(lambda x: jnp.array(x, copy=True), tree)


def jax_contender(name: str, params: Any, grads: Any) -> JaxStep:
    """Builds one of :data:`JAX_CONTENDERS` for a parameter pytree (copied: steps donate)."""
    n = num_params(params)
    if name == "od.contrib.packed(adamw) flat":
        # Parameters, gradients and updates kept packed by the user (see docs/performance.md).
        layout = od_packed_layout(params)
        tx = od.adamw(LR, weight_decay=WD, mask=layout.mask)
        p, g = layout.pack(params), layout.pack(grads)
        p = _fresh(p)
        return JaxStep(name, make_step(tx), p, tx.init(p), g, n)
    tx = JAX_CONTENDERS[name]()
    p = _fresh(params)
    return JaxStep(name, make_step(tx), p, tx.init(p), grads, n)


def od_packed_layout(params: Any) -> PackedLayout:
    return packed_layout(params, "auto")


JAX_CONTENDERS: dict[str, Callable[[], optax.GradientTransformation]] = {
    "optax.adamw": lambda: optax.adamw(LR, weight_decay=WD),
    # The same program built again, last: its ratio to optax.adamw is the noise floor of the
    # run (load, and where each contender's buffers and code happen to land).
    "optax.adamw (again)": lambda: optax.adamw(LR, weight_decay=WD),
    "od.adamw": lambda: od.adamw(LR, weight_decay=WD),
    "od.adamw(mask=None)": lambda: od.adamw(LR, weight_decay=WD, mask=None),
    "od.contrib.packed(adamw)": lambda: packed(od.adamw)(LR, weight_decay=WD),
    "od.contrib.packed(adamw) all leaves": lambda: packed(od.adamw, max_leaf_size=None)(
        LR, weight_decay=WD
    ),
    "od.amsgrad": lambda: od.amsgrad(LR, weight_decay=WD),
    "od.lion": lambda: od.lion(LR * 0.1, weight_decay=WD * 10),
    "optax.lion": lambda: optax.lion(LR * 0.1, weight_decay=WD * 10),
    # Not an optimizer to compare: ``params - lr * grads``, one kernel per leaf. Any step that
    # takes and returns pytree parameters writes each leaf with at least one kernel (XLA does
    # not fuse outputs of different shapes), so this is the floor of every pytree step,
    # `od.contrib.packed` included; flat parameters are not bound by it.
    "floor: optax.sgd": lambda: optax.sgd(LR),
    "od.adamw(int8)": lambda: od.adamw(LR, weight_decay=WD, state_dtype="int8"),
}


# ---------------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------------


def time_round_robin(
    steps: dict[str, Callable[[], float]], repeats: int, budget_s: float | None = None
) -> dict[str, list[float]]:
    """Calls each timer in turn, ``repeats`` rounds (so load drifts hit all contenders
    alike), rotating the order by one every round: each contender runs in every position and
    never twice in a row (a reversed order would let the first and last run twice in a row,
    on warm caches, and measurably favour them); returns the seconds per call of each."""
    out: dict[str, list[float]] = {k: [] for k in steps}
    start = time.perf_counter()
    names = list(steps)
    for r in range(repeats):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            out[name].append(steps[name]())
        if budget_s is not None and time.perf_counter() - start > budget_s:
            break
    return out


def timer_for(step: JaxStep, inner: int = 1) -> Callable[[], float]:
    """Seconds per step, averaged over ``inner`` back-to-back steps."""

    def timer() -> float:
        step.block()
        t0 = time.perf_counter()
        for _ in range(inner):
            step()
        step.block()
        return (time.perf_counter() - t0) / inner

    return timer


def median(xs: list[float]) -> float:
    return float(statistics.median(xs))


def load_average() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def machine_info() -> dict[str, Any]:
    info: dict[str, Any] = {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "jax": jax.__version__,
        "optax": optax.__version__,
        "backend": jax.default_backend(),
        "devices": [str(d) for d in jax.devices()],
        "load_average_at_start": load_average(),
        "XLA_FLAGS": os.environ.get("XLA_FLAGS", ""),
    }
    try:
        with open("/proc/cpuinfo") as f:
            fields: dict[str, str] = {}
            for line in f:
                if not line.strip():
                    break  # the first processor is enough
                key, _, value = line.partition(":")
                fields[key.strip()] = value.strip()
        info["cpu"] = fields.get("model name")
        if "cpu family" in fields and "model" in fields:
            # A VM may name only the vendor; family and model tell the microarchitecture.
            family = f"family {fields['cpu family']}, model {fields['model']}"
            info["cpu"] = f"{info['cpu']} ({family})" if info["cpu"] else family
    except OSError:
        pass
    return info


def write_json(path: str, payload: Any) -> None:
    """Writes ``payload`` to ``path`` atomically (a temporary file, then a rename), so that a
    run interrupted while writing leaves the previous complete file."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(payload, f, indent=1, default=str)
    os.replace(tmp, path)


# ---------------------------------------------------------------------------------------------
# Bytes moved, from the compiled HLO
# ---------------------------------------------------------------------------------------------

_DTYPE_BYTES = {
    "f64": 8, "f32": 4, "bf16": 2, "f16": 2, "s64": 8, "u64": 8, "s32": 4, "u32": 4,
    "s16": 2, "u16": 2, "s8": 1, "u8": 1, "pred": 1, "s4": 1, "u4": 1,
}  # fmt: skip
_ARRAY = re.compile(r"\b(" + "|".join(_DTYPE_BYTES) + r")\[([0-9,]*)\]")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s+([\w\-]+)\((.*)$")
_NO_TRAFFIC = {
    "parameter", "tuple", "get-tuple-element", "bitcast", "constant", "after-all",
    "partition-id", "replica-id", "opt-barrier",
}  # fmt: skip


def _arrays(shape_text: str) -> list[tuple[int, int]]:
    """(elements, bytes per element) of each array in an HLO shape string."""
    out = []
    for dtype, dims in _ARRAY.findall(shape_text):
        n = 1
        for d in filter(None, dims.split(",")):
            n *= int(d)
        out.append((n, _DTYPE_BYTES[dtype]))
    return out


def _nbytes(shape_text: str) -> int:
    return sum(n * b for n, b in _arrays(shape_text))


def _computations(hlo: str) -> dict[str, list[str]]:
    comps: dict[str, list[str]] = {}
    name = None
    for line in hlo.splitlines():
        if name is None:
            m = re.match(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$", line)
            if m:
                name = "ENTRY" if m.group(1) else m.group(2)
                comps[name] = []
        elif line.startswith("}"):
            name = None
        else:
            comps[name].append(line)
    return comps


def _parse(lines: list[str]) -> list[tuple[str, str, str, list[str], str]]:
    """(name, shape, opcode, operand names, text after the operands) of each instruction;
    a parameter's number is its only "operand"."""
    out = []
    for line in lines:
        m = _INSTR.match(line)
        if not m:
            continue
        name, shape, op, rest = m.groups()
        args, _, attrs = rest.partition(")")
        operands = [args.strip()] if op == "parameter" else re.findall(r"%([\w.\-]+)", args)
        out.append((name, shape, op, operands, attrs))
    return out


def _param_reads(lines: list[str]) -> dict[int, int]:
    """Bytes a fused computation reads from each of its parameters: elements demanded from the
    root (slices demand only their window, reductions all of their input), times the element
    size."""
    instrs = _parse(lines)
    by_name = {i[0]: i for i in instrs}
    demand: dict[str, int] = {}
    root = next((line for line in lines if line.strip().startswith("ROOT")), None)
    if root is None:
        return {}
    root_name = _INSTR.match(root).group(1)
    for name, *_ in instrs:
        demand[name] = 0
    demand[root_name] = sum(n for n, _ in _arrays(by_name[root_name][1]))
    for name, shape, op, operands, _ in reversed(instrs):
        d = demand.get(name, 0)
        if d == 0:
            continue
        size_self = max(1, sum(n for n, _ in _arrays(shape)))
        if op == "parameter":
            continue
        for o in operands:
            if o not in by_name:
                continue
            size_o = sum(n for n, _ in _arrays(by_name[o][1]))
            if op in ("broadcast",):
                want = size_o
            elif op in ("reduce", "reduce-window"):
                want = size_o  # every input element, however small the result
            elif op in ("slice", "dynamic-slice"):
                want = d
            elif op == "concatenate":
                want = int(round(size_o * d / size_self))
            elif op == "dynamic-update-slice" and o != operands[0]:
                want = size_o
            elif op == "dynamic-update-slice":
                want = 0  # in place: the untouched part is not read
            else:
                want = min(size_o, d) if size_o else 0
            demand[o] = min(size_o, max(demand.get(o, 0), want))
    reads = {}
    for name, shape, op, operands, _ in instrs:
        if op == "parameter":
            idx = int(operands[0])
            arr = _arrays(shape)
            elem = arr[0][1] if arr else 0
            reads[idx] = demand.get(name, 0) * elem
    return reads


def hlo_traffic(hlo: str) -> dict[str, Any]:
    """Estimated bytes read and written by the entry computation's kernels.

    Each fusion reads the elements its root demands from each operand (a fused ``slice`` of a
    big buffer reads only its window) and writes its output; copies and unfused ops read their
    operands and write their result. In-place dynamic-update-slice fusions write only the update.
    """
    comps = _computations(hlo)
    entry = _parse(comps.get("ENTRY", []))
    shapes = {name: shape for name, shape, *_ in entry}
    total_read = total_write = 0
    kernels = 0
    for _name, shape, op, operands, attrs in entry:
        if op in _NO_TRAFFIC:
            continue
        kernels += 1
        out_bytes = _nbytes(shape)
        if op == "fusion":
            called = re.search(r"calls=%?([\w.\-]+)", attrs)
            reads = _param_reads(comps.get(called.group(1), [])) if called else {}
            for i, o in enumerate(operands):
                total_read += reads.get(i, _nbytes(shapes.get(o, "")))
            body = comps.get(called.group(1), []) if called else []
            root = next((ln for ln in body if ln.strip().startswith("ROOT")), "")
            if "dynamic-update-slice(" in root:
                m = _INSTR.match(root)
                ops = re.findall(r"%([\w.\-]+)", m.group(4).partition(")")[0]) if m else []
                inner_shapes = {n: s for n, s, *_ in _parse(body)}
                if len(ops) > 1:
                    out_bytes = _nbytes(inner_shapes.get(ops[1], shape))
        else:
            total_read += sum(_nbytes(shapes.get(o, "")) for o in operands)
        total_write += out_bytes
    return {"read": total_read, "write": total_write, "kernels": kernels}


def bytes_per_param(compiled, n: int) -> dict[str, Any]:
    t = hlo_traffic(compiled.as_text())
    return {
        "bytes_per_param": round((t["read"] + t["write"]) / n, 2),
        "read_per_param": round(t["read"] / n, 2),
        "write_per_param": round(t["write"] / n, 2),
        "kernels": t["kernels"],
    }
