r"""The building blocks: coupled L2, decoupled weight decay, Adam/AMSGrad scaling, Lion.

Each function validates its concrete arguments and returns an
:class:`optax.GradientTransformation` with a ``NamedTuple`` state; ``aliases`` chains them
into the usual optimizers. Steps are counted from 0 in ``state.count`` and schedules are read
at ``count``, as in Optax, so every transform of a chain sees the same :math:`\eta_t`.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax

from optax_decoupled._src import masks as masks_lib
from optax_decoupled._src import quantization as quant_lib
from optax_decoupled._src import storage as storage_lib
from optax_decoupled._src import validation as V
from optax_decoupled._src.moment_updates import LION_MODES, EmaMoments, lion_direction

#: Weight-decay conventions of :func:`decoupled_weight_decay`.
DECAY_CONVENTIONS = ("lr", "schedule", "constant", "corrected")
#: AMSGrad conventions of :func:`scale_by_adam`.
AMSGRAD_VARIANTS = (None, "pytorch", "optax", "paper")


def _at(name: str, value: Any, count: jax.Array) -> Any:
    """The hyperparameter ``name``'s value at step ``count``: a schedule is called and its value
    checked like a number (>= 0 and finite; concrete values only, so not under ``jit``), any
    other value is returned as given (it was checked when the transform was built)."""
    if not callable(value):
        return value
    value_t = value(count)
    V.check_schedule_value(name, value_t, count)
    return value_t


def _check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"`{name}` must be a bool, got {value!r}.")


def _check_hyperparam(name: str, value: Any, check=V.check_non_negative) -> None:
    if not callable(value):
        check(name, value)


def _map_unzip(fn, n_out: int, tree: Any, *rest: Any) -> list[Any]:
    """``jax.tree.map`` of ``fn`` returning ``n_out`` values per leaf, unzipped into one tree
    per output (``n_out`` empty trees for a tree without leaves, e.g. every leaf masked out
    by ``optax.masked``).

    ``tree`` (the updates) gives the structure; ``rest`` may hold deeper subtrees per leaf
    (stored moments).
    """
    treedef = jax.tree.structure(tree)
    parts = treedef.flatten_up_to(jax.tree.map(fn, tree, *rest))
    return [treedef.unflatten([p[i] for p in parts]) for i in range(n_out)]


def _restore_quantized_moments(state: Any, unsigned: tuple[str, ...]) -> Any:
    """``state`` (a NamedTuple of moment trees) with 8-bit moments that an ``nnx.Optimizer``
    flattened into ``{codes, absmax}`` mappings rebuilt (see
    :func:`~optax_decoupled._src.quantization.restore_quantized`); the fields in ``unsigned``
    hold unsigned moments, the other moment fields signed ones."""
    fields = {}
    for name in state._fields:
        value = getattr(state, name)
        if name != "count" and value is not None:
            fields[name] = quant_lib.restore_quantized(value, signed=name not in unsigned)
    return state._replace(**fields)


def _check_shapes(updates: Any, reference: Any, name: str, what: str) -> None:
    """Raises ``ValueError`` naming the first leaf whose update shape differs from the
    reference's (JAX would otherwise broadcast e.g. a (3,) gradient against a (2, 3) moment).
    A quantized moment keeps no shape: its number of blocks is compared with the update's
    size (the transforms also compare the updates with ``params`` when they get them)."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(updates)
    try:
        refs = treedef.flatten_up_to(reference)
    except (ValueError, TypeError):
        return  # structure mismatches get JAX's own error naming the key path
    for (path, u), r in zip(leaves, refs, strict=True):
        if isinstance(r, quant_lib.QuantizedArray) and r.codes.ndim == 2:
            size = int(np.prod(jnp.shape(u)))
            if quant_lib.num_blocks(size, r.block_size) != r.codes.shape[0]:
                raise ValueError(
                    f"{name}: the update at {jax.tree_util.keystr(path)} has shape "
                    f"{jnp.shape(u)} ({size} elements) but the 8-bit {what} holds "
                    f"{r.codes.shape[0]} blocks of {r.block_size}; gradients must have their "
                    "parameters' shapes."
                )
        elif hasattr(r, "shape") and not isinstance(r, tuple) and jnp.shape(u) != jnp.shape(r):
            raise ValueError(
                f"{name}: the update at {jax.tree_util.keystr(path)} has shape {jnp.shape(u)} "
                f"but the {what} has shape {jnp.shape(r)}; gradients must have their "
                "parameters' shapes."
            )


def check_hyperparameter_shapes(transform: str, values: dict[str, Any], updates: Any) -> None:
    """Raises ``ValueError`` naming a hyperparameter whose array shape does not broadcast to
    an update's shape without changing it (a ``(3, 1)`` weight decay against a ``(3,)``
    parameter would make a ``(3, 3)`` update). Scalars, ``None`` and arrays that broadcast
    to every leaf (e.g. one of the parameter's own shape) pass; shapes are static, so
    traced values are checked too."""
    shaped = {n: jnp.shape(v) for n, v in values.items() if v is not None and jnp.ndim(v)}
    if not shaped:
        return
    for path, u in jax.tree_util.tree_flatten_with_path(updates)[0]:
        target = jnp.shape(u)
        for name, shape in shaped.items():
            try:
                fits = np.broadcast_shapes(shape, target) == target
            except ValueError:
                fits = False
            if not fits:
                raise ValueError(
                    f"{transform}: `{name}` has shape {shape}, which does not broadcast to the "
                    f"update at {jax.tree_util.keystr(path)} of shape {target}; hyperparameters "
                    "must be scalars or arrays that broadcast to every parameter's shape."
                )


def _decayed(updates: Any, decays: Any) -> Any:
    """The leaves of ``updates`` that the decay mask ``decays`` selects (others ``None``)."""
    return jax.tree.map(lambda u, m: u if m else None, updates, decays)


def _cautious(direction: jax.Array, param: jax.Array) -> jax.Array:
    r"""Chen et al.'s cautious selection :math:`\mathbb{1}[u \odot \theta \ge 0]`: the
    coordinates where the optimizer's direction :math:`u` (the step is :math:`-\eta u`) and
    the parameter have the same sign, or either is zero (the real part of
    :math:`u\bar\theta` for complex ones)."""
    return (jnp.real(direction * jnp.conj(param)) >= 0).astype(jnp.result_type(param))


def _require_params(params: Any, name: str) -> None:
    if params is None:
        raise ValueError(
            f"{name} needs the current parameters: call update(updates, state, params)."
        )


# ---------------------------------------------------------------------------------------------
# Coupled L2
# ---------------------------------------------------------------------------------------------


def add_l2_gradient(
    weight_decay: optax.ScalarOrSchedule,
    mask: masks_lib.MaskArg = "auto",
) -> optax.GradientTransformation:
    r"""Coupled L2 regularisation: adds :math:`\lambda_t\theta` to the gradient.

    .. math::

        g_t \leftarrow g_t + \lambda_t \, \theta_{t}

    This is the gradient of :math:`\tfrac{\lambda}{2}\lVert\theta\rVert^2`. Placed *before* an
    adaptive scaling such as :func:`scale_by_adam` it is the **coupled** weight decay of
    ``torch.optim.Adam(weight_decay=λ)``: the penalty is divided by
    :math:`\sqrt{\hat\nu}+\epsilon` like the rest of the gradient, so parameters with large
    gradient variance are barely regularised (Loshchilov & Hutter, "Decoupled Weight Decay
    Regularization", ICLR 2019, Sec. 2). With plain SGD it equals decoupled decay with
    :math:`\lambda' = \lambda`.

    Placed *after* the adaptive scaling and before the learning rate, the same sum is the
    decoupled decay of the ``"lr"`` convention, :math:`-\eta_t(u_t + \lambda\theta_t)`: that is
    how :func:`~optax_decoupled.adamw` and ``optax.adamw`` chain it.

    With ``mask=None`` this is ``optax.add_decayed_weights(λ)``: the same sum and the same
    state (``optax.EmptyState()``, or Optax's step count for a schedule); the default mask
    is ``"auto"``, and the arguments are checked.

    Args:
      weight_decay: :math:`\lambda \ge 0`, a float, an array or a schedule of the step count
        (whose values are checked in an eager ``update``, not under ``jit``).
      mask: which leaves are regularised; see :func:`~optax_decoupled.resolve_mask`.

    Returns:
      An :class:`optax.GradientTransformation` whose ``update`` needs ``params`` (unless
      ``weight_decay`` is a concrete zero).

    Examples:
      >>> import optax
      >>> import jax.numpy as jnp
      >>> import optax_decoupled as od
      >>> params = {"w": jnp.ones((2, 2))}
      >>> tx = od.add_l2_gradient(0.1, mask=None)
      >>> grads, _ = tx.update({"w": jnp.zeros((2, 2))}, tx.init(params), params)
      >>> print(grads["w"][0])
      [0.1 0.1]
      >>> adam_l2 = optax.chain(tx, od.scale_by_adam(), optax.scale_by_learning_rate(1e-3))

    References:
      Loshchilov & Hutter, `Decoupled Weight Decay Regularization
      <https://arxiv.org/abs/1711.05101>`_, ICLR 2019.
    """
    return _add_decayed_weights(weight_decay, mask, "add_l2_gradient")


def _is_zero(value: Any) -> bool:
    """A concrete Python or NumPy zero (not an array, a schedule or a traced value)."""
    return isinstance(value, int | float | np.number) and not isinstance(value, bool) and value == 0


def _add_decayed_weights(
    weight_decay: optax.ScalarOrSchedule,
    mask: masks_lib.MaskArg,
    who: str,
    *,
    cautious: bool = False,
) -> optax.GradientTransformation:
    r""":math:`g + \lambda_t\theta` on the leaves ``mask`` selects, with the state of
    ``optax.add_decayed_weights(weight_decay)`` (``optax.EmptyState()``, or Optax's step count
    for a schedule), so that a chain holding it has Optax's state structure. A concrete zero
    ``weight_decay`` leaves the updates as they are and does not need ``params``. With
    ``cautious``, :math:`g + \lambda_t \mathbb{1}[g \odot \theta \ge 0]\,\theta`, ``g`` being
    the optimizer's direction (this transform sits before the learning rate)."""
    _check_hyperparam("weight_decay", weight_decay)
    masks_lib.check_mask_arg(mask)
    _check_bool("cautious", cautious)
    optax_state = optax.add_decayed_weights(weight_decay).init
    scheduled = callable(weight_decay)

    def init_fn(params):
        V.check_param_dtypes(params, who)
        if not masks_lib.is_params_placeholder(params):  # the state does not depend on it
            decays = masks_lib.resolve_mask(mask, params)
            masks_lib.warn_if_auto_decays_nothing(mask, decays, weight_decay, who)
        return optax_state(params)

    def update_fn(updates, state, params=None):
        V.check_update_dtypes(updates, who)
        new_state = state._replace(count=optax.safe_increment(state.count)) if scheduled else state
        if _is_zero(weight_decay):
            return updates, new_state
        _require_params(params, who)
        _check_shapes(updates, params, who, "parameter")
        wd = _at("weight_decay", weight_decay, state.count) if scheduled else weight_decay
        decays = masks_lib.resolve_mask(mask, params)
        check_hyperparameter_shapes(who, {"weight_decay": wd}, _decayed(updates, decays))
        if cautious:
            add = lambda g, p: g + wd * (_cautious(g, p) * p)  # noqa: E731
        else:
            add = lambda g, p: g + wd * p  # noqa: E731
        updates = jax.tree.map(
            lambda g, p, m: add(g, p).astype(jnp.result_type(g)) if m else g,
            updates,
            params,
            decays,
        )
        return updates, new_state

    return optax.GradientTransformation(init_fn, update_fn)


# ---------------------------------------------------------------------------------------------
# Decoupled weight decay
# ---------------------------------------------------------------------------------------------


class DecoupledWeightDecayState(NamedTuple):
    """State of :func:`decoupled_weight_decay`: the step count the schedules are read at."""

    count: chex.Array


def decay_rate(
    weight_decay: Any,
    convention: str,
    learning_rate: Any,
    peak_learning_rate: Any,
) -> Any:
    r"""The per-step shrink factor :math:`s_t` of a convention, from values at step ``t``.

    ``"lr"``: :math:`\lambda\eta_t`; ``"schedule"``: :math:`\lambda\eta_t/\eta_{peak}`;
    ``"constant"``: :math:`\lambda`; ``"corrected"``: :math:`\lambda\eta_t^2/\eta_{peak}`.
    ``peak_learning_rate=None`` means a constant learning rate, its own peak
    (:math:`\eta_t/\eta_{peak} = 1` exactly, also for :math:`\eta = 0`).

    Args:
      weight_decay: :math:`\lambda \ge 0` at step ``t`` (a number or an array, not a
        schedule: call it with the step count first).
      convention: ``"lr"``, ``"schedule"``, ``"constant"`` or ``"corrected"``.
      learning_rate: :math:`\eta_t \ge 0`; may be ``None`` for ``"constant"`` only.
      peak_learning_rate: :math:`\eta_{peak} > 0`, or ``None``; checked even where the
        convention ignores it, as by :func:`decoupled_weight_decay`.

    Raises:
      ValueError: for an unknown ``convention``, a schedule, a negative or non-finite
        ``weight_decay`` or ``learning_rate``, a missing ``learning_rate``, or a
        ``peak_learning_rate`` that is not a finite number > 0 (concrete values only: traced
        ones are used as given).

    Examples:
      >>> import optax_decoupled as od
      >>> # Halfway down a schedule that peaked at 1e-3, λ = 0.1:
      >>> print(f"{od.decay_rate(0.1, 'lr', 5e-4, None):.2e}")
      5.00e-05
      >>> print(f"{od.decay_rate(0.1, 'schedule', 5e-4, 1e-3):.2e}")
      5.00e-02
      >>> print(f"{od.decay_rate(0.1, 'corrected', 5e-4, 1e-3):.2e}")
      2.50e-05

    References:
      Loshchilov & Hutter, `Decoupled Weight Decay Regularization
      <https://arxiv.org/abs/1711.05101>`_, ICLR 2019.
    """
    V.check_choice("convention", convention, DECAY_CONVENTIONS)
    values = (
        ("weight_decay", weight_decay),
        ("learning_rate", learning_rate),
        ("peak_learning_rate", peak_learning_rate),
    )
    for name, value in values:
        if callable(value):
            raise ValueError(
                f"`{name}` must be its value at step t (a number or an array), not a schedule: "
                "call the schedule with the step count."
            )
    V.check_non_negative("weight_decay", weight_decay)
    if learning_rate is not None:
        V.check_non_negative("learning_rate", learning_rate)
    elif convention != "constant":
        raise ValueError(
            f"convention={convention!r} needs `learning_rate` (η_t); only 'constant' ignores it."
        )
    if peak_learning_rate is not None:
        V.check_positive("peak_learning_rate", peak_learning_rate)
    return _decay_rate(weight_decay, convention, learning_rate, peak_learning_rate)


def _decay_rate(weight_decay: Any, convention: str, learning_rate: Any, peak: Any) -> Any:
    """:func:`decay_rate` without the argument checks (for values already checked)."""
    ratio = 1.0 if peak is None else None
    if convention == "lr":
        return weight_decay * learning_rate
    if convention == "schedule":
        return weight_decay * (ratio if ratio is not None else learning_rate / peak)
    if convention == "constant":
        return weight_decay
    if convention == "corrected":
        if ratio is not None:
            return weight_decay * learning_rate
        return weight_decay * (learning_rate * learning_rate / peak)
    raise ValueError(f"`convention` must be one of {DECAY_CONVENTIONS!r}, got {convention!r}.")


def _resolve_peak(convention: str, learning_rate: Any, peak_learning_rate: Any) -> Any:
    if peak_learning_rate is not None:  # checked even where the convention ignores it
        if callable(peak_learning_rate):
            raise ValueError("`peak_learning_rate` must be a number or an array, not a schedule.")
        V.check_positive("peak_learning_rate", peak_learning_rate)
    if convention not in ("schedule", "corrected") or peak_learning_rate is not None:
        return peak_learning_rate
    constant = V.concrete_number(learning_rate)
    if constant is not None and not isinstance(learning_rate, bool):
        return None  # a constant learning rate is its own peak: decay_rate uses ratio 1
    raise ValueError(
        f"The decay convention {convention!r} divides by the peak learning rate η_peak, which "
        "cannot be read off a schedule or a JAX-array learning rate (injected, traced or "
        "not; a Python or NumPy number is its own peak): pass `peak_learning_rate` "
        "(e.g. the peak_value of your warmup-cosine schedule)."
    )


def decoupled_weight_decay(
    weight_decay: optax.ScalarOrSchedule,
    *,
    convention: str = "lr",
    learning_rate: optax.ScalarOrSchedule | None = None,
    peak_learning_rate: Any = None,
    mask: masks_lib.MaskArg = "auto",
    cautious: bool = False,
) -> optax.GradientTransformation:
    r"""Decoupled weight decay, applied to the final update (after the learning rate).

    .. math::

        u_t \leftarrow u_t - s_t\,\theta_t, \qquad
        s_t = \begin{cases}
          \lambda\,\eta_t & \texttt{"lr"} \text{ (PyTorch AdamW, optax.adamw)} \\
          \lambda\,\eta_t/\eta_{peak} & \texttt{"schedule"}
              \text{ (Loshchilov \& Hutter Alg. 2: } \lambda\,\text{SetScheduleMultiplier}(t)) \\
          \lambda & \texttt{"constant"} \\
          \lambda\,\eta_t^2/\eta_{peak} & \texttt{"corrected"} \text{ (timm's corrected decay)}
        \end{cases}

    so that :math:`\theta_{t+1} = \theta_t + u_t = (1 - s_t)\,\theta_t + (\text{scaled step})`.
    It is **decoupled**: it must come *after* the adaptive scaling and the (negative) learning-rate
    scaling, i.e. last in the chain, where it reproduces ``torch.optim.AdamW``'s
    ``θ ← θ(1 − ηλ)`` exactly (up to float rounding) with ``convention="lr"``.

    In ``"lr"`` the decay strength depends on the learning rate, so retuning η changes the
    effective regularisation; ``"schedule"`` makes λ the decay at the schedule's peak and
    independent of η (Loshchilov & Hutter, "Decoupled Weight Decay Regularization", ICLR 2019,
    Alg. 2; MosaicML Composer's ``DecoupledAdamW``). ``"corrected"`` keeps the equilibrium
    norm of the weights independent of η (timm's ``corrected_weight_decay``).

    Args:
      weight_decay: :math:`\lambda \ge 0`; a float, array or schedule of the step count.
      convention: ``"lr"``, ``"schedule"``, ``"constant"`` or ``"corrected"``.
      learning_rate: :math:`\eta_t`, the same float/schedule the chain's learning-rate scaling
        uses; required by every convention but ``"constant"``.
      peak_learning_rate: :math:`\eta_{peak}` for ``"schedule"``/``"corrected"``; may be omitted
        only when ``learning_rate`` is a constant Python or NumPy number (then it is its own peak).
        ``"lr"`` and ``"constant"`` ignore it, but a given value is still checked (> 0, finite),
        so one set of arguments can be passed to every convention.
      mask: which leaves are decayed; see :func:`~optax_decoupled.resolve_mask`.
      cautious: decay only the coordinates where the step and the parameter point the same
        way, :math:`u_t \leftarrow u_t - s_t\,\mathbb{1}[u_t \odot \theta_t \le 0]\,
        \theta_t` (the step :math:`u_t = -\eta_t d_t` moves against the direction
        :math:`d_t`, so this is :math:`\mathbb{1}[d_t \odot \theta_t \ge 0]`; Chen et al.,
        "Cautious Weight Decay", 2025). Every convention; default ``False``.

    Raises:
      ValueError: for a negative ``weight_decay``, an unknown ``convention``, a missing
        ``learning_rate``, or a missing/non-positive ``peak_learning_rate`` where needed; in
        ``update``, for a schedule whose concrete value at the step is negative or not finite
        (under ``jit`` schedule values are traced and not checked).

    Examples:
      >>> import optax
      >>> import jax.numpy as jnp
      >>> import optax_decoupled as od
      >>> schedule = optax.linear_schedule(1e-3, 0.0, transition_steps=10)
      >>> params = {"w": jnp.ones((2, 2))}
      >>> # Loshchilov & Hutter's Alg. 2: s_t = λ η_t / η_peak, 0.1 at the first step.
      >>> tx = od.decoupled_weight_decay(
      ...     0.1, convention="schedule", learning_rate=schedule, peak_learning_rate=1e-3,
      ...     mask=None)
      >>> updates, _ = tx.update({"w": jnp.zeros((2, 2))}, tx.init(params), params)
      >>> print(updates["w"][0])
      [-0.1 -0.1]

    References:
      Loshchilov & Hutter, `Decoupled Weight Decay Regularization
      <https://arxiv.org/abs/1711.05101>`_, ICLR 2019.
    """
    V.check_choice("convention", convention, DECAY_CONVENTIONS)
    _check_hyperparam("weight_decay", weight_decay)
    masks_lib.check_mask_arg(mask)
    _check_bool("cautious", cautious)
    if convention != "constant":
        if learning_rate is None:
            raise ValueError(
                f"convention={convention!r} needs `learning_rate` (the chain's η_t); "
                "use convention='constant' for a decay that ignores it."
            )
        _check_hyperparam("learning_rate", learning_rate)
    peak = _resolve_peak(convention, learning_rate, peak_learning_rate)

    def init_fn(params):
        V.check_param_dtypes(params, "decoupled_weight_decay")
        if not masks_lib.is_params_placeholder(params):  # the state does not depend on it
            decays = masks_lib.resolve_mask(mask, params)
            masks_lib.warn_if_auto_decays_nothing(
                mask, decays, weight_decay, "decoupled_weight_decay"
            )
        return DecoupledWeightDecayState(count=jnp.zeros([], jnp.int32))

    def update_fn(updates, state, params=None):
        V.check_update_dtypes(updates, "decoupled_weight_decay")
        _require_params(params, "decoupled_weight_decay")
        _check_shapes(updates, params, "decoupled_weight_decay", "parameter")
        lr_t = (
            None if convention == "constant" else _at("learning_rate", learning_rate, state.count)
        )
        wd_t = _at("weight_decay", weight_decay, state.count)
        decays = masks_lib.resolve_mask(mask, params)
        check_hyperparameter_shapes(
            "decoupled_weight_decay",
            {"weight_decay": wd_t, "learning_rate": lr_t, "peak_learning_rate": peak},
            _decayed(updates, decays),
        )
        s = _decay_rate(wd_t, convention, lr_t, peak)  # the values are checked: _at, _resolve_peak
        if cautious:  # the step is -η d: same sign as the direction d where u·θ <= 0
            shrink = lambda u, p: u - s * (_cautious(-u, p) * p)  # noqa: E731
        else:
            shrink = lambda u, p: u - s * p  # noqa: E731
        updates = jax.tree.map(
            lambda u, p, m: shrink(u, p).astype(jnp.result_type(u)) if m else u,
            updates,
            params,
            decays,
        )
        return updates, DecoupledWeightDecayState(count=optax.safe_increment(state.count))

    return optax.GradientTransformation(init_fn, update_fn)


# ---------------------------------------------------------------------------------------------
# Adam / AMSGrad
# ---------------------------------------------------------------------------------------------


#: State of :func:`scale_by_adam` (Optax's own class): ``count``, ``mu``, ``nu``.
ScaleByAdamState = optax.ScaleByAdamState
#: State of :func:`scale_by_adam` with an AMSGrad convention (Optax's own class): ``count``,
#: ``mu``, ``nu`` and the running maximum ``nu_max``.
ScaleByAmsgradState = optax.ScaleByAmsgradState
#: State of :func:`scale_by_lion` (Optax's own class): ``count`` and the momentum ``mu``.
ScaleByLionState = optax.ScaleByLionState


def _moment_storages(state_dtype: Any, mu_dtype: Any, moments: tuple[str, ...]) -> dict:
    return storage_lib.resolve_moment_storages(state_dtype, moments, mu_dtype=mu_dtype)


def _init_moments(stores: dict, params: Any, signed: dict[str, bool], who: str) -> dict:
    V.check_param_dtypes(params, who)
    for store in stores.values():
        storage_lib.check_complex_support(store, params, "state_dtype")
    return {
        name: jax.tree.map(lambda p, st=store, sg=signed[name]: st.init(p, signed=sg), params)
        for name, store in stores.items()
    }


def _read(store: Any, stored: Any, updates: Any) -> Any:
    """The moment tree ``stored`` as values, in ``promote_types(storage, gradient)``: moments
    in the parameter dtype (``state_dtype=None``) are cast up too, so that bfloat16 parameters
    under float32 gradients average in float32 (a no-op where the dtypes match, as in Optax);
    Optax's ``mu_dtype`` is read as Optax reads it."""

    def read(g, st):
        value = store.read(st, jnp.asarray(g))
        if isinstance(store, storage_lib.ParamDtypeStorage) and store.dtype is None:
            value = value.astype(jnp.promote_types(value.dtype, jnp.result_type(g)))
        return value

    return jax.tree.map(read, updates, stored)


def _promoted(updates: Any, moments: Any) -> Any:
    """The gradients in each moment's compute dtype (a no-op where they already are), so
    that e.g. a bfloat16 gradient is squared in float32 for float32 moments."""
    return jax.tree.map(
        lambda g, m: jnp.asarray(g).astype(jnp.promote_types(m.dtype, jnp.result_type(g))),
        updates,
        moments,
    )


def _store(
    stores: dict, fns: dict, stored: dict, new: dict, updates: Any, signed: dict, count: Any
) -> dict:
    """The stored form of every new moment, one :func:`~optax_decoupled._src.storage.
    store_moments` per run of moments that share a storage (``fns`` maps each run to its
    element-wise update)."""
    names, out = list(stored), {}
    while names:
        run = tuple(n for n in names if stores[n] is stores[names[0]])
        names = [n for n in names if n not in run]

        def leaf(g, *leaves, run=run):
            k = len(run)
            return storage_lib.store_moments(
                stores[run[0]],
                fns[run],
                tuple(leaves[:k]),
                tuple(leaves[k:]),
                jnp.asarray(g),
                signed=tuple(signed[n] for n in run),
                step=count,
            )

        trees = _map_unzip(
            leaf, len(run), updates, *(stored[n] for n in run), *(new[n] for n in run)
        )
        out.update(zip(run, trees, strict=True))
    return out


def scale_by_adam(
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    eps_root: float = 0.0,
    mu_dtype: Any = None,
    *,
    nesterov: bool = False,
    amsgrad: str | None = None,
    state_dtype: storage_lib.StateDtype = None,
) -> optax.GradientTransformation:
    r"""Adam's adaptive scaling (Kingma & Ba, ICLR 2015), optionally AMSGrad.

    With :math:`t` counted from 1 and :math:`g_t` the incoming update (the gradient, plus the
    coupled L2 term if :func:`add_l2_gradient` comes first):

    .. math::

        \mu_t = \beta_1 \mu_{t-1} + (1-\beta_1) g_t, \qquad
        \nu_t = \beta_2 \nu_{t-1} + (1-\beta_2) g_t^2, \qquad
        \hat\mu_t = \frac{\mu_t}{1-\beta_1^t}, \quad \hat\nu_t = \frac{\nu_t}{1-\beta_2^t}

    and the output for each ``amsgrad`` convention:

    ==============  =====================================================================
    ``None``        :math:`\hat\mu_t / (\sqrt{\hat\nu_t + \epsilon_{root}} + \epsilon)`
                    (Adam; ``optax.scale_by_adam``)
    ``"pytorch"``   :math:`\nu^{max}_t = \max(\nu^{max}_{t-1}, \nu_t)`, output
                    :math:`\hat\mu_t / (\sqrt{\nu^{max}_t/(1-\beta_2^t) + \epsilon_{root}}
                    + \epsilon)` (max of the raw ν, then bias correction:
                    ``torch.optim.Adam(amsgrad=True)``)
    ``"optax"``     :math:`\nu^{max}_t = \max(\nu^{max}_{t-1}, \hat\nu_t)`, output
                    :math:`\hat\mu_t / (\sqrt{\nu^{max}_t + \epsilon_{root}} + \epsilon)`
                    (max of the bias-corrected ν: ``optax.scale_by_amsgrad``)
    ``"paper"``     :math:`\nu^{max}_t = \max(\nu^{max}_{t-1}, \nu_t)`, output
                    :math:`\mu_t / (\sqrt{\nu^{max}_t + \epsilon_{root}} + \epsilon)`
                    (Reddi, Kale & Kumar, ICLR 2018, Alg. 2: no bias correction; set
                    ``eps=0`` for the exact published update)
    ==============  =====================================================================

    ``"optax"`` starts from a much larger denominator (early :math:`\hat\nu_t` are not shrunk
    by :math:`1-\beta_2^t`, and the max keeps them), so it takes smaller steps than
    ``"pytorch"`` for a long time; the conventions differ measurably (see the Reddi experiment).

    With ``amsgrad=None`` this is ``optax.scale_by_adam`` and with ``"optax"``
    ``optax.scale_by_amsgrad``: the same operations in the same order (bit for bit in
    float32) and Optax's own state classes, :class:`~optax_decoupled.ScaleByAdamState` and
    :class:`~optax_decoupled.ScaleByAmsgradState`. Complex parameters are supported as in Optax
    (:math:`g_t^2` is :math:`|g_t|^2`) with moments in the parameter dtype. Moments are
    computed in ``promote_types(state dtype, gradient dtype)``, at least float32 for a
    bfloat16, float16 or 8-bit ``state_dtype``, and stored as ``state_dtype`` says
    (:func:`~optax_decoupled.resolve_storage`); the output has the gradient's dtype.

    Args:
      b1: :math:`\beta_1 \in [0, 1)`.
      b2: :math:`\beta_2 \in [0, 1)`.
      eps: :math:`\epsilon \ge 0`, added outside the square root.
      eps_root: :math:`\epsilon_{root} \ge 0`, added inside the square root.
      mu_dtype: the first moment's dtype, as Optax's ``mu_dtype`` (created and kept in it;
        computed in the promoted dtype). ``None``: as ``state_dtype`` says.
      nesterov: Nesterov momentum in the numerator (Dozat 2016), as
        ``optax.scale_by_adam(nesterov=True)``; Adam only.
      amsgrad: ``None``, ``"pytorch"``, ``"optax"`` or ``"paper"``.
      state_dtype: how the moments are stored (``None``: the parameter dtype), one
        specification for both or ``{"mu": ..., "nu": ...}`` for each (AMSGrad's
        :math:`\nu^{max}` is kept like :math:`\nu`); see :func:`~optax_decoupled.resolve_storage`.

    Examples:
      >>> import jax.numpy as jnp
      >>> import optax_decoupled as od
      >>> tx = od.scale_by_adam(amsgrad="optax")  # optax.scale_by_amsgrad
      >>> state = tx.init({"w": jnp.zeros(2)})
      >>> updates, state = tx.update({"w": jnp.array([0.5, -2.0])}, state)
      >>> print(f"{float(updates['w'][0]):.4f} {float(updates['w'][1]):.4f}")
      1.0000 -1.0000

    References:
      Kingma & Ba, `Adam: A Method for Stochastic Optimization
      <https://arxiv.org/abs/1412.6980>`_, ICLR 2015.

      Reddi, Kale & Kumar, `On the Convergence of Adam and Beyond
      <https://openreview.net/forum?id=ryQu7f-RZ>`_, ICLR 2018.
    """
    V.check_beta("b1", b1)
    V.check_beta("b2", b2)
    for name, value in (("eps", eps), ("eps_root", eps_root)):
        V.check_not_schedule(name, value)
        V.check_non_negative(name, value)
    V.check_choice("amsgrad", amsgrad, AMSGRAD_VARIANTS)
    if not isinstance(nesterov, bool):
        raise ValueError(f"`nesterov` must be a bool, got {nesterov!r}.")
    if nesterov and amsgrad is not None:
        raise ValueError("`nesterov` is defined for Adam only (amsgrad=None).")
    names = ("mu", "nu") if amsgrad is None else ("mu", "nu", "nu_max")
    stores = _moment_storages(state_dtype, mu_dtype, ("mu", "nu"))
    stores["nu_max"] = stores["nu"]
    stores = {n: stores[n] for n in names}
    signed = {"mu": True, "nu": False, "nu_max": False}

    def init_fn(params):
        moments = _init_moments(stores, params, signed, "scale_by_adam")
        count = jnp.zeros([], jnp.int32)
        if amsgrad is None:
            return ScaleByAdamState(count=count, **moments)
        return ScaleByAmsgradState(count=count, **moments)

    def update_fn(updates, state, params=None):
        V.check_update_dtypes(updates, "scale_by_adam")
        state = _restore_quantized_moments(state, unsigned=("nu", "nu_max"))
        count = optax.safe_increment(state.count)

        _check_shapes(updates, state.mu, "scale_by_adam", "first moment")
        if params is not None:
            _check_shapes(updates, params, "scale_by_adam", "parameter")
        check_hyperparameter_shapes(
            "scale_by_adam", {"b1": b1, "b2": b2, "eps": eps, "eps_root": eps_root}, updates
        )

        # Optax's arithmetic on whole trees (optax.scale_by_adam / scale_by_amsgrad), on the
        # moments read from storage.
        stored = {n: getattr(state, n) for n in names}
        old = {n: _read(stores[n], stored[n], updates) for n in names}
        new = {
            "mu": optax.tree.update_moment(_promoted(updates, old["mu"]), old["mu"], b1, 1),
            "nu": optax.tree.update_moment_per_elem_norm(
                _promoted(updates, old["nu"]), old["nu"], b2, 2
            ),
        }
        if amsgrad is not None:
            seen = (
                optax.tree.bias_correction(new["nu"], b2, count)
                if amsgrad == "optax"
                else new["nu"]
            )
            new["nu_max"] = jax.tree.map(jnp.maximum, old["nu_max"], seen)
        u = _adam_direction(new, updates, count)

        # The same updates element-wise, for storages that update in a pass of their own.
        correction = (b2, count) if amsgrad == "optax" else None
        running_max = amsgrad is not None
        fns = {
            ("mu",): EmaMoments((b1,), (1,)),
            ("nu",): EmaMoments((b2,), (2,)),
            ("nu", "nu_max"): EmaMoments((b2,), (2,), running_max, correction),
            ("mu", "nu"): EmaMoments((b1, b2), (1, 2)),
            ("mu", "nu", "nu_max"): EmaMoments((b1, b2), (1, 2), running_max, correction),
        }
        moments = _store(stores, fns, stored, new, updates, signed, count)
        if amsgrad is None:
            return u, ScaleByAdamState(count=count, **moments)
        return u, ScaleByAmsgradState(count=count, **moments)

    def _adam_direction(new, updates, count):
        """The output for each ``amsgrad`` convention (the table above), as Optax orders it."""
        bias_correction = optax.tree.bias_correction
        if amsgrad == "paper":
            numer = new["mu"]
        elif nesterov:
            numer = jax.tree.map(
                lambda m, g: b1 * m + (1 - b1) * g,
                bias_correction(new["mu"], b1, optax.safe_increment(count)),
                bias_correction(updates, b1, count),
            )
        else:
            numer = bias_correction(new["mu"], b1, count)
        if amsgrad is None:
            den = bias_correction(new["nu"], b2, count)
        elif amsgrad == "pytorch":
            den = bias_correction(new["nu_max"], b2, count)
        else:
            den = new["nu_max"]
        return jax.tree.map(
            lambda m, v, g: (m / (jnp.sqrt(v + eps_root) + eps)).astype(jnp.result_type(g)),
            numer,
            den,
            updates,
        )

    return optax.GradientTransformation(init_fn, update_fn)


# ---------------------------------------------------------------------------------------------
# Lion
# ---------------------------------------------------------------------------------------------


def scale_by_lion(
    b1: float = 0.9,
    b2: float = 0.99,
    mu_dtype: Any = None,
    *,
    mode: str = "hard",
    smooth_beta: float = 1.0,
    state_dtype: storage_lib.StateDtype = None,
) -> optax.GradientTransformation:
    r"""Lion's sign update (Chen et al., "Symbolic Discovery of Optimization Algorithms",
    NeurIPS 2023, Alg. 2).

    .. math::

        u_t = \operatorname{sign}\!\big(\beta_1 \mu_{t-1} + (1-\beta_1) g_t\big), \qquad
        \mu_t = \beta_2 \mu_{t-1} + (1-\beta_2) g_t

    The momentum is updated *after* the sign is taken, with the other rate; ``sign(0) = 0``.
    Every output element has magnitude 1 (or 0), so Lion's learning rate is typically 3-10x
    smaller than AdamW's and its decoupled weight decay 3-10x larger (the paper, Sec. 5).
    This is ``optax.scale_by_lion``: the same operations (bit for bit in float32) and its
    state class, :class:`~optax_decoupled.ScaleByLionState`.

    Args:
      b1: :math:`\beta_1 \in [0, 1)`, the interpolation rate of the update.
      b2: :math:`\beta_2 \in [0, 1)`, the momentum's decay rate.
      mu_dtype: the momentum's dtype, as Optax's ``mu_dtype``.
      mode: ``"hard"`` (the sign, default), ``"smooth"`` (:math:`\tanh(\beta_s x)`) or
        ``"refined"`` (:math:`x` where :math:`|x| < 1`, else its sign), with
        :math:`x = \beta_1 \mu_{t-1} + (1-\beta_1) g_t`: ``optax.scale_by_lion``'s modes.
      smooth_beta: :math:`\beta_s > 0` of ``"smooth"``.
      state_dtype: how :math:`\mu` is stored (``None``: the parameter dtype).

    Examples:
      >>> import jax.numpy as jnp
      >>> import optax_decoupled as od
      >>> tx = od.scale_by_lion()
      >>> updates, _ = tx.update({"w": jnp.array([0.5, -2.0, 0.0])}, tx.init({"w": jnp.zeros(3)}))
      >>> print(updates["w"])
      [ 1. -1.  0.]

    References:
      Chen et al., `Symbolic Discovery of Optimization Algorithms
      <https://arxiv.org/abs/2302.06675>`_, NeurIPS 2023.
    """
    V.check_beta("b1", b1)
    V.check_beta("b2", b2)
    V.check_choice("mode", mode, LION_MODES)
    V.check_not_schedule("smooth_beta", smooth_beta)
    V.check_positive("smooth_beta", smooth_beta)
    stores = _moment_storages(state_dtype, mu_dtype, ("mu",))
    signed = {"mu": True}

    def init_fn(params):
        moments = _init_moments(stores, params, signed, "scale_by_lion")
        return ScaleByLionState(count=jnp.zeros([], jnp.int32), **moments)

    def update_fn(updates, state, params=None):
        V.check_update_dtypes(updates, "scale_by_lion")
        state = _restore_quantized_moments(state, unsigned=())
        _check_shapes(updates, state.mu, "scale_by_lion", "momentum")
        if params is not None:
            _check_shapes(updates, params, "scale_by_lion", "parameter")
        check_hyperparameter_shapes("scale_by_lion", {"b1": b1, "b2": b2}, updates)
        count = optax.safe_increment(state.count)
        # Optax's arithmetic (optax.scale_by_lion): the output from the old momentum.
        old = _read(stores["mu"], state.mu, updates)
        u = jax.tree.map(lambda g, m: lion_direction(g, m, b1, mode, smooth_beta), updates, old)
        new = {"mu": optax.tree.update_moment(_promoted(updates, old), old, b2, 1)}
        fns = {("mu",): EmaMoments((b2,), (1,))}
        moments = _store(stores, fns, {"mu": state.mu}, new, updates, signed, count)
        return u, ScaleByLionState(count=count, **moments)

    return optax.GradientTransformation(init_fn, update_fn)
