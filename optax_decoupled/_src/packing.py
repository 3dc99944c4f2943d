"""Packed (multi-tensor) optimizers: a few contiguous buffers instead of one per leaf."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optax_decoupled._src import masks as masks_lib
from optax_decoupled._src import validation as V
from optax_decoupled._src.quantization import QuantizedArray

#: Top-level keys of a packed tree.
DECAY, NO_DECAY = "decay", "no_decay"

#: Decays the ``"decay/<dtype>"`` buffers of a packed tree and nothing else.
PACKED_MASK = masks_lib.DecayMask(include=(r"^decay/",))


@functools.partial(
    jax.tree_util.register_dataclass, data_fields=[], meta_fields=["treedef", "leaves"]
)
@dataclasses.dataclass(frozen=True)
class PackedParams:
    """The parameters a packed state was built for: their tree structure and, per leaf, its
    key path, shape and (canonical) dtype. Static: a pytree node without leaves, so it lives
    in the state's tree structure and costs nothing in checkpoints or under ``jit``."""

    treedef: Any = None
    leaves: tuple[tuple[str, tuple[int, ...], str], ...] = ()

    @classmethod
    def of(cls, params: Any) -> PackedParams:
        flat, treedef = jax.tree_util.tree_flatten_with_path(params)
        return cls(
            treedef,
            tuple((jax.tree_util.keystr(k), _shape(x), _dtype_name(x)) for k, x in flat),
        )

    def like(self) -> Any:
        """A tree of ``jax.ShapeDtypeStruct`` with these parameters' structure."""
        return self.treedef.unflatten(
            [jax.ShapeDtypeStruct(shape, dtype) for _, shape, dtype in self.leaves]
        )


class PackedState(NamedTuple):
    """State of a :func:`packed` optimizer: the inner optimizer's state on the packed tree,
    and the parameters it was built for (:class:`PackedParams`, static; compared with those
    given to ``update``)."""

    inner_state: optax.OptState
    params: PackedParams = PackedParams()


def _shape(x: Any) -> tuple[int, ...]:
    return tuple(int(d) for d in np.shape(x))


def _dtype_name(x: Any) -> str:
    """The dtype JAX computes ``x`` in: NumPy float64 and Python floats are float32 unless
    x64 is on (they were packed under their own dtype's name, and the next step's float32
    parameters under another)."""
    dtype = x.dtype if hasattr(x, "dtype") else np.result_type(x)
    return jnp.dtype(jax.dtypes.canonicalize_dtype(dtype)).name


def _check_params(expected: PackedParams, params: Any, what: str) -> None:
    """Raises ``ValueError`` naming the first leaf of ``params`` (the parameters, or the
    gradients when ``what`` says so) that differs from those the state was built for."""
    if expected.treedef is None:  # a state built by hand without them: nothing to compare
        return
    got = PackedParams.of(params)
    compare_dtype = what == "parameters"
    for (path, shape, dtype), (gpath, gshape, gdtype) in zip(
        expected.leaves, got.leaves, strict=False
    ):
        if path != gpath:
            break
        if compare_dtype and (shape != gshape or dtype != gdtype):
            raise ValueError(
                f"packed: the parameter at {path} has shape {gshape} and dtype {gdtype} but "
                f"the optimizer state was built for shape {shape} and dtype {dtype}; pass the "
                "parameters init was given (call init again for new parameters)."
            )
        if shape != gshape:
            raise ValueError(
                f"packed: the gradient at {path} has shape {gshape} but its parameter has "
                f"shape {shape}; gradients must have their parameters' shapes."
            )
    if got.treedef != expected.treedef:
        raise ValueError(
            f"packed: the {what} have the structure {got.treedef} but the optimizer state was "
            f"built for {expected.treedef}."
        )


@dataclasses.dataclass(frozen=True)
class _Slot:
    leaf: int  # index in the flattened parameter tree
    offset: int  # first element in the buffer
    size: int
    shape: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class _Buffer:
    dtype: str
    slots: tuple[_Slot, ...]
    length: int  # elements, padding included
    whole: bool  # the buffer is its only leaf, in the leaf's own shape


@dataclasses.dataclass(frozen=True, eq=False)
class PackedLayout:
    """Where each parameter leaf lives in the packed buffers. Static: shapes, dtypes and mask.

    Build it with :func:`packed_layout`. A packed tree is ``{"decay" | "no_decay": {name:
    buffer}}``: ``name`` is a dtype (``"float32"``) for the 1-D concatenation of that group's
    leaves, or ``"leaf<i>"`` for a leaf kept whole (larger than ``max_leaf_size``, or alone in
    its buffer with no padding needed), in its own shape.

    Attributes:
      treedef: the parameters' tree structure.
      buffers: ``{"decay" | "no_decay": {name: buffer}}``; each buffer has a ``dtype``, its
        ``slots`` ``(leaf, offset, size, shape)``, a ``length`` (padding included) and
        ``whole`` (it is one leaf in its own shape).
    """

    treedef: Any
    buffers: dict[str, dict[str, _Buffer]]

    #: Mask to give the optimizer that runs on packed trees (decays the ``"decay"`` buffers).
    mask = PACKED_MASK

    @property
    def num_leaves(self) -> int:
        return self.treedef.num_leaves

    def buffer_sizes(self) -> dict[str, dict[str, int]]:
        """``{"decay" | "no_decay": {name: number of parameters}}`` (padding not counted)."""
        return {
            k: {name: sum(s.size for s in b.slots) for name, b in g.items()}
            for k, g in self.buffers.items()
        }

    def decay_tree(self) -> dict[str, dict[str, bool]]:
        """The mask as a pytree of bools over the packed tree, for optimizers that take one
        (``optax.adamw(..., mask=layout.decay_tree())``); this package's take :attr:`mask`."""
        return {k: {name: k == DECAY for name in g} for k, g in self.buffers.items()}

    def pack(self, tree: Any) -> dict[str, dict[str, jax.Array]]:
        """Flattens and concatenates the leaves of ``tree`` (the parameters' structure), with
        zeros up to each buffer's length."""
        leaves = self.treedef.flatten_up_to(tree)
        out: dict[str, dict[str, jax.Array]] = {}
        for key, group in self.buffers.items():
            out[key] = {}
            for name, b in group.items():
                if b.whole:
                    out[key][name] = leaves[b.slots[0].leaf]
                    continue
                parts = [jnp.reshape(leaves[s.leaf], (s.size,)) for s in b.slots]
                pad = b.length - sum(s.size for s in b.slots)
                if pad:  # in the leaves' dtype (e.g. bfloat16 moments of float32 parameters)
                    parts.append(jnp.zeros((pad,), jnp.result_type(*parts)))
                out[key][name] = parts[0] if len(parts) == 1 else jnp.concatenate(parts)
        return out

    def unpack(self, packed_tree: dict[str, dict[str, jax.Array]]) -> Any:
        """Slices packed buffers back into the parameters' structure and shapes."""
        leaves: list[Any] = [None] * self.num_leaves
        for key, group in self.buffers.items():
            for name, b in group.items():
                buf = packed_tree[key][name]
                if b.whole:
                    leaves[b.slots[0].leaf] = buf
                    continue
                for s in b.slots:
                    piece = jax.lax.slice(buf, (s.offset,), (s.offset + s.size,))
                    leaves[s.leaf] = jnp.reshape(piece, s.shape)
        return self.treedef.unflatten(leaves)

    def _is_packed(self, x: Any) -> bool:
        return (
            isinstance(x, dict)
            and set(x) == set(self.buffers)
            and all(isinstance(x[k], dict) and set(x[k]) == set(self.buffers[k]) for k in x)
        )

    def _is_unpacked(self, x: Any) -> bool:
        # Floating leaves only: a step count has the shape of a scalar parameter.
        try:
            return jax.tree.structure(x) == self.treedef and all(
                tuple(np.shape(leaf)) == s.shape
                and jnp.issubdtype(jnp.result_type(leaf), jnp.floating)
                for leaf, s in zip(self.treedef.flatten_up_to(x), self._slots(), strict=True)
            )
        except (ValueError, TypeError):
            return False

    def _slots(self) -> list[_Slot]:
        slots = [s for g in self.buffers.values() for b in g.values() for s in b.slots]
        return sorted(slots, key=lambda s: s.leaf)

    def unpack_state(self, state: Any) -> Any:
        """The inner optimizer's state with every packed moment unpacked to the parameters'
        structure: the state the unpacked optimizer would have. ``state`` may be a
        :class:`PackedState`, its ``inner_state``, or the state of a chain or wrapper around
        the packed optimizer (``optax.chain(clip, od.contrib.packed(od.adamw)(...))``,
        ``optax.apply_if_finite(...)``): each :class:`PackedState` in it is replaced by its
        unpacked inner state, as the same chain of the unpacked optimizer has it."""
        is_packed_state = lambda x: isinstance(x, PackedState)  # noqa: E731
        if not isinstance(state, PackedState) and any(
            is_packed_state(x) for x in jax.tree.leaves(state, is_leaf=is_packed_state)
        ):
            return jax.tree.map(
                lambda x: self.unpack_state(x) if is_packed_state(x) else x,
                state,
                is_leaf=is_packed_state,
            )
        if isinstance(state, PackedState):
            state = state.inner_state
        _reject_quantized(state, "unpack_state")
        if not any(self._is_packed(x) for x in jax.tree.leaves(state, is_leaf=self._is_packed)):
            raise ValueError(
                "unpack_state: no moment in this state has this layout's buffers "
                f"{self.buffer_sizes()}; build the layout with the parameters, mask, `align` "
                "and `max_leaf_size` the packed optimizer was given."
            )
        return jax.tree.map(
            lambda x: self.unpack(x) if self._is_packed(x) else x, state, is_leaf=self._is_packed
        )

    def pack_state(self, state: Any) -> PackedState:
        """The inverse of :meth:`unpack_state` for the optimizer's own state: packs every
        parameter-shaped subtree of the state of the optimizer that :func:`packed` wraps
        (e.g. ``od.adamw(...)``'s), giving the :class:`PackedState` of the packed optimizer.

        Not the state of a chain or wrapper around it: which part of such a state the
        packed optimizer replaces is not written in the state. Pack that part and put it back,
        e.g. ``(state[0], layout.pack_state(state[1]))`` for ``optax.chain(clip,
        od.adamw(...))``, or ``state._replace(inner_state=layout.pack_state(
        state.inner_state))`` for ``optax.apply_if_finite``."""
        inner = next((f for f in _WRAPPER_FIELDS if f in getattr(state, "_fields", ())), None)
        if inner is not None:
            raise ValueError(
                f"pack_state: this is the state of an Optax wrapper ({type(state).__name__}); "
                f"pack its `{inner}` and put it back: "
                f"state._replace({inner}=layout.pack_state(state.{inner}))."
            )
        _reject_quantized(state, "pack_state")
        if not any(self._is_unpacked(x) for x in jax.tree.leaves(state, is_leaf=self._is_unpacked)):
            raise ValueError(
                "pack_state: no moment in this state has the parameters' structure and shapes."
            )
        packed_inner = jax.tree.map(
            lambda x: self.pack(x) if self._is_unpacked(x) else x, state, is_leaf=self._is_unpacked
        )
        params = self.treedef.unflatten(
            [jax.ShapeDtypeStruct(sl.shape, self._dtype_of(sl.leaf)) for sl in self._slots()]
        )
        return PackedState(inner_state=packed_inner, params=PackedParams.of(params))

    def _dtype_of(self, leaf: int) -> str:
        for g in self.buffers.values():
            for b in g.values():
                if any(sl.leaf == leaf for sl in b.slots):
                    return b.dtype
        raise KeyError(leaf)


#: The fields in which Optax's wrappers keep the wrapped optimizer's state.
_WRAPPER_FIELDS = ("inner_state", "inner_opt_state")


def _reject_quantized(state: Any, method: str) -> None:
    is_q = lambda x: isinstance(x, QuantizedArray)  # noqa: E731
    if any(is_q(x) for x in jax.tree.leaves(state, is_leaf=is_q)):
        raise ValueError(
            f"{method}: this state holds 8-bit moments, whose blocks and scales belong to one "
            "layout (a packed buffer's blocks span several leaves); convert a float32 or "
            "bfloat16 state, or start the other optimizer afresh."
        )


#: Buffer lengths are rounded up to a multiple of this many elements: XLA:CPU runs elementwise
#: loops of odd length without vectorizing them (about 3x slower), and a single odd-sized
#: leaf (a scalar, an odd vocabulary) would otherwise slow down its whole buffer.
ALIGN = 16

#: Leaves with more elements than this keep their own buffer by default. Packing exists for
#: small leaves, whose fixed per-leaf costs dominate their step; a big leaf gains nothing, and
#: with pytree parameters its concatenation costs memory traffic and a parameter-sized
#: temporary every step (on CPU, fresh pages for temporaries over glibc's 32 MB mmap
#: threshold). ``None`` packs every leaf.
MAX_LEAF_SIZE = 2**16


def _check_options(align: Any, max_leaf_size: Any) -> None:
    if not (V.is_int(align) and align >= 1):
        raise ValueError(f"`align` must be a positive int, got {align!r}.")
    if max_leaf_size is not None and not (V.is_int(max_leaf_size) and max_leaf_size >= 0):
        raise ValueError(f"`max_leaf_size` must be None or an int >= 0, got {max_leaf_size!r}.")


def packed_layout(
    params: Any,
    mask: masks_lib.MaskArg = "auto",
    *,
    align: int = ALIGN,
    max_leaf_size: int | None = MAX_LEAF_SIZE,
) -> PackedLayout:
    """The :class:`PackedLayout` of a parameter tree under a decay ``mask``.

    Args:
      params: the parameter pytree (arrays, tracers or ``jax.ShapeDtypeStruct``).
      mask: which leaves are decayed, in any form :func:`~optax_decoupled.resolve_mask`
        accepts (default ``"auto"``, as in the aliases). Decayed leaves go to the ``"decay"``
        buffers, the others to ``"no_decay"``.
      align: each concatenated buffer's length is rounded up to a multiple of ``align``
        elements with zero padding (``1``: no padding). Padding has zero gradient and stays
        zero under every optimizer of this package (with ``eps = eps_root = 0`` its update is
        :math:`0/0`: the :func:`packed` wrapper drops it, flat parameters keep it in padding).
      max_leaf_size: leaves with more elements than this (default :data:`MAX_LEAF_SIZE`,
        65536) are not concatenated but kept whole, each its own buffer; ``None``
        concatenates every leaf (what flat parameters want for the fewest kernels; with
        pytree parameters it costs memory traffic, see ``docs/performance.md``).
    """
    masks_lib.check_mask_arg(mask)
    _check_options(align, max_leaf_size)
    leaves, treedef = jax.tree.flatten(params)
    flags = treedef.flatten_up_to(masks_lib.resolve_mask(mask, params))
    concat: dict[tuple[str, str], list[_Slot]] = {}
    whole: dict[str, dict[str, _Buffer]] = {DECAY: {}, NO_DECAY: {}}
    for i, (leaf, flag) in enumerate(zip(leaves, flags, strict=True)):
        key = DECAY if flag else NO_DECAY
        dt = _dtype_name(leaf)
        shape = tuple(int(d) for d in np.shape(leaf))
        size = math.prod(shape)
        if max_leaf_size is not None and size > max_leaf_size:
            whole[key][f"leaf{i}"] = _Buffer(dt, (_Slot(i, 0, size, shape),), size, True)
            continue
        slots = concat.setdefault((key, dt), [])
        offset = slots[-1].offset + slots[-1].size if slots else 0
        slots.append(_Slot(i, offset, size, shape))
    buffers: dict[str, dict[str, _Buffer]] = {}
    for key in (DECAY, NO_DECAY):
        group: dict[str, _Buffer] = {}
        for (k, dt), slots in sorted(concat.items()):
            if k != key:
                continue
            total = slots[-1].offset + slots[-1].size
            length = -(-total // align) * align
            # One leaf needing no padding stays in its own shape: reshaping it would make XLA
            # copy the updated parameter instead of writing it in place.
            is_whole = len(slots) == 1 and length == total
            group[dt] = _Buffer(dt, tuple(slots), length, is_whole)
        group.update(whole[key])
        if group:
            buffers[key] = group
    return PackedLayout(treedef=treedef, buffers=buffers)


def _check_not_sharded(params: Any) -> None:
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        if isinstance(leaf, jax.core.Tracer) or not isinstance(leaf, jax.Array):
            continue
        sharding = leaf.sharding
        if len(sharding.device_set) > 1 and not sharding.is_fully_replicated:
            raise ValueError(
                f"packed(): parameter {jax.tree_util.keystr(path)} is sharded over "
                f"{len(sharding.device_set)} devices; packing would reshard it every step. "
                "Use the unpacked optimizer for sharded parameters."
            )


def packed_transform(
    inner: optax.GradientTransformation | Callable[[PackedLayout], optax.GradientTransformation],
    mask: masks_lib.MaskArg = "auto",
    *,
    align: int = ALIGN,
    max_leaf_size: int | None = MAX_LEAF_SIZE,
) -> optax.GradientTransformationExtraArgs:
    """Runs ``inner`` on packed trees (low level; most users want :func:`packed`).

    ``inner`` must be elementwise and, if it decays, built with ``mask=PACKED_MASK``, or be a
    function of the :class:`PackedLayout` that builds it (e.g. with
    ``mask=layout.decay_tree()``, for optimizers that do not know :data:`PACKED_MASK`);
    ``mask`` is the user's decay mask, resolved per original leaf to build the layout.
    """
    _check_options(align, max_leaf_size)
    options = dict(align=align, max_leaf_size=max_leaf_size)
    if isinstance(inner, optax.GradientTransformation):
        built = optax.with_extra_args_support(inner)
        build = lambda layout: built  # noqa: E731
    else:
        build = lambda layout: optax.with_extra_args_support(inner(layout))  # noqa: E731

    def init_fn(params):
        V.check_param_dtypes(params, "packed")
        _check_not_sharded(params)
        layout = packed_layout(params, mask, **options)
        inner_state = build(layout).init(layout.pack(params))
        return PackedState(inner_state=inner_state, params=PackedParams.of(params))

    def update_fn(updates, state, params=None, **extra_args):
        # The layout is that of the parameters the state was built for (without `params`,
        # rebuilt from their shapes and dtypes): a tree whose leaves merely add up to the same
        # buffer lengths would otherwise mix the moments of different leaves.
        expected = state.params
        if params is not None:
            _check_params(expected, params, "parameters")
        _check_params(expected, updates, "gradients")
        like = params if params is not None or expected.treedef is None else expected.like()
        layout = packed_layout(updates if like is None else like, mask, **options)
        packed_params = None if params is None else layout.pack(params)
        new, inner_state = build(layout).update(
            layout.pack(updates), state.inner_state, packed_params, **extra_args
        )
        return layout.unpack(new), PackedState(inner_state=inner_state, params=expected)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def packed(
    factory: Callable[..., optax.GradientTransformation],
    *,
    align: int = ALIGN,
    max_leaf_size: int | None = MAX_LEAF_SIZE,
) -> Callable[..., Any]:
    r"""Wraps an optimizer factory so that it runs on a few packed buffers.

    ``od.contrib.packed(od.adamw)`` has the signature of :func:`~optax_decoupled.adamw` and
    builds the same optimizer, computed on one 1-D buffer per *(decayed?, dtype)* group (below):
    identical results, a state of a few arrays, per-step overhead and compile time
    that no longer grow with the number of leaves. It composes like any Optax factory::

        mask = od.decay_mask(exclude="head")
        tx = od.contrib.packed(od.adamw)(1e-3, weight_decay=0.05, mask=mask)
        tx = optax.inject_hyperparams(od.contrib.packed(od.lion))(learning_rate=schedule)
        tx = optax.chain(optax.clip_by_global_norm(1.0), od.contrib.packed(od.amsgrad)(1e-3))

    An Optax optimizer keeps one buffer per parameter leaf for each moment and runs a few small
    kernels per leaf; for a model of many small leaves the step time, the number of buffers handed
    to every jitted call, and the compile time all grow with the number of leaves. Packing groups
    the leaves by *(decayed?, dtype)*, flattens each group and concatenates it (in ``jax.tree``
    order) into one 1-D buffer, zero-padded to a multiple of :data:`ALIGN` elements, and runs the
    optimizer on that small tree::

        {"decay": {"float32": f32[n_decayed]}, "no_decay": {"float32": f32[n_other]}}

    Two ways to use it:

    * :func:`packed` wraps an optimizer factory; parameters and gradients stay ordinary pytrees::

          tx = od.contrib.packed(od.adamw)(1e-3, weight_decay=0.05)  # od.adamw's arguments

      Its state (Adam's ``mu``/``nu``, AMSGrad's ``nu_max``, Lion's ``mu``) for the small leaves
      is a handful of arrays whatever their number, and the optimizer's math for them compiles to
      a few large loops. Each step concatenates their gradients and parameters and slices the
      updates back out, which costs memory traffic: a win for small leaves, a loss for big ones,
      which therefore keep their own buffers (``max_leaf_size``, see ``docs/performance.md``).

    * **Flat parameters**: keep the parameters themselves packed, unpack them inside the loss, and
      give the optimizer the layout's mask. The optimizer step then touches a few buffers whatever
      the number of leaves, and costs what a single-leaf step costs::

          layout = od.contrib.packed_layout(params)  # mask="auto", resolved per leaf
          flat = layout.pack(params)
          tx = od.adamw(1e-3, weight_decay=0.05, mask=layout.mask)
          loss = lambda flat, batch: model_loss(layout.unpack(flat), batch)  # grads come packed

    Why it is exact: the transforms of this package are elementwise and use the parameters only
    for weight decay, so running them on concatenated leaves computes the same floating-point
    operations, element by element, as running them leaf by leaf. The decay mask is resolved per
    **original** leaf (``"auto"``, ``None``, pytrees, callables and ``decay_mask`` rules work as in
    the unpacked aliases); decayed and non-decayed leaves go to different buffers and the inner
    optimizer gets :data:`PACKED_MASK`, which decays the ``"decay"`` buffers only. Executed op by
    op, results are bitwise identical to the unpacked optimizer's (0-d leaves aside, to the last
    bit: XLA divides a vector by a scalar as a multiplication by its reciprocal); under ``jit``,
    XLA contracts multiply-adds into FMAs within a fusion, and the fusions differ, so the two agree
    to float rounding, as a jitted and an eager run of the same optimizer do
    (``tests/test_packed.py``).

    One more exception: bfloat16 moments with stochastic rounding
    (``FloatStorage(..., rounding="stochastic")``) draw their random bits from an element's index
    in its array, which in a packed buffer is its offset there, not its index in the leaf: packed
    and unpacked runs round differently (both without bias), so they agree on average, not bit
    for bit.

    Not for: transforms that need a leaf's shape or whole leaves (``optax.scale_by_trust_ratio`` and
    other layer-wise rules, per-leaf norms, Shampoo-style preconditioners), and block-wise quantized
    moments, whose blocks would then straddle leaves (valid, but not identical to per-leaf blocks).
    Global reductions such as ``optax.clip_by_global_norm`` are fine (same norm up to summation
    order). Parameters must be on one device or fully replicated: concatenating leaves sharded
    across devices would reshard them every step, so :func:`packed` refuses them; keep the unpacked
    optimizer for sharded models.

    Checkpointing: a packed state is a NamedTuple of a few arrays, and Orbax or ``np.savez`` store
    it as is. It also records, statically (in its tree structure, not as arrays), the parameters
    it was built for (:class:`PackedParams`): ``update`` refuses parameters or gradients of other
    shapes, dtypes or structure with a ``ValueError`` naming the leaf, as the unpacked optimizer
    does (a tree whose leaves fill the same buffers would otherwise mix the moments of different
    leaves). :meth:`PackedLayout.unpack_state` and :meth:`PackedLayout.pack_state` convert a
    state between the packed and the unpacked optimizer (e.g. to resume an unpacked run packed).

    Args:
      factory: a function returning an **elementwise** :class:`optax.GradientTransformation`:
        :func:`~optax_decoupled.adamw`, :func:`~optax_decoupled.adam_l2`,
        :func:`~optax_decoupled.amsgrad`, :func:`~optax_decoupled.lion`, ``optax.adam``,
        ``optax.inject_hyperparams(od.adamw)``, or your own. If it has a ``mask`` parameter,
        the wrapper resolves the mask per original leaf and passes on :data:`PACKED_MASK`
        (this package's factories) or the layout's pytree of bools,
        :meth:`PackedLayout.decay_tree` (any other, e.g. ``optax.adamw``, which would take
        :data:`PACKED_MASK` for a truthy prefix and decay every buffer); without one, every
        leaf is treated as decayed (it makes no difference to a transform that does not
        decay).
      align: buffer lengths are padded to a multiple of this (see :func:`packed_layout`).
      max_leaf_size: leaves with more elements than this keep their own buffer (default
        :data:`MAX_LEAF_SIZE`, 65536: the small leaves, whose per-leaf costs dominate, are
        packed; the big ones, where packing pytree parameters costs memory traffic, are not).
        ``None`` packs every leaf. Pass the same value to :func:`packed_layout` to convert
        states.

    Returns:
      A factory with ``factory``'s signature; its transformations have a
      :class:`PackedState`.

    Raises:
      TypeError: if ``factory`` is a built ``GradientTransformation`` (its decay mask would be
        resolved on the packed buffers instead of your leaves: pass the factory).
    """
    _check_options(align, max_leaf_size)
    if isinstance(factory, optax.GradientTransformation) or not callable(factory):
        raise TypeError(
            "packed() takes an optimizer factory, e.g. od.contrib.packed(od.adamw)(1e-3, "
            f"weight_decay=0.1), not a {type(factory).__name__}: a built transformation's decay "
            "mask would be resolved on the packed buffers instead of your parameter leaves. To "
            "pack a chain, write a factory that accepts `mask` and passes it on."
        )
    signature = inspect.signature(factory)
    has_mask = "mask" in signature.parameters
    # This package's factories resolve PACKED_MASK (a DecayMask, on purpose not callable);
    # another library's take it for one truthy prefix, so they get a pytree of bools.
    own = getattr(inspect.unwrap(factory), "__module__", "").startswith("optax_decoupled.")

    @functools.wraps(factory)
    def packed_factory(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()

        def build(inner_mask):
            bound.arguments["mask"] = inner_mask
            return factory(*bound.args, **bound.kwargs)

        mask = None
        if not has_mask:
            inner = factory(*bound.args, **bound.kwargs)
        else:
            mask = bound.arguments["mask"]
            masks_lib.check_mask_arg(mask)
            if own:
                inner = build(PACKED_MASK)
            else:
                build(None)  # checks the other arguments now, not at init

                def inner(layout):
                    return build(layout.decay_tree())

        return packed_transform(inner, mask, align=align, max_leaf_size=max_leaf_size)

    return packed_factory
