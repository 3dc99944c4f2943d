r"""Weight decay as a timescale, and the same decay in each convention.

Decoupled decay multiplies the weights by :math:`1 - s_t` each step, so AdamW's weights are an
exponential moving average of its updates over :math:`\tau = 1/s` steps (Wang & Aitchison,
ICML 2025). These helpers convert between :math:`\lambda` and :math:`\tau` (in steps or in
epochs) and between the four decay conventions, at the learning rate's peak.
"""

from __future__ import annotations

from typing import Any

from optax_decoupled._src import transforms
from optax_decoupled._src import validation as V


def _decay_per_unit_lambda(convention: str, peak_learning_rate: Any) -> Any:
    """:math:`s_{peak}/\\lambda`: the per-step decay at the peak for :math:`\\lambda = 1`."""
    V.check_choice("convention", convention, transforms.DECAY_CONVENTIONS)
    if convention in ("lr", "corrected"):
        if peak_learning_rate is None:
            raise ValueError(
                f"convention={convention!r} scales the decay by the learning rate: pass "
                "`peak_learning_rate` (η_peak > 0)."
            )
        V.check_not_schedule("peak_learning_rate", peak_learning_rate)
        V.check_positive("peak_learning_rate", peak_learning_rate)
        return peak_learning_rate
    return 1.0


def _steps(tau: Any, steps_per_epoch: Any) -> Any:
    if steps_per_epoch is None:
        return tau
    V.check_not_schedule("steps_per_epoch", steps_per_epoch)
    V.check_positive("steps_per_epoch", steps_per_epoch)
    return tau * steps_per_epoch


def weight_decay_for_timescale(
    timescale: Any,
    peak_learning_rate: Any = None,
    *,
    convention: str = "lr",
    steps_per_epoch: Any = None,
) -> Any:
    r"""The :math:`\lambda` whose per-step decay at the learning rate's peak is :math:`1/\tau`.

    .. math::

        \lambda = \frac{1}{\tau\, s_{peak}(\lambda{=}1)}, \qquad
        s_{peak}(\lambda{=}1) = \begin{cases}
          \eta_{peak} & \texttt{"lr"}, \texttt{"corrected"} \\
          1 & \texttt{"schedule"}, \texttt{"constant"}
        \end{cases}

    with :math:`\tau` in steps, or in epochs times ``steps_per_epoch``. For PyTorch's and
    Optax's AdamW (``"lr"``) this is :math:`\lambda = 1/(\eta\tau)`: the EMA timescale
    :math:`\tau_{iter} = 1/(\eta\lambda)` of Wang & Aitchison, whose optimal value in epochs
    they find nearly constant as model and data grow.

    Args:
      timescale: :math:`\tau > 0`, in steps (or epochs with ``steps_per_epoch``).
      peak_learning_rate: :math:`\eta_{peak} > 0`; required by ``"lr"`` and ``"corrected"``,
        ignored by ``"schedule"`` and ``"constant"`` (whose decay at the peak is
        :math:`\lambda`).
      convention: ``"lr"``, ``"schedule"``, ``"constant"`` or ``"corrected"``.
      steps_per_epoch: if given, ``timescale`` is in epochs.

    Returns:
      :math:`\lambda` (a float for float inputs; arrays broadcast).

    Raises:
      ValueError: naming the argument, for a non-positive or non-finite ``timescale``,
        ``peak_learning_rate`` or ``steps_per_epoch``, or an unknown ``convention``.

    Examples:
      >>> import optax_decoupled as od
      >>> # An EMA over 2 epochs of 500 steps at peak learning rate 1e-3:
      >>> lam = od.weight_decay_for_timescale(2, 1e-3, steps_per_epoch=500)
      >>> print(f"{lam:.2f}")
      1.00
      >>> print(f"{od.timescale_for_weight_decay(lam, 1e-3, steps_per_epoch=500):.1f}")
      2.0

    References:
      Wang & Aitchison, `How to set AdamW's weight decay as you scale model and dataset size
      <https://arxiv.org/abs/2405.13698>`_, ICML 2025.
    """
    V.check_not_schedule("timescale", timescale)
    V.check_positive("timescale", timescale)
    per_unit = _decay_per_unit_lambda(convention, peak_learning_rate)
    return 1.0 / (_steps(timescale, steps_per_epoch) * per_unit)


def timescale_for_weight_decay(
    weight_decay: Any,
    peak_learning_rate: Any = None,
    *,
    convention: str = "lr",
    steps_per_epoch: Any = None,
) -> Any:
    r"""The EMA timescale :math:`\tau = 1/s_{peak}` of a weight decay, in steps (or epochs
    with ``steps_per_epoch``): the inverse of :func:`weight_decay_for_timescale`.

    Args:
      weight_decay: :math:`\lambda > 0` (a zero decay has no finite timescale).
      peak_learning_rate: :math:`\eta_{peak} > 0`; required by ``"lr"`` and ``"corrected"``.
      convention: ``"lr"``, ``"schedule"``, ``"constant"`` or ``"corrected"``.
      steps_per_epoch: if given, the result is in epochs.

    Raises:
      ValueError: naming the argument, as :func:`weight_decay_for_timescale`.

    Examples:
      >>> import optax_decoupled as od
      >>> print(od.timescale_for_weight_decay(0.1, 1e-3))  # 1/(ηλ) steps
      10000.0
    """
    V.check_not_schedule("weight_decay", weight_decay)
    V.check_positive("weight_decay", weight_decay)
    per_step = weight_decay * _decay_per_unit_lambda(convention, peak_learning_rate)
    tau = 1.0 / per_step
    if steps_per_epoch is None:
        return tau
    return tau / _steps(1, steps_per_epoch)


def convert_weight_decay(
    weight_decay: Any,
    *,
    from_convention: str,
    to_convention: str,
    peak_learning_rate: Any = None,
) -> Any:
    r"""The :math:`\lambda'` in ``to_convention`` whose per-step decay at the learning rate's
    peak equals that of :math:`\lambda` in ``from_convention``.

    .. math::

        s_{peak} = \lambda\,c_{from} = \lambda'\,c_{to}, \qquad
        c = \eta_{peak} \text{ for } \texttt{"lr"}, \texttt{"corrected"}, \quad
        c = 1 \text{ for } \texttt{"schedule"}, \texttt{"constant"}

    Away from the peak the conventions differ by design: ``"lr"`` and ``"schedule"`` follow
    :math:`\eta_t`, ``"corrected"`` follows :math:`\eta_t^2`, ``"constant"`` does not change.

    Args:
      weight_decay: :math:`\lambda \ge 0` in ``from_convention``.
      from_convention, to_convention: ``"lr"``, ``"schedule"``, ``"constant"`` or
        ``"corrected"``.
      peak_learning_rate: :math:`\eta_{peak} > 0`, required when exactly one side is ``"lr"``
        or ``"corrected"``.

    Raises:
      ValueError: naming the argument, for a negative ``weight_decay``, an unknown convention
        or a missing or non-positive ``peak_learning_rate`` where it is needed.

    Examples:
      >>> import optax_decoupled as od
      >>> # torch.optim.AdamW(lr=1e-3, weight_decay=0.1) decays by 1e-4 per step at its peak;
      >>> # Loshchilov & Hutter's Alg. 2 ("schedule") does the same with λ = 1e-4.
      >>> lam = od.convert_weight_decay(
      ...     0.1, from_convention="lr", to_convention="schedule", peak_learning_rate=1e-3)
      >>> print(f"{lam:.0e}")
      1e-04
    """
    V.check_not_schedule("weight_decay", weight_decay)
    V.check_non_negative("weight_decay", weight_decay)
    V.check_choice("from_convention", from_convention, transforms.DECAY_CONVENTIONS)
    V.check_choice("to_convention", to_convention, transforms.DECAY_CONVENTIONS)
    uses_peak = ("lr", "corrected")
    if (from_convention in uses_peak) == (to_convention in uses_peak):
        return weight_decay  # the same factor on both sides: λ' = λ exactly
    c_from = _decay_per_unit_lambda(from_convention, peak_learning_rate)
    c_to = _decay_per_unit_lambda(to_convention, peak_learning_rate)
    return weight_decay * c_from / c_to
