"""optax-decoupled: coupled L2 vs decoupled weight decay, AMSGrad and Lion for Optax.

Public API::

    import optax_decoupled as od
    tx = od.adamw(1e-3, weight_decay=0.05)            # decoupled (mask="auto": matrices only)
    tx = od.adam_l2(1e-3, weight_decay=1e-4)          # coupled L2
    tx = od.amsgrad(1e-3, variant="pytorch")
    tx = od.lion(3e-4, weight_decay=0.3)

The submodules of the public API are attributes of the package (``od.memory.state_bytes``,
``od.sharding.jit_init``, ``od.diagnostics.effective_decay``, ``od.cpu_kernel.available``,
``od.quantization.quantize``). The core imports only jax, optax and chex.
"""

from optax_decoupled import cpu_kernel, diagnostics, memory, quantization, sharding
from optax_decoupled.aliases import adam_l2, adamw, amsgrad, lion
from optax_decoupled.masks import DecayMask, decay_mask, resolve_mask
from optax_decoupled.packing import (
    PACKED_MASK,
    PackedLayout,
    PackedState,
    packed,
    packed_layout,
    packed_transform,
)
from optax_decoupled.storage import BlockwiseInt8Storage, FloatStorage, resolve_storage
from optax_decoupled.transforms import (
    AMSGRAD_VARIANTS,
    DECAY_CONVENTIONS,
    AddL2GradientState,
    DecoupledWeightDecayState,
    ScaleByAdamState,
    ScaleByLionState,
    add_l2_gradient,
    decay_rate,
    decoupled_weight_decay,
    scale_by_adam,
    scale_by_lion,
)

__version__ = "0.1.0"

__all__ = [
    "AMSGRAD_VARIANTS",
    "DECAY_CONVENTIONS",
    "AddL2GradientState",
    "BlockwiseInt8Storage",
    "DecayMask",
    "DecoupledWeightDecayState",
    "FloatStorage",
    "ScaleByAdamState",
    "ScaleByLionState",
    "__version__",
    "adam_l2",
    "adamw",
    "amsgrad",
    "add_l2_gradient",
    "cpu_kernel",
    "decay_mask",
    "decay_rate",
    "decoupled_weight_decay",
    "diagnostics",
    "lion",
    "memory",
    "packed",
    "packed_layout",
    "packed_transform",
    "PACKED_MASK",
    "PackedLayout",
    "PackedState",
    "quantization",
    "resolve_mask",
    "resolve_storage",
    "scale_by_adam",
    "scale_by_lion",
    "sharding",
]
