"""The second tier: public tools that are not the core's promise.

* **Packing** (:func:`packed`, :func:`packed_layout`, :func:`packed_transform`): many small
  parameter leaves gathered into a few flat buffers, so a step launches a few kernels.
* **Sharding** (:func:`state_shardings`, :func:`jit_init`): the optimizer state laid out like
  the parameters under :mod:`jax.sharding`, 8-bit codes and scales included.
* **Memory audit** (:func:`state_bytes`, :func:`step_memory`, :func:`training_memory`): state
  bytes per leaf and per parameter, a compiled step's memory, and the arithmetic for a model.
* **8-bit codes** (:class:`QuantizedArray`, :func:`quantize`, :func:`dequantize`,
  :func:`dynamic_map`): the block-wise dynamic quantization behind ``state_dtype="int8"``.

Their signatures may change between minor releases.
"""

from optax_decoupled._src.memory import (
    MOMENTS_PER_PARAM,
    StateBytes,
    StepMemory,
    abstract_state,
    format_bytes,
    leaf_bytes,
    moment_bytes_per_element,
    num_params,
    state_bytes,
    step_memory,
    theoretical_bytes_per_param,
    training_memory,
)
from optax_decoupled._src.packing import (
    PACKED_MASK,
    PackedLayout,
    PackedState,
    packed,
    packed_layout,
    packed_transform,
)
from optax_decoupled._src.quantization import QuantizedArray, dequantize, dynamic_map, quantize
from optax_decoupled._src.sharding import jit_init, state_shardings

__all__ = (
    "MOMENTS_PER_PARAM",
    "PACKED_MASK",
    "PackedLayout",
    "PackedState",
    "QuantizedArray",
    "StateBytes",
    "StepMemory",
    "abstract_state",
    "dequantize",
    "dynamic_map",
    "format_bytes",
    "jit_init",
    "leaf_bytes",
    "moment_bytes_per_element",
    "num_params",
    "packed",
    "packed_layout",
    "packed_transform",
    "quantize",
    "state_bytes",
    "state_shardings",
    "step_memory",
    "theoretical_bytes_per_param",
    "training_memory",
)
