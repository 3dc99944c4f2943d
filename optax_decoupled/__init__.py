"""optax-decoupled: coupled L2 vs decoupled weight decay, AMSGrad and Lion for Optax.

Every optimizer is an :class:`optax.GradientTransformation` that chains with the rest of
Optax::

    import optax_decoupled as od

    tx = od.adamw(1e-3, weight_decay=0.05)     # decoupled (mask="auto": weight matrices only)
    tx = od.adam_l2(1e-3, weight_decay=1e-4)   # coupled L2
    tx = od.amsgrad(1e-3, variant="pytorch")
    tx = od.lion(3e-4, weight_decay=0.3)

The core needs only jax, optax and chex. :mod:`optax_decoupled.diagnostics` reads what a
running optimizer does; :mod:`optax_decoupled.contrib` holds the second tier (parameter
packing, sharding helpers, the memory audit, the 8-bit codes).
"""

from optax_decoupled import contrib, diagnostics
from optax_decoupled._src.aliases import adam, adam_l2, adamw, amsgrad, lion
from optax_decoupled._src.masks import (
    DecayMask,
    MaskDecision,
    MaskExplanation,
    decay_mask,
    explain_mask,
    resolve_mask,
)
from optax_decoupled._src.storage import (
    BlockwiseInt8Storage,
    FloatStorage,
    MomentStorage,
    resolve_storage,
)
from optax_decoupled._src.timescale import (
    convert_weight_decay,
    timescale_for_weight_decay,
    weight_decay_for_timescale,
)
from optax_decoupled._src.transforms import (
    AMSGRAD_VARIANTS,
    DECAY_CONVENTIONS,
    DecoupledWeightDecayState,
    ScaleByAdamState,
    ScaleByAmsgradState,
    ScaleByLionState,
    add_l2_gradient,
    decay_rate,
    decoupled_weight_decay,
    scale_by_adam,
    scale_by_lion,
)

__version__ = "0.1.0"

__all__ = (
    "AMSGRAD_VARIANTS",
    "DECAY_CONVENTIONS",
    "BlockwiseInt8Storage",
    "DecayMask",
    "DecoupledWeightDecayState",
    "MaskDecision",
    "MaskExplanation",
    "FloatStorage",
    "MomentStorage",
    "ScaleByAdamState",
    "ScaleByAmsgradState",
    "ScaleByLionState",
    "adam",
    "adam_l2",
    "add_l2_gradient",
    "adamw",
    "amsgrad",
    "contrib",
    "convert_weight_decay",
    "decay_mask",
    "decay_rate",
    "decoupled_weight_decay",
    "explain_mask",
    "diagnostics",
    "lion",
    "resolve_mask",
    "resolve_storage",
    "scale_by_adam",
    "scale_by_lion",
    "timescale_for_weight_decay",
    "weight_decay_for_timescale",
)
