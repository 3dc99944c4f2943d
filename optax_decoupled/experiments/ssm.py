r"""A Mamba-2-style selective state-space model in Flax NNX, written from the papers' equations.

References:
  * T. Dao and A. Gu, "Transformers are SSMs: Generalized Models and Efficient Algorithms
    Through Structured State Space Duality", ICML 2024 (Mamba-2, the SSD algorithm).
  * A. Gu and T. Dao, "Mamba: Linear-Time Sequence Modeling with Selective State Spaces", 2023.

The selective SSM with a scalar decay per head (Mamba-2, Dao & Gu 2024, §3-§7). For head
:math:`h`, time step :math:`t`, state :math:`H_t \in \mathbb{R}^{P \times N}` (``P`` the head
dimension, ``N`` the state size):

.. math::

   \Delta_t &= \operatorname{softplus}(\Delta^{\text{raw}}_t + b_\Delta), \qquad
   A = -\exp(A_{\log}) < 0, \\
   H_t &= \exp(\Delta_t A)\, H_{t-1} + \Delta_t\, x_t B_t^\top, \\
   y_t &= H_t C_t + D\, x_t .

This is the zero-order-hold discretisation of :math:`A` with the simplified (Euler) :math:`B`
used by Mamba. Unrolled, :math:`y = M x` with the 1-semiseparable matrix
:math:`M_{ts} = C_t^\top B_s \Delta_s \exp(\sum_{r=s+1}^{t} \Delta_r A)` for :math:`s \le t`.

Two backends compute the same :math:`y` (without the :math:`D` skip):

* ``"ssd"`` -- the chunked state-space-dual algorithm (Dao & Gu 2024, §6, Listing 1): split the
  sequence into chunks of length ``Q``; diagonal blocks of :math:`M` are materialised
  (quadratic, attention-like), off-diagonal blocks are low rank and pass through the chunk
  states with a short recurrence over chunks.
* ``"scan"`` -- a sequential :func:`jax.lax.scan` over time that discretises inside the step,
  with the step wrapped in :func:`jax.checkpoint` so the backward pass recomputes the step's
  intermediates instead of storing them.

The block (Mamba-2, Fig. 6): ``in_proj`` to ``[z, x, B, C, dt]``; a depthwise causal conv1d
(kernel 4, with bias) over ``[x, B, C]`` followed by SiLU; the SSM; the ``D`` skip; a gated
RMSNorm ``norm(y * silu(z))``; ``out_proj``. Blocks are stacked pre-norm residually,
``u + Mixer(RMSNorm(u))``, with a final RMSNorm and a token- or sequence-classification head.

Parameter names ``A_log``, ``D`` and ``dt_bias`` are exactly Mamba's, so decay masks that
exclude them by name (``optax_decoupled``'s ``mask="auto"``) find them. Normalisation gains are
called ``scale``, biases ``bias``, the token embedding ``embedding``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

import jax
import jax.numpy as jnp
from flax import nnx

Backend = Literal["ssd", "scan"]


@dataclasses.dataclass(frozen=True)
class SSMConfig:
    """Hyperparameters of :class:`Mamba2Model` (hashable, so it can be a static argument).

    Attributes:
      d_model: residual-stream width.
      n_layers: number of residual Mamba-2 blocks.
      d_state: SSM state size ``N``.
      expand: ``d_inner = expand * d_model``.
      headdim: head dimension ``P``; ``nheads = d_inner // headdim``.
      d_conv: kernel size of the depthwise causal convolution (4 in Mamba).
      chunk_size: chunk length ``Q`` of the SSD backend.
      backend: ``"ssd"`` (chunked) or ``"scan"`` (sequential, rematerialised).
      vocab_size: if set, inputs are token ids embedded by an ``nnx.Embed``.
      input_dim: if set (and ``vocab_size`` is not), inputs are real vectors of this size fed
        through a linear input projection.
      num_classes: output classes of the head.
      head: ``"token"`` (logits at every position) or ``"sequence"`` (one logit vector per
        sequence, from pooled features).
      pool: pooling of the sequence head: ``"mean"`` over time or ``"last"`` position.
      dt_min, dt_max: ``softplus(dt_bias)`` is log-uniform in ``[dt_min, dt_max]`` at init.
      dt_init_floor: lower clamp of the initial ``dt``.
      a_init_range: ``-A = exp(A_log)`` is uniform in this range at init.
      norm_eps: epsilon of the RMSNorms.
    """

    d_model: int = 64
    n_layers: int = 2
    d_state: int = 16
    expand: int = 2
    headdim: int = 16
    d_conv: int = 4
    chunk_size: int = 16
    backend: Backend = "ssd"
    vocab_size: int | None = None
    input_dim: int | None = None
    num_classes: int = 10
    head: Literal["token", "sequence"] = "token"
    pool: Literal["mean", "last"] = "mean"
    dt_min: float = 1e-3
    dt_max: float = 1e-1
    dt_init_floor: float = 1e-4
    a_init_range: tuple[float, float] = (1.0, 16.0)
    norm_eps: float = 1e-5

    def __post_init__(self):
        if self.d_inner % self.headdim:
            raise ValueError(
                f"expand * d_model = {self.d_inner} must be divisible by headdim = "
                f"{self.headdim}; change headdim or d_model."
            )
        if self.backend not in ("ssd", "scan"):
            raise ValueError(f"backend must be 'ssd' or 'scan', got {self.backend!r}.")
        if self.head not in ("token", "sequence"):
            raise ValueError(f"head must be 'token' or 'sequence', got {self.head!r}.")
        if self.pool not in ("mean", "last"):
            raise ValueError(f"pool must be 'mean' or 'last', got {self.pool!r}.")
        if (self.vocab_size is None) == (self.input_dim is None):
            raise ValueError("Set exactly one of vocab_size (token inputs) or input_dim.")
        if not 0 < self.dt_min <= self.dt_max:
            raise ValueError(f"need 0 < dt_min <= dt_max, got {self.dt_min}, {self.dt_max}.")
        lo, hi = self.a_init_range
        if not 0 < lo <= hi:
            raise ValueError(f"need 0 < a_init_range[0] <= [1], got {self.a_init_range}.")

    @property
    def d_inner(self) -> int:
        return self.expand * self.d_model

    @property
    def nheads(self) -> int:
        return self.d_inner // self.headdim


# ---------------------------------------------------------------------------------------------
# The selective scan: two backends with the same math.
# Shapes: b batch, l length, h heads, p head dim, n state size, c chunks, q chunk length.
# ---------------------------------------------------------------------------------------------


def segsum(a: jax.Array) -> jax.Array:
    r"""Stable segment sums: ``out[..., i, j] = sum(a[..., j+1 : i+1])`` for ``j <= i``, else -inf.

    ``exp(segsum(a))`` is the lower-triangular decay matrix
    :math:`L_{ij} = \prod_{r=j+1}^{i} \exp(a_r)` of Dao & Gu 2024, eq. (4) / Listing 1. The
    masked cumulative sum avoids subtracting two large cumulative sums.
    """
    t = a.shape[-1]
    x = jnp.broadcast_to(a[..., None], (*a.shape, t))  # (..., t, t): x[..., i, j] = a[i]
    strict = jnp.tril(jnp.ones((t, t), dtype=bool), k=-1)
    x = jnp.where(strict, x, 0.0)
    x = jnp.cumsum(x, axis=-2)  # x[..., i, j] = sum_{r=j+1}^{i} a[r]
    lower = jnp.tril(jnp.ones((t, t), dtype=bool), k=0)
    return jnp.where(lower, x, -jnp.inf)


def ssd_chunked(
    x: jax.Array, dt: jax.Array, A: jax.Array, B: jax.Array, C: jax.Array, chunk_size: int
) -> jax.Array:
    r"""Chunked SSD (Dao & Gu 2024, §6, Listing 1), one B/C group shared by all heads.

    Args:
      x: ``(b, l, h, p)`` inputs.
      dt: ``(b, l, h)`` positive step sizes (after softplus).
      A: ``(h,)`` negative scalar decay rates.
      B: ``(b, l, n)`` input matrices.
      C: ``(b, l, n)`` output matrices.
      chunk_size: chunk length ``q``; ``l`` is zero-padded to a multiple of it (padding sits
        after the sequence, so by causality it does not change the outputs).

    Returns:
      ``y`` of shape ``(b, l, h, p)`` with :math:`y_t = \sum_{s \le t} M_{ts} x_s` (no D skip).
    """
    b, l, h, p = x.shape
    q = chunk_size
    pad = (-l) % q
    if pad:
        x, dt, B, C = (
            jnp.pad(v, [(0, 0), (0, pad)] + [(0, 0)] * (v.ndim - 2)) for v in (x, dt, B, C)
        )
    c = (l + pad) // q

    X = (x * dt[..., None]).reshape(b, c, q, h, p)  # (b, c, q, h, p): Delta_t x_t
    a = (dt * A).reshape(b, c, q, h).transpose(0, 3, 1, 2)  # (b, h, c, q): Delta_t A
    B = B.reshape(b, c, q, -1)  # (b, c, q, n)
    C = C.reshape(b, c, q, -1)  # (b, c, q, n)
    a_cumsum = jnp.cumsum(a, axis=-1)  # (b, h, c, q)

    # 1. Diagonal blocks: y = (C B^T o L) X inside each chunk (the "attention" form).
    L = jnp.exp(segsum(a))  # (b, h, c, q, q)
    CB = jnp.einsum("bcln,bcsn->bcls", C, B)  # (b, c, q, q)
    y_diag = jnp.einsum("bcls,bhcls,bcshp->bclhp", CB, L, X)  # (b, c, q, h, p)

    # 2. State at the end of each chunk from that chunk's inputs alone.
    decay_states = jnp.exp(a_cumsum[..., -1:] - a_cumsum)  # (b, h, c, q)
    states = jnp.einsum("bcln,bhcl,bclhp->bchpn", B, decay_states, X)  # (b, c, h, p, n)

    # 3. Recurrence over chunks: pass states on, decayed by each chunk's total decay.
    states = jnp.concatenate([jnp.zeros_like(states[:, :1]), states], axis=1)  # (b, c+1, h, p, n)
    chunk_decay = jnp.pad(a_cumsum[..., -1], [(0, 0), (0, 0), (1, 0)])  # (b, h, c+1)
    decay_chunk = jnp.exp(segsum(chunk_decay))  # (b, h, c+1, c+1)
    states = jnp.einsum("bhzc,bchpn->bzhpn", decay_chunk, states)[:, :-1]  # (b, c, h, p, n)

    # 4. Off-diagonal blocks: read the incoming state out with C, decayed to each position.
    state_decay_out = jnp.exp(a_cumsum)  # (b, h, c, q)
    y_off = jnp.einsum("bcln,bchpn,bhcl->bclhp", C, states, state_decay_out)  # (b, c, q, h, p)

    y = (y_diag + y_off).reshape(b, c * q, h, p)
    return y[:, :l]


def selective_scan(
    x: jax.Array, dt: jax.Array, A: jax.Array, B: jax.Array, C: jax.Array
) -> jax.Array:
    r"""Sequential selective scan over time, discretising inside a rematerialised step.

    Same arguments and result as :func:`ssd_chunked` (no chunk size). The step

    .. math:: H_t = \exp(\Delta_t A) H_{t-1} + \Delta_t x_t B_t^\top, \qquad y_t = H_t C_t

    is wrapped in :func:`jax.checkpoint`; the carry ``H`` is ``(b, h, p, n)``.
    """
    b, l, h, p = x.shape
    n = B.shape[-1]

    @jax.checkpoint
    def step(state, inputs):
        x_t, dt_t, B_t, C_t = inputs  # (b, h, p), (b, h), (b, n), (b, n)
        decay = jnp.exp(dt_t * A)  # (b, h): zero-order hold of A
        dBx = (dt_t[..., None] * x_t)[..., None] * B_t[:, None, None, :]  # (b, h, p, n)
        state = decay[..., None, None] * state + dBx  # (b, h, p, n)
        y_t = jnp.einsum("bhpn,bn->bhp", state, C_t)  # (b, h, p)
        return state, y_t

    state0 = jnp.zeros((b, h, p, n), x.dtype)
    time_major = [jnp.moveaxis(v, 1, 0) for v in (x, dt, B, C)]  # (l, b, ...)
    _, ys = jax.lax.scan(step, state0, time_major)  # (l, b, h, p)
    return jnp.moveaxis(ys, 0, 1)


def ssm(
    x: jax.Array,
    dt: jax.Array,
    A: jax.Array,
    B: jax.Array,
    C: jax.Array,
    *,
    backend: Backend = "ssd",
    chunk_size: int = 16,
) -> jax.Array:
    """Dispatch to :func:`ssd_chunked` or :func:`selective_scan` (same math)."""
    if backend == "ssd":
        return ssd_chunked(x, dt, A, B, C, chunk_size)
    if backend == "scan":
        return selective_scan(x, dt, A, B, C)
    raise ValueError(f"backend must be 'ssd' or 'scan', got {backend!r}.")


# ---------------------------------------------------------------------------------------------
# Modules.
# ---------------------------------------------------------------------------------------------


def inverse_softplus(y: jax.Array) -> jax.Array:
    """``x`` with ``softplus(x) = y`` for ``y > 0``: ``y + log(-expm1(-y))``."""
    return y + jnp.log(-jnp.expm1(-y))


class CausalConv1d(nnx.Module):
    """Depthwise causal 1-D convolution with bias: ``out_t = bias + sum_k kernel_k * in_{t-K+1+k}``.

    ``kernel`` is ``(K, channels)``; initialised like PyTorch's ``Conv1d`` (fan-in ``K``).
    """

    def __init__(self, channels: int, kernel_size: int, *, rngs: nnx.Rngs):
        bound = 1.0 / math.sqrt(kernel_size)
        self.kernel = nnx.Param(
            jax.random.uniform(rngs.params(), (kernel_size, channels), minval=-bound, maxval=bound)
        )
        self.bias = nnx.Param(
            jax.random.uniform(rngs.params(), (channels,), minval=-bound, maxval=bound)
        )

    def __call__(self, u: jax.Array) -> jax.Array:  # u: (b, l, channels)
        k = self.kernel.shape[0]
        l = u.shape[1]
        padded = jnp.pad(u, [(0, 0), (k - 1, 0), (0, 0)])  # (b, l + k - 1, channels)
        out = sum(padded[:, i : i + l] * self.kernel[i] for i in range(k))  # (b, l, channels)
        return out + self.bias[...]


class GatedRMSNorm(nnx.Module):
    r"""Mamba-2's gated RMSNorm: :math:`g = y \cdot \operatorname{silu}(z)`,
    :math:`\text{out} = g / \sqrt{\operatorname{mean}(g^2) + \epsilon} \cdot \text{scale}`."""

    def __init__(self, dim: int, eps: float = 1e-5):
        self.scale = nnx.Param(jnp.ones((dim,)))
        self.eps = eps

    def __call__(self, y: jax.Array, z: jax.Array) -> jax.Array:  # (..., dim) each
        g = y * jax.nn.silu(z)
        g = g * jax.lax.rsqrt(jnp.mean(g * g, axis=-1, keepdims=True) + self.eps)
        return g * self.scale[...]


class Mamba2Mixer(nnx.Module):
    """The Mamba-2 mixer (Dao & Gu 2024, §7.1 and Fig. 6), one B/C group, scalar A per head."""

    def __init__(self, config: SSMConfig, *, rngs: nnx.Rngs):
        self.config = config
        d, di, n, h = config.d_model, config.d_inner, config.d_state, config.nheads
        self.conv_dim = di + 2 * n  # channels of [x, B, C]
        # in_proj: d_model -> [z (di), x (di), B (n), C (n), dt (h)]
        self.in_proj = nnx.Linear(d, 2 * di + 2 * n + h, use_bias=False, rngs=rngs)
        self.conv1d = CausalConv1d(self.conv_dim, config.d_conv, rngs=rngs)

        # dt_bias = softplus^{-1}(dt), dt log-uniform in [dt_min, dt_max] (Mamba's init).
        log_lo, log_hi = math.log(config.dt_min), math.log(config.dt_max)
        dt = jnp.exp(jax.random.uniform(rngs.params(), (h,), minval=log_lo, maxval=log_hi))
        dt = jnp.maximum(dt, config.dt_init_floor)
        self.dt_bias = nnx.Param(inverse_softplus(dt))  # (h,)
        # A = -exp(A_log), -A uniform in a_init_range.
        lo, hi = config.a_init_range
        self.A_log = nnx.Param(
            jnp.log(jax.random.uniform(rngs.params(), (h,), minval=lo, maxval=hi))
        )
        self.D = nnx.Param(jnp.ones((h,)))  # (h,) skip connection
        self.norm = GatedRMSNorm(di, eps=config.norm_eps)
        self.out_proj = nnx.Linear(di, d, use_bias=False, rngs=rngs)

    def __call__(self, u: jax.Array) -> jax.Array:  # u: (b, l, d_model)
        cfg = self.config
        b, l, _ = u.shape
        di, n, h, p = cfg.d_inner, cfg.d_state, cfg.nheads, cfg.headdim
        zxbcdt = self.in_proj(u)  # (b, l, 2 di + 2 n + h)
        z, xBC, dt_raw = jnp.split(zxbcdt, [di, di + self.conv_dim], axis=-1)
        xBC = jax.nn.silu(self.conv1d(xBC))  # (b, l, di + 2 n)
        x, B, C = jnp.split(xBC, [di, di + n], axis=-1)  # (b, l, di), (b, l, n), (b, l, n)
        x = x.reshape(b, l, h, p)  # (b, l, h, p)
        dt = jax.nn.softplus(dt_raw + self.dt_bias[...])  # (b, l, h)
        A = -jnp.exp(self.A_log[...])  # (h,)
        y = ssm(x, dt, A, B, C, backend=cfg.backend, chunk_size=cfg.chunk_size)  # (b, l, h, p)
        y = y + self.D[...][:, None] * x  # D skip per head
        y = self.norm(y.reshape(b, l, di), z)  # (b, l, di)
        return self.out_proj(y)  # (b, l, d_model)


class ResidualBlock(nnx.Module):
    """Pre-norm residual block: ``u + Mixer(RMSNorm(u))``."""

    def __init__(self, config: SSMConfig, *, rngs: nnx.Rngs):
        self.norm = nnx.RMSNorm(config.d_model, epsilon=config.norm_eps, rngs=rngs)
        self.mixer = Mamba2Mixer(config, rngs=rngs)

    def __call__(self, u: jax.Array) -> jax.Array:  # (b, l, d_model)
        return u + self.mixer(self.norm(u))


class Mamba2Model(nnx.Module):
    """Embedding or input projection, ``n_layers`` residual Mamba-2 blocks, final RMSNorm, head.

    Call with token ids ``(b, l)`` (``vocab_size`` set) or real inputs ``(b, l, input_dim)``.
    Returns logits ``(b, l, num_classes)`` for ``head="token"`` or ``(b, num_classes)`` for
    ``head="sequence"``.
    """

    def __init__(self, config: SSMConfig, *, rngs: nnx.Rngs):
        self.config = config
        if config.vocab_size is not None:
            self.embed = nnx.Embed(config.vocab_size, config.d_model, rngs=rngs)
        else:
            self.input_proj = nnx.Linear(config.input_dim, config.d_model, rngs=rngs)
        self.layers = nnx.List([ResidualBlock(config, rngs=rngs) for _ in range(config.n_layers)])
        self.norm_f = nnx.RMSNorm(config.d_model, epsilon=config.norm_eps, rngs=rngs)
        self.head = nnx.Linear(config.d_model, config.num_classes, rngs=rngs)

    def __call__(self, inputs: jax.Array) -> jax.Array:
        cfg = self.config
        if cfg.vocab_size is not None:
            u = self.embed(inputs)  # (b, l) -> (b, l, d_model)
        else:
            u = self.input_proj(inputs)  # (b, l, input_dim) -> (b, l, d_model)
        for layer in self.layers:
            u = layer(u)  # (b, l, d_model)
        u = self.norm_f(u)
        if cfg.head == "sequence":
            u = u.mean(axis=1) if cfg.pool == "mean" else u[:, -1]  # (b, d_model)
        return self.head(u)  # (b, l, classes) or (b, classes)
