"""Independent float64 NumPy reference implementations of the optimizers under test.

Written from the published formulas, *not* from the code of Optax, PyTorch or
``optax_decoupled`` (this module imports neither jax nor optax nor torch):

- Adam: Kingma & Ba, "Adam: A Method for Stochastic Optimization", ICLR 2015, Algorithm 1,
  with ``eps`` outside the square root and an optional ``eps_root`` inside it:
  ``u = mhat / (sqrt(vhat + eps_root) + eps)``, ``mhat = m / (1 - b1^t)``,
  ``vhat = v / (1 - b2^t)``.
- Coupled L2 ("Adam with weight decay", ``torch.optim.Adam(weight_decay=wd)``): the penalty
  gradient enters before the adaptive scaling, ``g <- g + wd_k * theta``.
- Decoupled weight decay: Loshchilov & Hutter, "Decoupled Weight Decay Regularization",
  ICLR 2019, Algorithm 2: ``theta <- theta - lr_k * u - s_k * theta`` with the decay per step
  ``s_k`` in one of four conventions (``lr_k`` the learning rate at step k, ``lr_peak`` its peak):
  ``"lr"`` wd*lr_k (PyTorch AdamW, optax.adamw), ``"schedule"`` wd*lr_k/lr_peak (L&H Alg. 2, where
  the schedule multiplier is eta_t = lr_k/lr_peak), ``"constant"`` wd, ``"corrected"``
  wd*lr_k**2/lr_peak.
- AMSGrad: Reddi, Kale & Kumar, "On the Convergence of Adam and Beyond", ICLR 2018, in three
  conventions: ``"pytorch"`` (max of the raw second moment, then bias-correct),
  ``"optax"`` (max of the bias-corrected second moment), ``"paper"`` (Algorithm 2: no bias
  correction of either moment).
- Lion: Chen et al., "Symbolic Discovery of Optimization Algorithms", NeurIPS 2023, Algorithm 2:
  ``c = b1*m + (1-b1)*g``, ``theta <- theta - lr_k*(sign(c) + wd*theta)``,
  ``m <- b2*m + (1-b2)*g`` (``sign(0) = 0``).

Conventions: ``k`` is the 0-based step (the number of updates already applied); ``t = k + 1`` is
the 1-based time used in bias corrections. Schedules are plain Python functions of ``k``.
Pytrees are nested dicts / lists / tuples of arrays; every computation is done in float64.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

Schedule = Callable[[int], float]
Tree = Any

AMSGRAD_VARIANTS = (None, "pytorch", "optax", "paper")
DECAY_CONVENTIONS = ("lr", "schedule", "constant", "corrected")


# ----------------------------------------------------------------------------- pytree helpers


def tree_map(fn: Callable[..., Any], tree: Tree, *rest: Tree) -> Tree:
    """Maps ``fn`` over the leaves of nested dicts/lists/tuples (structure taken from ``tree``)."""
    if isinstance(tree, Mapping):
        return {key: tree_map(fn, tree[key], *(r[key] for r in rest)) for key in tree}
    if isinstance(tree, list | tuple):
        return type(tree)(tree_map(fn, t, *(r[i] for r in rest)) for i, t in enumerate(tree))
    return fn(tree, *rest)


def tree_paths(tree: Tree, prefix: str = "") -> list[tuple[str, Any]]:
    """``[(path, leaf)]`` with ``'/'``-joined paths, in the structure's own order."""
    if isinstance(tree, Mapping):
        items = [(str(key), tree[key]) for key in tree]
    elif isinstance(tree, list | tuple):
        items = [(str(i), t) for i, t in enumerate(tree)]
    else:
        return [(prefix, tree)]
    out: list[tuple[str, Any]] = []
    for name, sub in items:
        out.extend(tree_paths(sub, f"{prefix}/{name}" if prefix else name))
    return out


def to_float64(tree: Tree) -> Tree:
    return tree_map(lambda x: np.array(x, dtype=np.float64), tree)


def zeros_like(tree: Tree) -> Tree:
    return tree_map(lambda x: np.zeros(np.shape(x), np.float64), tree)


def full_mask(tree: Tree, mask: Tree | None) -> Tree:
    """``mask=None`` means "decay every leaf"; otherwise a tree of bools of the same structure."""
    if mask is None:
        return tree_map(lambda _: True, tree)
    return mask


def as_schedule(value: float | Schedule) -> Schedule:
    if callable(value):
        return lambda k: float(value(k))
    return lambda k: float(value)


def warmup_cosine(
    init_value: float,
    peak_value: float,
    warmup_steps: int,
    decay_steps: int,
    end_value: float = 0.0,
) -> Schedule:
    """Linear warmup from ``init_value`` to ``peak_value`` over ``warmup_steps`` steps, then a
    half-cosine from ``peak_value`` to ``end_value`` reached at step ``decay_steps`` (and kept).

    lr(k) = init + (peak - init) * k / warmup                                for k < warmup
    lr(k) = end + (peak - end) * (1 + cos(pi * min(k - warmup, T) / T)) / 2  otherwise,
    with T = decay_steps - warmup_steps.
    """

    def schedule(k: int) -> float:
        if k < warmup_steps:
            return init_value + (peak_value - init_value) * k / warmup_steps
        span = decay_steps - warmup_steps
        j = min(k - warmup_steps, span)
        return end_value + (peak_value - end_value) * 0.5 * (1.0 + math.cos(math.pi * j / span))

    return schedule


def linear(init_value: float, end_value: float, transition_steps: int) -> Schedule:
    """init + (end - init) * min(k, T) / T: a linear ramp held at ``end_value`` after T steps."""
    return lambda k: (
        init_value + (end_value - init_value) * min(k, transition_steps) / (transition_steps)
    )


# ----------------------------------------------------------------------------- building blocks


@dataclass
class AdamState:
    step: int  # updates already applied (k); the next update uses t = step + 1
    m: Tree
    v: Tree
    v_max: Tree | None  # None for plain Adam


def adam_init(params: Tree, amsgrad: str | None = None) -> AdamState:
    if amsgrad not in AMSGRAD_VARIANTS:
        raise ValueError(f"unknown AMSGrad variant {amsgrad!r}")
    return AdamState(
        step=0,
        m=zeros_like(params),
        v=zeros_like(params),
        v_max=None if amsgrad is None else zeros_like(params),
    )


def adam_direction(
    grads: Tree,
    state: AdamState,
    *,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    eps_root: float = 0.0,
    amsgrad: str | None = None,
) -> tuple[Tree, AdamState]:
    """One step of the Adam / AMSGrad direction ``u`` (the parameter step is ``-lr * u``).

    m_t = b1 m_{t-1} + (1 - b1) g_t,   v_t = b2 v_{t-1} + (1 - b2) g_t^2,
    mhat_t = m_t / (1 - b1^t),          bc2 = 1 - b2^t
    None:      u = mhat_t / (sqrt(v_t / bc2 + eps_root) + eps)
    "pytorch": vmax_t = max(vmax_{t-1}, v_t);       u = mhat_t / (sqrt(vmax_t/bc2 + eps_root) + eps)
    "optax":   vmax_t = max(vmax_{t-1}, v_t/bc2);   u = mhat_t / (sqrt(vmax_t + eps_root) + eps)
    "paper":   vmax_t = max(vmax_{t-1}, v_t);       u = m_t / (sqrt(vmax_t + eps_root) + eps)
    """
    if amsgrad not in AMSGRAD_VARIANTS:
        raise ValueError(f"unknown AMSGrad variant {amsgrad!r}")
    grads = to_float64(grads)
    t = state.step + 1
    bc1 = 1.0 - b1**t
    bc2 = 1.0 - b2**t
    m = tree_map(lambda m_, g: b1 * m_ + (1.0 - b1) * g, state.m, grads)
    v = tree_map(lambda v_, g: b2 * v_ + (1.0 - b2) * g * g, state.v, grads)
    v_max = None
    if amsgrad is None:
        u = tree_map(lambda m_, v_: (m_ / bc1) / (np.sqrt(v_ / bc2 + eps_root) + eps), m, v)
    elif amsgrad == "pytorch":
        v_max = tree_map(np.maximum, state.v_max, v)
        u = tree_map(lambda m_, vm: (m_ / bc1) / (np.sqrt(vm / bc2 + eps_root) + eps), m, v_max)
    elif amsgrad == "optax":
        v_max = tree_map(lambda vm, v_: np.maximum(vm, v_ / bc2), state.v_max, v)
        u = tree_map(lambda m_, vm: (m_ / bc1) / (np.sqrt(vm + eps_root) + eps), m, v_max)
    else:  # "paper"
        v_max = tree_map(np.maximum, state.v_max, v)
        u = tree_map(lambda m_, vm: m_ / (np.sqrt(vm + eps_root) + eps), m, v_max)
    return u, AdamState(step=t, m=m, v=v, v_max=v_max)


@dataclass
class LionState:
    step: int
    m: Tree


def lion_init(params: Tree) -> LionState:
    return LionState(step=0, m=zeros_like(params))


def lion_direction(
    grads: Tree, state: LionState, *, b1: float = 0.9, b2: float = 0.99
) -> tuple[Tree, LionState]:
    """u = sign(b1 m + (1 - b1) g) (sign(0) = 0), then m <- b2 m + (1 - b2) g."""
    grads = to_float64(grads)
    u = tree_map(lambda m_, g: np.sign(b1 * m_ + (1.0 - b1) * g), state.m, grads)
    m = tree_map(lambda m_, g: b2 * m_ + (1.0 - b2) * g, state.m, grads)
    return u, LionState(step=state.step + 1, m=m)


def l2_gradient(grads: Tree, params: Tree, weight_decay: float, mask: Tree | None = None) -> Tree:
    """Coupled L2: g + wd * theta on the masked leaves, g elsewhere."""
    mask = full_mask(params, mask)
    return tree_map(
        lambda g, p, on: g + (weight_decay * p if on else 0.0),
        to_float64(grads),
        to_float64(params),
        mask,
    )


def decay_rate(
    convention: str,
    weight_decay: float,
    learning_rate: float,
    peak_learning_rate: float | None = None,
) -> float:
    """Decoupled decay per step s_k for the learning rate ``learning_rate`` = lr_k at that step."""
    if convention == "lr":
        return weight_decay * learning_rate
    if convention == "schedule":
        return weight_decay * learning_rate / peak_learning_rate
    if convention == "constant":
        return weight_decay
    if convention == "corrected":
        return weight_decay * learning_rate**2 / peak_learning_rate
    raise ValueError(f"unknown decay convention {convention!r}")


def decoupled_decay(updates: Tree, params: Tree, rate: float, mask: Tree | None = None) -> Tree:
    """u - s_k * theta on the masked leaves, u elsewhere (applied after the lr scaling)."""
    mask = full_mask(params, mask)
    return tree_map(
        lambda u, p, on: u - (rate * p if on else 0.0),
        to_float64(updates),
        to_float64(params),
        mask,
    )


# ----------------------------------------------------------------------------- full optimizers


class AdamL2:
    """Adam with coupled L2 (torch.optim.Adam(weight_decay=wd) when mask is None):

    g' = g + wd_k theta (masked),  theta <- theta - lr_k * u(g')
    """

    def __init__(
        self,
        learning_rate: float | Schedule,
        b1: float = 0.9,
        b2: float = 0.999,
        eps: float = 1e-8,
        *,
        weight_decay: float | Schedule,
        amsgrad: str | None = None,
        eps_root: float = 0.0,
        mask: Tree | None = None,
    ):
        self.lr = as_schedule(learning_rate)
        self.wd = as_schedule(weight_decay)
        self.kw = dict(b1=b1, b2=b2, eps=eps, eps_root=eps_root, amsgrad=amsgrad)
        self.mask = mask

    def init(self, params: Tree) -> AdamState:
        return adam_init(params, self.kw["amsgrad"])

    def step(self, params: Tree, grads: Tree, state: AdamState) -> tuple[Tree, AdamState]:
        k = state.step
        params = to_float64(params)
        grads = l2_gradient(grads, params, self.wd(k), self.mask)
        u, state = adam_direction(grads, state, **self.kw)
        lr = self.lr(k)
        return tree_map(lambda p, u_: p - lr * u_, params, u), state


class AdamW:
    """Adam / AMSGrad with decoupled weight decay (Loshchilov & Hutter Alg. 2):

    theta <- theta - lr_k * u(g) - s_k * theta (masked), s_k from ``decay_rate``.
    With mask None and convention "lr" this is torch.optim.AdamW.
    """

    def __init__(
        self,
        learning_rate: float | Schedule,
        b1: float = 0.9,
        b2: float = 0.999,
        eps: float = 1e-8,
        *,
        weight_decay: float,
        amsgrad: str | None = None,
        convention: str = "lr",
        peak_learning_rate: float | None = None,
        eps_root: float = 0.0,
        mask: Tree | None = None,
    ):
        self.lr = as_schedule(learning_rate)
        self.wd = weight_decay
        self.convention = convention
        self.peak = peak_learning_rate
        self.kw = dict(b1=b1, b2=b2, eps=eps, eps_root=eps_root, amsgrad=amsgrad)
        self.mask = mask

    def init(self, params: Tree) -> AdamState:
        return adam_init(params, self.kw["amsgrad"])

    def step(self, params: Tree, grads: Tree, state: AdamState) -> tuple[Tree, AdamState]:
        k = state.step
        params = to_float64(params)
        u, state = adam_direction(grads, state, **self.kw)
        lr = self.lr(k)
        s = decay_rate(self.convention, self.wd, lr, self.peak)
        return _apply_decoupled(params, u, lr, s, self.mask), state


class Lion:
    """Lion with decoupled weight decay: theta <- theta - lr_k * sign(c) - s_k * theta (masked)."""

    def __init__(
        self,
        learning_rate: float | Schedule,
        b1: float = 0.9,
        b2: float = 0.99,
        *,
        weight_decay: float,
        convention: str = "lr",
        peak_learning_rate: float | None = None,
        mask: Tree | None = None,
    ):
        self.lr = as_schedule(learning_rate)
        self.wd = weight_decay
        self.convention = convention
        self.peak = peak_learning_rate
        self.b1, self.b2 = b1, b2
        self.mask = mask

    def init(self, params: Tree) -> LionState:
        return lion_init(params)

    def step(self, params: Tree, grads: Tree, state: LionState) -> tuple[Tree, LionState]:
        k = state.step
        params = to_float64(params)
        u, state = lion_direction(grads, state, b1=self.b1, b2=self.b2)
        lr = self.lr(k)
        s = decay_rate(self.convention, self.wd, lr, self.peak)
        return _apply_decoupled(params, u, lr, s, self.mask), state


def _apply_decoupled(params: Tree, u: Tree, lr: float, s: float, mask: Tree | None) -> Tree:
    mask = full_mask(params, mask)
    return tree_map(lambda p, u_, on: p - lr * u_ - (s * p if on else 0.0), params, u, mask)


def run(
    optimizer: AdamL2 | AdamW | Lion,
    params: Tree,
    grad_fn: Callable[[int, Tree], Tree],
    num_steps: int,
) -> list[Tree]:
    """Trajectory ``[theta_0, theta_1, ..., theta_n]``; ``grad_fn(k, theta_k)`` gives g_k."""
    params = to_float64(params)
    state = optimizer.init(params)
    trajectory = [params]
    for k in range(num_steps):
        params, state = optimizer.step(params, grad_fn(k, params), state)
        trajectory.append(params)
    return trajectory


# ---------------------------------------------------------------------------------------------
# Block-wise 8-bit state: Dettmers, Lewis, Shleifer & Zettlemoyer, "8-bit Optimizers via
# Block-wise Quantization", ICLR 2022, Sec. 2: per block of B elements (flattened row-major,
# zero-padded) one float32 absmax N_b and codes c_i = argmin_j |q_j - x_i / N_b| into a map q
# (the signed dynamic map for the first moment, the unsigned one for the second); dequantize
# q_{c_i} N_b; each step dequantizes, updates in higher precision, computes the update from the
# new moments and quantizes them again. The maps are data (recorded from bitsandbytes by
# tests/golden/make_dynamic_maps.py), passed in; the nearest value is found by brute force,
# ties toward the value of smaller magnitude.
# ---------------------------------------------------------------------------------------------


@dataclass
class Blockwise8bit:
    codes: np.ndarray  # (n_blocks, B) uint8
    absmax: np.ndarray  # (n_blocks,) float32


def quantize_8bit(x: np.ndarray, qmap: np.ndarray, block: int) -> Blockwise8bit:
    """Nearest codes of ``x / N_b`` per block (the stored scale is float32, as in the paper)."""
    flat = np.asarray(x, np.float64).reshape(-1)
    flat = np.concatenate([flat, np.zeros(-len(flat) % block)])
    blocks = flat.reshape(-1, block)
    absmax = np.max(np.abs(blocks), axis=1).astype(np.float32)
    y = blocks / np.where(absmax > 0, absmax, 1.0).astype(np.float64)[:, None]
    q = np.asarray(qmap, np.float64)
    dist = np.abs(y[..., None] - q)  # (n_blocks, B, 256)
    best = dist == dist.min(axis=-1, keepdims=True)
    codes = np.argmin(np.where(best, np.abs(q), np.inf), axis=-1)  # ties: smaller magnitude
    return Blockwise8bit(codes.astype(np.uint8), absmax)


def dequantize_8bit(s: Blockwise8bit, qmap: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """``q_c N_b`` in float64, the padding dropped."""
    values = np.asarray(qmap, np.float64)[s.codes] * s.absmax.astype(np.float64)[:, None]
    return values.reshape(-1)[: math.prod(shape)].reshape(shape)


@dataclass
class Adam8bitState:
    step: int
    m: Blockwise8bit
    v: Blockwise8bit
    v_max: Blockwise8bit | None


def adam_8bit_direction(
    grad: np.ndarray,
    state: Adam8bitState,
    maps: tuple[np.ndarray, np.ndarray],
    block: int,
    **adam_kwargs: Any,
) -> tuple[np.ndarray, Adam8bitState]:
    """One 8-bit Adam / AMSGrad step on one array: dequantize, :func:`adam_direction` (the
    update from the new unquantized moments), quantize the new moments. ``maps``: (signed,
    unsigned)."""
    signed, unsigned = maps
    shape = np.shape(grad)
    wide = AdamState(
        step=state.step,
        m=dequantize_8bit(state.m, signed, shape),
        v=dequantize_8bit(state.v, unsigned, shape),
        v_max=None if state.v_max is None else dequantize_8bit(state.v_max, unsigned, shape),
    )
    u, new = adam_direction(grad, wide, **adam_kwargs)
    return u, Adam8bitState(
        step=new.step,
        m=quantize_8bit(new.m, signed, block),
        v=quantize_8bit(new.v, unsigned, block),
        v_max=None if new.v_max is None else quantize_8bit(new.v_max, unsigned, block),
    )


def lion_8bit_direction(
    grad: np.ndarray, state: tuple[int, Blockwise8bit], signed: np.ndarray, block: int, **kw: Any
) -> tuple[np.ndarray, tuple[int, Blockwise8bit]]:
    """One 8-bit Lion step on one array: the momentum dequantized, :func:`lion_direction`,
    the new momentum quantized with the signed map."""
    step, m = state
    u, new = lion_direction(grad, LionState(step, dequantize_8bit(m, signed, np.shape(grad))), **kw)
    return u, (new.step, quantize_8bit(new.m, signed, block))


# ---------------------------------------------------------------------------------------------
# bfloat16 state: the moments are stored rounded to bfloat16 (8 significand bits, round to
# nearest, ties to even) after each update; the update itself is computed from the new
# unrounded moments, as with 8-bit state.
# ---------------------------------------------------------------------------------------------


def round_to_bfloat16(x: np.ndarray) -> np.ndarray:
    """``x`` (float64, finite) rounded to float32, then to the nearest bfloat16 (ties to even),
    returned as float64. Written from the format: keep the top 16 bits of the float32."""
    bits = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return rounded.astype(np.uint32).view(np.float32).astype(np.float64)


def adam_bf16_direction(
    grad: np.ndarray, state: AdamState, **adam_kwargs: Any
) -> tuple[np.ndarray, AdamState]:
    """One Adam / AMSGrad step with bfloat16 moments on one array: :func:`adam_direction` on
    the stored (bfloat16-valued) moments, the new moments rounded for storage."""
    u, new = adam_direction(grad, state, **adam_kwargs)
    v_max = None if new.v_max is None else round_to_bfloat16(new.v_max)
    return u, AdamState(new.step, round_to_bfloat16(new.m), round_to_bfloat16(new.v), v_max)


def lion_bf16_direction(
    grad: np.ndarray, state: LionState, **kw: Any
) -> tuple[np.ndarray, LionState]:
    """One Lion step with a bfloat16 momentum on one array."""
    u, new = lion_direction(grad, state, **kw)
    return u, LionState(new.step, round_to_bfloat16(new.m))
