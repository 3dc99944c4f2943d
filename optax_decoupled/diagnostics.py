"""What a running optimizer does: the effective decay in force, weight norms, update ratios.

Functions of the optimizer state and parameters, for logging inside or outside ``jit``.
"""

from optax_decoupled._src.diagnostics import (
    decay_in_force,
    effective_decay,
    find_adam_state,
    group_norms,
    group_of,
    update_ratios,
)

__all__ = (
    "decay_in_force",
    "effective_decay",
    "find_adam_state",
    "group_norms",
    "group_of",
    "update_ratios",
)
