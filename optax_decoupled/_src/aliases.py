"""The optimizers people use, as short chains of the public transforms.

``adam_l2`` = ``add_l2_gradient`` → ``scale_by_adam`` → learning rate (coupled);
``adamw`` = ``scale_by_adam`` → learning rate → ``decoupled_weight_decay``;
``amsgrad`` = either with an AMSGrad convention; ``lion`` = ``scale_by_lion`` → learning
rate → ``decoupled_weight_decay``.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import optax

from optax_decoupled._src import masks as masks_lib
from optax_decoupled._src import storage as storage_lib
from optax_decoupled._src import transforms
from optax_decoupled._src import validation as V


def _check_lr(learning_rate: Any) -> None:
    if not callable(learning_rate):
        V.check_non_negative("learning_rate", learning_rate)


def _scale_by_learning_rate(learning_rate: optax.ScalarOrSchedule) -> optax.GradientTransformation:
    """``optax.scale_by_learning_rate`` (same state), with a ``ValueError`` where the learning
    rate's shape would change an update's by broadcasting: checked up front for an array
    (:func:`~optax_decoupled._src.transforms.check_hyperparameter_shapes`), on the scaled updates
    for a schedule (not called twice, nor traced where the update runs eagerly). A schedule's
    value is checked (>= 0, finite) where it is concrete, i.e. in an eager update."""
    if callable(learning_rate):  # the schedule's value checked at each step, as the decay's
        inner = optax.scale_by_learning_rate(
            functools.partial(transforms._at, "learning_rate", learning_rate)
        )
    else:
        inner = optax.scale_by_learning_rate(learning_rate)

    def update_fn(updates, state, params=None):
        if not callable(learning_rate):
            transforms.check_hyperparameter_shapes(
                "scale_by_learning_rate", {"learning_rate": learning_rate}, updates
            )
        scaled, state = inner.update(updates, state, params)
        leaves = jax.tree_util.tree_flatten_with_path(updates)[0]
        for (path, u), v in zip(leaves, jax.tree.leaves(scaled), strict=True):
            if jnp.shape(v) != jnp.shape(u):
                raise ValueError(
                    f"scale_by_learning_rate: `learning_rate` (a schedule) changed the shape "
                    f"of the update at {jax.tree_util.keystr(path)} from {jnp.shape(u)} to "
                    f"{jnp.shape(v)}; hyperparameters must be scalars or arrays that "
                    "broadcast to every parameter's shape."
                )
        return scaled, state

    return optax.GradientTransformation(inner.init, update_fn)


def adam(
    learning_rate: optax.ScalarOrSchedule,
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
    r"""Adam without weight decay (Kingma & Ba, ICLR 2015).

    .. math::

        \theta_{t+1} = \theta_t - \eta_t\,\frac{\hat\mu_t}{\sqrt{\hat\nu_t}+\epsilon}

    ``optax.adam``, bit for bit, with the same chain and state (``scale_by_adam`` → learning
    rate); adds AMSGrad's conventions and ``state_dtype``. For decay use :func:`adamw`
    (decoupled) or :func:`adam_l2` (coupled).

    Args:
      learning_rate: :math:`\eta_t \ge 0`, float, array or schedule.
      b1, b2, eps, eps_root, mu_dtype, nesterov, amsgrad, state_dtype: see
        :func:`~optax_decoupled.scale_by_adam`.

    Examples:
      >>> import jax.numpy as jnp
      >>> import optax
      >>> import optax_decoupled as od
      >>> params = {"w": jnp.ones(3)}
      >>> tx, ref = od.adam(1e-2), optax.adam(1e-2)
      >>> grads = {"w": jnp.array([0.1, -0.2, 0.3])}
      >>> (u, _), (r, _) = tx.update(grads, tx.init(params)), ref.update(grads, ref.init(params))
      >>> bool(jnp.all(u["w"] == r["w"]))
      True

    References:
      Kingma & Ba, `Adam: A Method for Stochastic Optimization
      <https://arxiv.org/abs/1412.6980>`_, ICLR 2015.
    """
    _check_lr(learning_rate)
    scaling = transforms.scale_by_adam(
        b1, b2, eps, eps_root, mu_dtype, nesterov=nesterov, amsgrad=amsgrad, state_dtype=state_dtype
    )
    return optax.chain(scaling, _scale_by_learning_rate(learning_rate))


def adam_l2(
    learning_rate: optax.ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    eps_root: float = 0.0,
    mu_dtype: Any = None,
    *,
    weight_decay: optax.ScalarOrSchedule,
    nesterov: bool = False,
    amsgrad: str | None = None,
    mask: masks_lib.MaskArg = "auto",
    state_dtype: storage_lib.StateDtype = None,
) -> optax.GradientTransformation:
    r"""Adam with **coupled** L2 regularisation (the gradient gets :math:`+\lambda\theta`).

    .. math::

        g_t' = g_t + \lambda\theta_t, \qquad
        \theta_{t+1} = \theta_t - \eta_t\,\frac{\hat\mu_t}{\sqrt{\hat\nu_t}+\epsilon}
        \quad\text{(moments of } g'\text{)}

    The penalty passes through the adaptive scaling, so its effective strength per element is
    :math:`\eta_t\lambda/(\sqrt{\hat\nu_t}+\epsilon)`: strong where gradients are small, weak
    where they are large (Loshchilov & Hutter, ICLR 2019).

    With ``mask=None`` this is exactly ``torch.optim.Adam(lr, (b1, b2), eps,
    weight_decay=λ, amsgrad=...)`` (``amsgrad="pytorch"`` for ``amsgrad=True``) and
    ``optax.chain(optax.add_decayed_weights(λ), optax.adam(lr, b1, b2, eps))``.

    Args:
      learning_rate: :math:`\eta_t \ge 0`, float, array or schedule.
      b1, b2, eps, eps_root, mu_dtype, nesterov: see :func:`~optax_decoupled.scale_by_adam`.
      weight_decay: :math:`\lambda \ge 0` (float, array or schedule). Required.
      amsgrad: ``None`` or an AMSGrad convention (``"pytorch"``, ``"optax"``, ``"paper"``).
      mask: which leaves are regularised (default ``"auto"``: weight matrices only).
      state_dtype: storage of the moments (:func:`~optax_decoupled.resolve_storage`).

    Examples:
      >>> import jax.numpy as jnp
      >>> import optax_decoupled as od
      >>> params = {"w": jnp.ones((2, 2)), "b": jnp.ones(2)}
      >>> grads = {"w": jnp.zeros((2, 2)), "b": jnp.zeros(2)}
      >>> tx = od.adam_l2(0.1, weight_decay=0.5)  # mask="auto": "w" regularised, "b" not
      >>> updates, state = tx.update(grads, tx.init(params), params)
      >>> # g' = λθ = 0.5 enters Adam, whose first step is ±η whatever its size:
      >>> print(f"{float(updates['w'][0, 0]):.4f} {float(updates['b'][0]):.4f}")
      -0.1000 -0.0000

    References:
      Kingma & Ba, `Adam: A Method for Stochastic Optimization
      <https://arxiv.org/abs/1412.6980>`_, ICLR 2015.

      References:
        Loshchilov & Hutter, `Decoupled Weight Decay Regularization
        <https://arxiv.org/abs/1711.05101>`_, ICLR 2019.
    """
    _check_lr(learning_rate)
    scaling = transforms.scale_by_adam(
        b1, b2, eps, eps_root, mu_dtype, nesterov=nesterov, amsgrad=amsgrad, state_dtype=state_dtype
    )
    return optax.chain(
        transforms.add_l2_gradient(weight_decay, mask=mask),
        scaling,
        _scale_by_learning_rate(learning_rate),
    )


def adamw(
    learning_rate: optax.ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    eps_root: float = 0.0,
    mu_dtype: Any = None,
    weight_decay: optax.ScalarOrSchedule = 1e-2,
    mask: masks_lib.MaskArg = "auto",
    *,
    nesterov: bool = False,
    amsgrad: str | None = None,
    decay_convention: str = "lr",
    peak_learning_rate: Any = None,
    cautious: bool = False,
    state_dtype: storage_lib.StateDtype = None,
) -> optax.GradientTransformation:
    r"""AdamW: Adam with **decoupled** weight decay (Loshchilov & Hutter, ICLR 2019).

    .. math::

        \theta_{t+1} = \theta_t - \eta_t\,\frac{\hat\mu_t}{\sqrt{\hat\nu_t}+\epsilon}
                       - s_t\,\theta_t

    with :math:`s_t` given by ``decay_convention`` (see
    :func:`~optax_decoupled.decoupled_weight_decay`): ``"lr"`` :math:`\lambda\eta_t` (default;
    PyTorch and Optax), ``"schedule"`` :math:`\lambda\eta_t/\eta_{peak}` (the paper's Alg. 2),
    ``"constant"`` :math:`\lambda`, ``"corrected"`` :math:`\lambda\eta_t^2/\eta_{peak}`.

    With ``mask=None`` and ``decay_convention="lr"`` this is ``optax.adamw`` for the same
    hyperparameters, bit for bit, with the same state: the chain is Optax's,
    ``scale_by_adam`` → ``add_l2_gradient`` (:math:`+\lambda\theta`) → learning rate, so a
    checkpoint of one restores into the other. It is ``torch.optim.AdamW`` (with
    ``amsgrad="pytorch"``: ``AdamW(amsgrad=True)``) to float rounding. The other conventions
    apply :func:`~optax_decoupled.decoupled_weight_decay` after the learning rate. Defaults
    that differ from ``optax.adamw``: ``weight_decay=1e-2`` (PyTorch's) and ``mask="auto"``.

    .. note:: the default ``mask="auto"`` differs from both: it decays weight matrices only.

    Args:
      learning_rate: :math:`\eta_t \ge 0`, float, array or schedule.
      b1, b2, eps, eps_root, mu_dtype, nesterov: see :func:`~optax_decoupled.scale_by_adam`.
      weight_decay: :math:`\lambda \ge 0` (float, array or schedule).
      amsgrad: ``None`` or an AMSGrad convention (``"pytorch"``, ``"optax"``, ``"paper"``).
      decay_convention: ``"lr"``, ``"schedule"``, ``"constant"`` or ``"corrected"``.
      peak_learning_rate: :math:`\eta_{peak}` for ``"schedule"``/``"corrected"`` with a
        scheduled or injected learning rate. ``"lr"`` and ``"constant"`` ignore it; a value
        given there is still checked (> 0, finite) but changes nothing, so one set of
        arguments can be swept over every convention.
      mask: which leaves are decayed (default ``"auto"``).
      state_dtype: storage of the moments (:func:`~optax_decoupled.resolve_storage`).

    Examples:
      >>> import jax.numpy as jnp
      >>> import optax_decoupled as od
      >>> params = {"w": jnp.ones((2, 2)), "b": jnp.ones(2)}
      >>> grads = {"w": jnp.zeros((2, 2)), "b": jnp.zeros(2)}
      >>> tx = od.adamw(0.1, weight_decay=0.5)  # mask="auto": "w" decayed, "b" not
      >>> updates, state = tx.update(grads, tx.init(params), params)
      >>> # a zero gradient leaves only the decay, -ηλθ = -0.05, on the matrix:
      >>> print(f"{float(updates['w'][0, 0]):.4f} {float(updates['b'][0]):.4f}")
      -0.0500 -0.0000

    References:
      Loshchilov & Hutter, `Decoupled Weight Decay Regularization
      <https://arxiv.org/abs/1711.05101>`_, ICLR 2019.
    """
    _check_lr(learning_rate)
    V.check_choice("decay_convention", decay_convention, transforms.DECAY_CONVENTIONS)
    scaling = transforms.scale_by_adam(
        b1, b2, eps, eps_root, mu_dtype, nesterov=nesterov, amsgrad=amsgrad, state_dtype=state_dtype
    )
    return _with_decoupled_decay(
        scaling,
        learning_rate,
        weight_decay,
        decay_convention,
        peak_learning_rate,
        mask,
        cautious=cautious,
    )


def _with_decoupled_decay(
    scaling: optax.GradientTransformation,
    learning_rate: optax.ScalarOrSchedule,
    weight_decay: optax.ScalarOrSchedule,
    convention: str,
    peak_learning_rate: Any,
    mask: masks_lib.MaskArg,
    *,
    cautious: bool = False,
    keep_zero: bool = True,
) -> optax.GradientTransformation:
    """``scaling`` → decay → learning rate for ``"lr"`` (Optax's chain and state), ``scaling``
    → learning rate → :func:`~optax_decoupled.decoupled_weight_decay` for the others. With
    ``keep_zero=False`` a concrete zero decay is left out of the chain (``optax.amsgrad``'s
    chain has none)."""
    if not keep_zero and transforms._is_zero(weight_decay) and peak_learning_rate is None:
        masks_lib.check_mask_arg(mask)
        transforms._check_bool("cautious", cautious)
        return optax.chain(scaling, _scale_by_learning_rate(learning_rate))
    if convention == "lr":
        if peak_learning_rate is not None:  # checked where the convention ignores it
            transforms._resolve_peak(convention, learning_rate, peak_learning_rate)
        decay = transforms._add_decayed_weights(
            weight_decay, mask, "decoupled_weight_decay", cautious=cautious
        )
        return optax.chain(scaling, decay, _scale_by_learning_rate(learning_rate))
    return optax.chain(
        scaling,
        _scale_by_learning_rate(learning_rate),
        transforms.decoupled_weight_decay(
            weight_decay,
            convention=convention,
            learning_rate=learning_rate,
            peak_learning_rate=peak_learning_rate,
            mask=mask,
            cautious=cautious,
        ),
    )


def amsgrad(
    learning_rate: optax.ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    eps_root: float = 0.0,
    mu_dtype: Any = None,
    *,
    variant: str = "pytorch",
    weight_decay: optax.ScalarOrSchedule = 0.0,
    coupled: bool = False,
    decay_convention: str = "lr",
    peak_learning_rate: Any = None,
    mask: masks_lib.MaskArg = "auto",
    cautious: bool = False,
    state_dtype: storage_lib.StateDtype = None,
) -> optax.GradientTransformation:
    r"""AMSGrad (Reddi, Kale & Kumar, "On the Convergence of Adam and Beyond", ICLR 2018).

    Adam whose denominator uses the running maximum of the second moment, so the effective
    per-element step size never grows; this restores the convergence proof that Adam lacks.
    The three published conventions (``variant``) differ in where the max is taken:
    ``"pytorch"`` (max of raw ν, then bias correction: ``torch.optim.AdamW(amsgrad=True)``),
    ``"optax"`` (max of bias-corrected ν: ``optax.amsgrad``), ``"paper"`` (no bias
    correction). See :func:`~optax_decoupled.scale_by_adam` for the formulas.

    ``weight_decay`` is decoupled (:func:`adamw`) unless ``coupled=True`` (:func:`adam_l2`);
    a zero decay (the default) leaves the decay out of the chain. With ``variant="optax"``
    and ``weight_decay=0`` this is ``optax.amsgrad``, bit for bit, with the same state.

    Args:
      learning_rate: :math:`\eta_t \ge 0`, float, array or schedule.
      b1, b2, eps, eps_root, mu_dtype: see :func:`~optax_decoupled.scale_by_adam`.
      variant: where the running maximum of :math:`\nu` is taken: ``"pytorch"`` (default;
        max of the raw :math:`\nu_t`, then bias correction), ``"optax"`` (max of the
        bias-corrected :math:`\hat\nu_t`) or ``"paper"`` (max of the raw :math:`\nu_t`, no
        bias correction of either moment). ``None`` is refused: use :func:`adamw` or
        :func:`adam_l2` for plain Adam.
      weight_decay: :math:`\lambda \ge 0` (float, array or schedule); default 0.
      coupled: a bool. ``False`` (default): decoupled decay after the learning rate, as
        :func:`adamw`; ``True``: coupled L2 added to the gradient before the adaptive scaling,
        as :func:`adam_l2` (``torch.optim.Adam(weight_decay=λ, amsgrad=True)`` with
        ``variant="pytorch"``).
      decay_convention: the decoupled decay's :math:`s_t`: ``"lr"`` (default),
        ``"schedule"``, ``"constant"`` or ``"corrected"`` (see :func:`adamw`). Only
        ``"lr"`` with ``coupled=True``, which has no convention.
      peak_learning_rate: :math:`\eta_{peak}` for ``"schedule"``/``"corrected"`` with a
        scheduled or injected learning rate; ignored (but checked) by ``"lr"`` and
        ``"constant"``; must be ``None`` with ``coupled=True``.
      mask: which leaves are decayed or regularised (default ``"auto"``).
      cautious: cautious decoupled decay (see :func:`adamw`); not with ``coupled=True``.
      state_dtype: storage of the moments (:func:`~optax_decoupled.resolve_storage`).

    Examples:
      >>> import jax
      >>> import jax.numpy as jnp
      >>> import optax_decoupled as od
      >>> import optax
      >>> def loss(x):
      ...     return jnp.sum((x - 3.0) ** 2)
      >>> x = jnp.zeros(3)
      >>> tx = od.amsgrad(0.1, variant="pytorch")
      >>> state = tx.init(x)
      >>> for _ in range(300):
      ...     updates, state = tx.update(jax.grad(loss)(x), state, x)
      ...     x = optax.apply_updates(x, updates)
      >>> print(f"{float(loss(x)):.4f}")
      0.0000

    References:
      Reddi, Kale & Kumar, `On the Convergence of Adam and Beyond
      <https://openreview.net/forum?id=ryQu7f-RZ>`_, ICLR 2018.
    """
    V.check_choice("variant", variant, ("pytorch", "optax", "paper"))
    if not isinstance(coupled, bool):
        raise ValueError(f"`coupled` must be a bool, got {coupled!r}.")
    if coupled:
        if cautious:
            raise ValueError("`cautious` applies to decoupled decay only (coupled=False).")
        if decay_convention != "lr" or peak_learning_rate is not None:
            raise ValueError(
                "`decay_convention`/`peak_learning_rate` apply to decoupled decay only; "
                "coupled L2 (coupled=True) has no convention."
            )
        return adam_l2(
            learning_rate,
            b1,
            b2,
            eps,
            eps_root,
            mu_dtype,
            weight_decay=weight_decay,
            amsgrad=variant,
            mask=mask,
            state_dtype=state_dtype,
        )
    _check_lr(learning_rate)
    V.check_choice("decay_convention", decay_convention, transforms.DECAY_CONVENTIONS)
    scaling = transforms.scale_by_adam(
        b1, b2, eps, eps_root, mu_dtype, amsgrad=variant, state_dtype=state_dtype
    )
    return _with_decoupled_decay(
        scaling,
        learning_rate,
        weight_decay,
        decay_convention,
        peak_learning_rate,
        mask,
        cautious=cautious,
        keep_zero=False,
    )


def lion(
    learning_rate: optax.ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.99,
    mu_dtype: Any = None,
    weight_decay: optax.ScalarOrSchedule = 1e-3,
    mask: masks_lib.MaskArg = "auto",
    *,
    mode: str = "hard",
    smooth_beta: float | None = None,
    decay_convention: str = "lr",
    peak_learning_rate: Any = None,
    cautious: bool = False,
    state_dtype: storage_lib.StateDtype = None,
) -> optax.GradientTransformation:
    r"""Lion with decoupled weight decay (Chen et al., NeurIPS 2023).

    .. math::

        \theta_{t+1} = \theta_t - \eta_t\,\operatorname{sign}\big(\beta_1\mu_{t-1}
                       + (1-\beta_1)g_t\big) - s_t\,\theta_t,
        \qquad \mu_t = \beta_2\mu_{t-1} + (1-\beta_2)g_t

    Rules of thumb from the paper: a learning rate 3-10x smaller than AdamW's and a weight
    decay 3-10x larger, so that :math:`\eta\lambda` stays similar. With ``mask=None`` and
    ``decay_convention="lr"`` this is ``optax.lion``, bit for bit, with the same state.

    Args:
      learning_rate: :math:`\eta_t \ge 0`, float, array or schedule.
      b1: :math:`\beta_1 \in [0, 1)`, the interpolation rate used for the sign update
        (:math:`\operatorname{sign}(\beta_1\mu_{t-1} + (1-\beta_1)g_t)`), as in Chen et al.
        (2023), Alg. 2, and ``optax.lion``.
      b2: :math:`\beta_2 \in [0, 1)`, the decay rate of the momentum
        :math:`\mu_t = \beta_2\mu_{t-1} + (1-\beta_2)g_t`, updated after the sign is taken.
      mu_dtype: the momentum's dtype, as ``optax.lion``'s.
      mu_dtype: the momentum's dtype, as ``optax.lion``'s.
      weight_decay: :math:`\lambda \ge 0` (float, array or schedule), decoupled.
      decay_convention: ``"lr"``, ``"schedule"``, ``"constant"`` or ``"corrected"`` (see
        :func:`adamw`).
      peak_learning_rate: :math:`\eta_{peak}` for ``"schedule"``/``"corrected"`` with a
        scheduled or injected learning rate; ignored (but checked) by ``"lr"`` and
        ``"constant"``.
      mask: which leaves are decayed (default ``"auto"``).
      cautious: cautious weight decay; see :func:`adamw`.
      mode, smooth_beta: the update's form; see :func:`~optax_decoupled.scale_by_lion`
        (``smooth_beta=None`` is 1.0; ``None`` keeps it out of ``optax.inject_hyperparams``'s
        state, which then has ``optax.lion``'s structure).
      state_dtype: storage of the momentum (:func:`~optax_decoupled.resolve_storage`).

    Examples:
      >>> import jax.numpy as jnp
      >>> import optax_decoupled as od
      >>> params = {"w": jnp.ones((2, 2)), "b": jnp.ones(2)}
      >>> grads = {"w": -jnp.ones((2, 2)), "b": jnp.ones(2)}
      >>> tx = od.lion(0.1, weight_decay=0.5)
      >>> updates, state = tx.update(grads, tx.init(params), params)
      >>> # -η·sign(g) - ηλθ on the matrix, -η·sign(g) on the bias:
      >>> print(f"{float(updates['w'][0, 0]):.4f} {float(updates['b'][0]):.4f}")
      0.0500 -0.1000

    References:
      Chen et al., `Symbolic Discovery of Optimization Algorithms
      <https://arxiv.org/abs/2302.06675>`_, NeurIPS 2023.
    """
    _check_lr(learning_rate)
    V.check_choice("decay_convention", decay_convention, transforms.DECAY_CONVENTIONS)
    scaling = transforms.scale_by_lion(
        b1,
        b2,
        mu_dtype,
        mode=mode,
        smooth_beta=1.0 if smooth_beta is None else smooth_beta,
        state_dtype=state_dtype,
    )
    return _with_decoupled_decay(
        scaling,
        learning_rate,
        weight_decay,
        decay_convention,
        peak_learning_rate,
        mask,
        cautious=cautious,
    )
