"""Diagnostics that show why coupled and decoupled weight decay behave differently.

They read any optimizer state holding a :class:`~optax_decoupled.ScaleByAdamState` (inside
``chain``, ``inject_hyperparams``, ``MultiSteps``, ``apply_if_finite``...).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from optax_decoupled._src import masks as masks_lib
from optax_decoupled._src import storage as storage_lib
from optax_decoupled._src import validation as V
from optax_decoupled._src.quantization import QuantizedArray, restore_quantized
from optax_decoupled._src.transforms import (
    AMSGRAD_VARIANTS,
    DECAY_CONVENTIONS,
    ScaleByAdamState,
    ScaleByAmsgradState,
    _decay_rate,
)

_ADAM_STATES = (ScaleByAdamState, ScaleByAmsgradState)


def find_adam_state(opt_state: Any) -> Any:
    """The (first) :class:`~optax_decoupled.ScaleByAdamState` or
    :class:`~optax_decoupled.ScaleByAmsgradState` inside a nested optimizer state (Optax's
    own classes, so an ``optax.adam`` state is found too)."""
    found = [
        s
        for s in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, _ADAM_STATES))
        if isinstance(s, _ADAM_STATES)
    ]
    if not found:
        raise ValueError(
            "the optimizer state holds no ScaleByAdamState or ScaleByAmsgradState (not an "
            "Adam variant)."
        )
    return found[0]


def effective_decay(
    opt_state: Any,
    params: Any,
    *,
    learning_rate: float | None,
    weight_decay: float,
    coupled: bool,
    b2: float = 0.999,
    eps: float = 1e-8,
    eps_root: float = 0.0,
    amsgrad: str | None = None,
    convention: str = "lr",
    peak_learning_rate: float | None = None,
    mask: masks_lib.MaskArg = "auto",
    state_dtype: storage_lib.StateDtype = None,
) -> Any:
    r"""Per-element effective decay per step, a pytree shaped like ``params``.

    .. math::

        \text{coupled: } \frac{\eta_t\lambda}{\sqrt{\hat\nu_t+\epsilon_{root}}+\epsilon},
        \qquad
        \text{decoupled: } s_t \;(\text{e.g. } \eta_t\lambda)

    where :math:`\hat\nu_t` is what the denominator of the last step used (the AMSGrad max for
    ``amsgrad`` variants, uncorrected for ``"paper"``). Leaves the mask excludes get 0.
    The hyperparameters must be those of the optimizer that produced ``opt_state``;
    ``learning_rate`` is the value :math:`\eta_t` at the step of interest. For the
    ``"schedule"`` and ``"corrected"`` conventions pass the run's ``peak_learning_rate``
    when it used a schedule: without it :math:`\eta_t` is taken as its own peak, as for a
    constant learning rate (the transform itself refuses a schedule without the peak).
    ``"lr"`` and ``"constant"`` ignore ``peak_learning_rate`` (a given one is still checked);
    decoupled ``"constant"`` also ignores ``learning_rate``, which may then be ``None``.

    ``amsgrad`` must name the convention of the optimizer that produced ``opt_state``: with
    ``coupled=True`` a state that holds AMSGrad's running maximum (``nu_max``) read with
    ``amsgrad=None``, or a plain Adam state read with an AMSGrad convention, is a
    ``ValueError`` (the variant cannot be read off the state, and reading ``nu`` instead of
    ``nu_max`` would give other numbers). ``coupled=False`` does not read the state.

    Raises:
      ValueError: for invalid hyperparameters, checked as the transforms check them
        (``learning_rate``, ``weight_decay``, ``eps``, ``eps_root`` :math:`\ge 0`,
        ``peak_learning_rate`` > 0, ``b2`` in [0, 1), all finite; ``coupled`` a bool;
        ``amsgrad`` and ``convention`` one of their choices; values at one step, not
        schedules), for an ``amsgrad`` that does not match the state, and for a state without
        a :class:`~optax_decoupled.ScaleByAdamState` or whose moments do not match ``params``
        (``coupled=True``).

    Examples:
      >>> import jax.numpy as jnp
      >>> import optax_decoupled as od
      >>> params = {"w": jnp.ones((4, 4))}
      >>> grads = {"w": jnp.full((4, 4), 0.1)}
      >>> for alias, coupled in ((od.adamw, False), (od.adam_l2, True)):
      ...     tx = alias(1e-3, weight_decay=1e-2)
      ...     _, state = tx.update(grads, tx.init(params), params)
      ...     d = od.diagnostics.effective_decay(
      ...         state, params, learning_rate=1e-3, weight_decay=1e-2, coupled=coupled)
      ...     print(alias.__name__, f"{float(d['w'][0, 0]):.1e}")
      adamw 1.0e-05
      adam_l2 9.1e-05

    References:
      Loshchilov & Hutter, `Decoupled Weight Decay Regularization
      <https://arxiv.org/abs/1711.05101>`_, ICLR 2019.
    """
    if not isinstance(coupled, bool):
        raise ValueError(f"`coupled` must be a bool, got {coupled!r}.")
    V.check_choice("amsgrad", amsgrad, AMSGRAD_VARIANTS)
    V.check_choice("convention", convention, DECAY_CONVENTIONS)
    values = {
        "learning_rate": learning_rate,
        "weight_decay": weight_decay,
        "b2": b2,
        "eps": eps,
        "eps_root": eps_root,
        "peak_learning_rate": peak_learning_rate,
    }
    for name, value in values.items():
        if callable(value):
            raise ValueError(
                f"`{name}` must be a number or an array, not a schedule: effective_decay "
                "reads one step; pass the schedule's value at that step."
            )
    if learning_rate is not None or coupled or convention != "constant":
        V.check_non_negative("learning_rate", learning_rate)  # decoupled "constant": unused
    for name in ("weight_decay", "eps", "eps_root"):
        V.check_non_negative(name, values[name])
    V.check_beta("b2", b2)
    if peak_learning_rate is not None:  # checked even where the convention ignores it
        V.check_positive("peak_learning_rate", peak_learning_rate)
    decays = masks_lib.resolve_mask(mask, params)
    if not coupled:
        s = _decay_rate(weight_decay, convention, learning_rate, peak_learning_rate)  # checked
        return jax.tree.map(
            lambda p, m: jnp.full(jnp.shape(p), s if m else 0.0, jnp.float32), params, decays
        )
    adam = find_adam_state(opt_state)
    nu_max = getattr(adam, "nu_max", None)
    if nu_max is not None and amsgrad is None:
        raise ValueError(
            "effective_decay: the optimizer state holds AMSGrad's running maximum (nu_max), "
            "but `amsgrad` is None; pass the optimizer's AMSGrad convention "
            f"({', '.join(repr(v) for v in AMSGRAD_VARIANTS if v is not None)})."
        )
    if nu_max is None and amsgrad is not None:
        raise ValueError(
            f"effective_decay: `amsgrad` is {amsgrad!r} but the optimizer state is plain Adam "
            "(it holds no AMSGrad maximum nu_max); pass amsgrad=None."
        )
    store = storage_lib.resolve_moment_storages(state_dtype, ("mu", "nu"))["nu"]
    # Leaves, not trees: under flax.nnx the parameters are Param variables and the state's
    # moments OptState variables, which jax.tree.map cannot pair.
    (count,) = jax.tree.leaves(adam.count)
    count = jnp.maximum(count, 1)
    bc2 = 1.0 - b2 ** count.astype(jnp.float32)
    p_leaves, treedef = jax.tree.flatten(params)
    # (An nnx.Optimizer's state holds 8-bit moments as {codes, absmax} States after a step.)
    nu_tree = restore_quantized(adam.nu if amsgrad is None else nu_max, signed=False)
    nu_leaves = jax.tree.leaves(nu_tree, is_leaf=lambda x: isinstance(x, QuantizedArray))
    if len(nu_leaves) != len(p_leaves):
        raise ValueError(
            f"effective_decay: the optimizer state's second moment has {len(nu_leaves)} "
            f"leaves but `params` has {len(p_leaves)}; pass the parameters it was built for."
        )

    def leaf(p, nu_s, m):
        if not m:
            return jnp.zeros(jnp.shape(p), jnp.float32)
        if isinstance(nu_s, QuantizedArray):  # 8-bit: the state says so, whatever state_dtype
            nu = storage_lib.BlockwiseInt8Storage().read(nu_s, p)
        else:
            nu = store.read(nu_s, p)
        nu = nu.astype(jnp.float32)
        if amsgrad in (None, "pytorch"):
            nu = nu / bc2
        return learning_rate * weight_decay / (jnp.sqrt(nu + eps_root) + eps)

    flags = jax.tree.leaves(decays)
    return jax.tree.unflatten(
        treedef, [leaf(*z) for z in zip(p_leaves, nu_leaves, flags, strict=True)]
    )


def group_of(components: tuple[str, ...], ndim: int) -> str:
    """The diagnostic group of a leaf: ``decayed`` (the ``"auto"`` rule) or why it is not
    (the name rule that excludes it, see :func:`~optax_decoupled._src.masks.auto_no_decay_reason`,
    or ``other (ndim < 2)``)."""
    reason = masks_lib.auto_no_decay_reason(components)
    if reason is not None:
        return reason
    return "decayed" if ndim >= 2 else "other (ndim < 2)"


def group_norms(params: Any) -> dict[str, jax.Array]:
    r"""Euclidean norm :math:`\lVert\theta_G\rVert_2` of each group of :func:`group_of`.

    Examples:
      >>> import jax.numpy as jnp
      >>> import optax_decoupled as od
      >>> norms = od.diagnostics.group_norms({"w": jnp.ones((3, 3)), "b": jnp.ones(4)})
      >>> {k: float(v) for k, v in norms.items()}
      {'bias': 2.0, 'decayed': 3.0}
    """
    sums: dict[str, jax.Array] = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        g = group_of(masks_lib.path_components(path), jnp.ndim(leaf))
        sq = jnp.sum(jnp.square(jnp.asarray(leaf, jnp.float32)))
        sums[g] = sums.get(g, 0.0) + sq
    return {k: jnp.sqrt(v) for k, v in sorted(sums.items())}


def update_ratios(updates: Any, params: Any, tiny: float = 1e-12) -> dict[str, jax.Array]:
    r""":math:`\lVert u\rVert_2/\lVert\theta\rVert_2` per leaf, keyed by ``/``-joined path."""
    out = {}
    u_leaves = jax.tree.leaves(updates)
    p_leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    for (path, p), u in zip(p_leaves, u_leaves, strict=True):
        pn = jnp.linalg.norm(jnp.ravel(jnp.asarray(p, jnp.float32)))
        un = jnp.linalg.norm(jnp.ravel(jnp.asarray(u, jnp.float32)))
        out[masks_lib.path_string(path)] = un / jnp.maximum(pn, tiny)
    return out


def decay_in_force(
    params: Any,
    updates: Any,
    *,
    learning_rate: Any,
    weight_decay: float,
    convention: str = "lr",
    peak_learning_rate: Any = None,
    mask: masks_lib.MaskArg = "auto",
    b1: float = 0.9,
) -> dict[str, dict[str, jax.Array]]:
    r"""The decoupled decay acting at a step, per parameter group of :func:`group_of`.

    For each group of decayed leaves (the others have no decay in force):

    * ``timescale``: :math:`\tau = 1/s_t` steps, the span of the exponential moving average
      the weights are (Wang & Aitchison, ICML 2025; :func:`~optax_decoupled.decay_rate`);
    * ``box``: :math:`\lambda\lVert\theta\rVert_\infty`; AdamW's iterates converge to the box
      :math:`\lVert\theta\rVert_\infty \le 1/\lambda` (Xie & Li, ICML 2024), so a value near 1
      means the box binds (meaningful for ``"lr"``, where :math:`\lambda` is the box's
      inverse radius in units of the normalised step);
    * ``update_ratio``: :math:`\lVert u\rVert_2/\lVert\theta\rVert_2` of the step ``updates``;
    * ``equilibrium_ratio``: :math:`\sqrt{2 s_t (1-\beta_1)/(1+\beta_1)}`, the ratio at
      which shrinking by :math:`s_t` balances the growth of :math:`\lVert\theta\rVert^2` by
      steps of random direction smoothed by momentum :math:`\beta_1` (the rotational
      equilibrium of Kosson et al., ICML 2024; :math:`\sqrt{2 s_t}` without momentum).

    Args:
      params: the parameters at the step.
      updates: the step applied to them (what ``tx.update`` returned).
      learning_rate: :math:`\eta_t` at the step (a number); ignored by ``"constant"``.
      weight_decay: :math:`\lambda > 0`.
      convention, peak_learning_rate: as :func:`~optax_decoupled.decoupled_weight_decay`.
      mask: the optimizer's mask.
      b1: the momentum :math:`\beta_1` of the optimizer's direction (Adam's and Lion's
        first-moment rate; 0 for none).

    Examples:
      >>> import jax.numpy as jnp
      >>> import optax_decoupled as od
      >>> params = {"w": jnp.full((4, 4), 2.0), "b": jnp.ones(4)}
      >>> updates = {"w": jnp.full((4, 4), -1e-3), "b": jnp.zeros(4)}
      >>> d = od.diagnostics.decay_in_force(params, updates, learning_rate=1e-3, weight_decay=0.1)
      >>> print(sorted(d), f"{d['decayed']['timescale']:.0f} {d['decayed']['box']:.2f}")
      ['decayed'] 10000 0.20
    """
    V.check_not_schedule("weight_decay", weight_decay)
    V.check_positive("weight_decay", weight_decay)
    V.check_choice("convention", convention, DECAY_CONVENTIONS)
    V.check_beta("b1", b1)
    lr = None if convention == "constant" else learning_rate
    s = _decay_rate(weight_decay, convention, lr, peak_learning_rate)
    decays = masks_lib.resolve_mask(mask, params)
    groups: dict[str, dict[str, Any]] = {}
    p_leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    for (path, p), u, m in zip(
        p_leaves, jax.tree.leaves(updates), jax.tree.leaves(decays), strict=True
    ):
        if not m:
            continue
        g = group_of(masks_lib.path_components(path), jnp.ndim(p))
        acc = groups.setdefault(g, {"p2": 0.0, "u2": 0.0, "inf": 0.0})
        p32, u32 = jnp.abs(jnp.asarray(p, jnp.float32)), jnp.abs(jnp.asarray(u, jnp.float32))
        acc["p2"] = acc["p2"] + jnp.sum(p32 * p32)
        acc["u2"] = acc["u2"] + jnp.sum(u32 * u32)
        acc["inf"] = jnp.maximum(acc["inf"], jnp.max(p32, initial=0.0))
    s = jnp.asarray(s, jnp.float32)
    return {
        g: {
            "timescale": 1.0 / s,
            "box": weight_decay * acc["inf"],
            "update_ratio": jnp.sqrt(acc["u2"]) / jnp.maximum(jnp.sqrt(acc["p2"]), 1e-12),
            "equilibrium_ratio": jnp.sqrt(2.0 * s * (1.0 - b1) / (1.0 + b1)),
        }
        for g, acc in sorted(groups.items())
    }
