"""Packed optimizers: identical to the unpacked ones, composable, checkpointable, donatable.

Identity is checked bitwise on eager (op-by-op) runs, where both paths execute the same
correctly rounded elementwise operations. One exception: XLA rewrites ``x / c`` with a
broadcast scalar ``c`` as ``x * (1 / c)``, which it cannot do for a 0-d ``x``, so a 0-d leaf
(computed inside a vector when packed) may differ in its last bit. Under ``jit`` XLA:CPU
contracts ``a * b + c`` into fused multiply-adds wherever both sit in one fusion, and the
fusion boundaries of the packed and unpacked programs differ, so jitted runs agree to float
rounding (as jitted and eager runs of the *same* optimizer do). Speed is measured by
``benchmarks/update_step.py``, not asserted here.
"""

import inspect
import io
from typing import NamedTuple

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_decoupled as od
from optax_decoupled._src.packing import PackedState, packed, packed_layout

STEPS = 20
SCHED = optax.warmup_cosine_decay_schedule(0.0, 1e-2, 4, 40)


class Block(NamedTuple):
    kernel: jax.Array
    bias: jax.Array


def mixed_params(seed=0):
    """Matrices, vectors, a scalar, an empty leaf, bfloat16 leaves, nested containers."""
    ks = jax.random.split(jax.random.key(seed), 9)
    n = jax.random.normal
    return {
        "embed": n(ks[0], (7, 4)),
        "blocks": [
            Block(n(ks[1], (4, 5)), n(ks[2], (5,))),
            Block(n(ks[3], (5, 3), jnp.bfloat16), n(ks[4], (3,), jnp.bfloat16)),
        ],
        "norm": {"scale": n(ks[5], (3,))},
        "head": {"kernel": n(ks[6], (3, 2, 2)), "empty": jnp.zeros((0, 4))},
        "temperature": n(ks[7], ()),
    }


@jax.jit
def grads_at(t, params):
    """A gradient that depends on the parameters and on the step (a noisy quadratic)."""
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.fold_in(jax.random.key(1), t), len(leaves))
    return treedef.unflatten(
        [
            (p.astype(jnp.float32) + 0.3 * jax.random.normal(k, p.shape)).astype(p.dtype)
            for p, k in zip(leaves, keys, strict=True)
        ]
    )


def run(tx, params, steps=STEPS, state=None, t0=0, jit=False):
    """``steps`` steps (eager, or one jitted scan); returns the parameters and the state."""
    state = tx.init(params) if state is None else state
    if not jit:
        for t in range(t0, t0 + steps):
            updates, state = tx.update(grads_at(t, params), state, params)
            params = optax.apply_updates(params, updates)
        return params, state

    def body(carry, t):
        p, s = carry
        u, s = tx.update(grads_at(t, p), s, p)
        return (optax.apply_updates(p, u), s), None

    @jax.jit
    def loop(p, s):
        return jax.lax.scan(body, (p, s), jnp.arange(t0, t0 + steps))[0]

    return loop(params, state)


# Each case: (factory, kwargs). Masks and schedules vary across the cases.
CUSTOM_MASK = {
    "embed": False,
    "blocks": [Block(True, False), Block(True, True)],
    "norm": {"scale": False},
    "head": {"kernel": True, "empty": True},
    "temperature": False,
}
CASES = {
    "adamw_auto": (od.adamw, dict(learning_rate=SCHED, weight_decay=0.1)),
    "adamw_pytree_mask_schedule_convention": (
        od.adamw,
        dict(
            learning_rate=SCHED,
            weight_decay=0.1,
            mask=CUSTOM_MASK,
            decay_convention="schedule",
            peak_learning_rate=1e-2,
        ),
    ),
    "adam_l2_decay_mask": (
        od.adam_l2,
        dict(learning_rate=SCHED, weight_decay=1e-2, mask=od.decay_mask(exclude="head")),
    ),
    "amsgrad_pytorch_none": (
        od.amsgrad,
        dict(learning_rate=SCHED, variant="pytorch", weight_decay=0.1, mask=None),
    ),
    "amsgrad_optax_coupled_callable": (
        od.amsgrad,
        dict(
            learning_rate=1e-2,
            variant="optax",
            coupled=True,
            weight_decay=lambda c: 1e-2 / (1 + c),
            mask=lambda p: jax.tree.map(lambda x: x.ndim == 2, p),
        ),
    ),
    "amsgrad_paper": (od.amsgrad, dict(learning_rate=SCHED, variant="paper", weight_decay=0.1)),
    "lion_auto": (od.lion, dict(learning_rate=lambda c: 1e-3 * 0.95**c, weight_decay=0.5)),
    "adamw_bf16_state": (
        od.adamw,
        dict(learning_rate=SCHED, weight_decay=0.1, state_dtype="bfloat16"),
    ),
    "optax_adam_no_mask_arg": (optax.adam, dict(learning_rate=SCHED)),
    # Another library's factory with a mask: it gets the layout's pytree of bools (it took
    # PACKED_MASK for one truthy prefix and decayed every buffer).
    "optax_adamw_pytree_mask": (
        optax.adamw,
        dict(learning_rate=SCHED, weight_decay=0.5, mask=CUSTOM_MASK),
    ),
    "optax_injected_adamw_pytree_mask": (
        optax.inject_hyperparams(optax.adamw),
        dict(learning_rate=1e-2, weight_decay=0.5, mask=CUSTOM_MASK),
    ),
}


def assert_identical(got, want):
    """Bitwise for leaves of rank >= 1, to the last bit for 0-d leaves (see the docstring)."""

    def check(a, b):
        assert a.dtype == b.dtype and a.shape == b.shape
        if a.ndim:
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        else:
            np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(b, np.float64),
                                       rtol=1e-6)  # fmt: skip

    jax.tree.map(check, got, want)


@pytest.mark.parametrize("case", sorted(CASES))
def test_packed_equals_unpacked_bitwise(case):
    factory, kwargs = CASES[case]
    params = mixed_params()
    p_ref, s_ref = run(factory(**kwargs), params)
    p_pk, s_pk = run(packed(factory)(**kwargs), params)
    assert_identical(p_pk, p_ref)
    chex.assert_trees_all_equal_dtypes(p_pk, params)
    mask = kwargs.get("mask", "auto") if "mask" in inspect.signature(factory).parameters else None
    layout = packed_layout(params, mask)
    assert_identical(layout.unpack_state(s_pk), s_ref)


def _assert_close_per_dtype(got, want):
    """f32 leaves to a few ulps (times 20 steps of amplification); bf16 leaves to one bf16 ulp
    (a last-bit difference in f32 can flip a bf16 rounding)."""

    def check(a, b):
        rtol, atol = (1e-2, 1e-2) if a.dtype == jnp.bfloat16 else (2e-5, 1e-6)
        np.testing.assert_allclose(
            np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=rtol, atol=atol
        )

    jax.tree.map(check, got, want)


def test_packed_close_to_unpacked_under_jit():
    factory, kwargs = CASES["amsgrad_pytorch_none"]
    params = mixed_params()
    p_ref, _ = run(factory(**kwargs), params, jit=True)
    p_pk, _ = run(packed(factory)(**kwargs), params, jit=True)
    _assert_close_per_dtype(p_pk, p_ref)


def test_layout_groups_by_mask_and_dtype():
    params = mixed_params()
    layout = packed_layout(params)  # "auto"
    sizes = layout.buffer_sizes()
    # auto decays embed? no (name rule); blocks kernels, head kernel (3-D) yes.
    assert sizes == {
        "decay": {"bfloat16": 15, "float32": 20 + 12},
        "no_decay": {"bfloat16": 3, "float32": 28 + 5 + 3 + 0 + 1},
    }
    packed_params = layout.pack(params)
    chex.assert_trees_all_equal(layout.unpack(packed_params), params)
    state = packed(od.adamw)(1e-3).init(params)
    assert len(jax.tree.leaves(state)) == 1 + 2 * 4  # one count, mu and nu as 4 buffers each


@pytest.mark.parametrize("options", [dict(align=1), dict(max_leaf_size=10), dict(align=64)])
def test_layout_options_keep_results_identical(options):
    params = mixed_params()
    kwargs = dict(learning_rate=SCHED, weight_decay=0.1)
    p_ref, s_ref = run(od.adamw(**kwargs), params, steps=6)
    p_pk, s_pk = run(packed(od.adamw, **options)(**kwargs), params, steps=6)
    assert_identical(p_pk, p_ref)
    layout = packed_layout(params, **options)
    assert_identical(layout.unpack_state(s_pk), s_ref)
    align = options.get("align", 16)
    for group in layout.buffers.values():
        for b in group.values():
            assert b.whole or b.length % align == 0
    if "max_leaf_size" in options:  # leaves of more than 10 elements are kept whole
        kept = {n for g in layout.buffers.values() for n in g if n.startswith("leaf")}
        assert kept == {"leaf0", "leaf2", "leaf4", "leaf6"}  # 20, 15, 28 and 12 elements


def test_padding_of_flat_parameters_stays_zero():
    params = {"w": jnp.ones((3, 3)), "b": jnp.ones(5), "t": jnp.ones(())}  # 9 + 6: padded
    layout = packed_layout(params, None)
    flat = layout.pack(params)
    assert flat["decay"]["float32"].shape == (16,)
    tx = od.adamw(1e-2, weight_decay=0.5, mask=layout.mask)
    state = tx.init(flat)
    for _ in range(3):
        grads = jax.grad(lambda f: sum(jnp.sum(x**2) for x in jax.tree.leaves(layout.unpack(f))))(
            flat
        )
        updates, state = tx.update(grads, state, flat)
        flat = optax.apply_updates(flat, updates)
    np.testing.assert_array_equal(flat["decay"]["float32"][15:], 0.0)


def test_big_leaves_keep_their_own_buffer_by_default():
    params = {"big": jnp.ones((300, 300)), "small": jnp.ones((3, 3)), "b": jnp.ones(3)}
    layout = packed_layout(params)
    assert layout.buffer_sizes() == {
        "decay": {"float32": 9, "leaf1": 90000},
        "no_decay": {"float32": 3},
    }
    assert packed(od.adamw)(1e-3).init(params).inner_state[0].mu["decay"]["leaf1"].shape == (
        300,
        300,
    )
    everything = packed_layout(params, max_leaf_size=None)
    assert everything.buffer_sizes()["decay"] == {"float32": 90009}
    with pytest.raises(ValueError, match="max_leaf_size"):
        everything.unpack_state(packed(od.adamw)(1e-3).init(params))


def test_state_has_a_few_arrays_whatever_the_number_of_leaves():
    params = {f"layer{i}": {"kernel": jnp.ones((3, 2)), "bias": jnp.ones(2)} for i in range(60)}
    state = packed(od.amsgrad)(1e-3).init(params)
    moments = [x for x in jax.tree.leaves(state) if x.ndim > 0]
    assert len(moments) == 6  # mu, nu, nu_max x (decay, no_decay)
    assert {x.shape for x in moments} == {(368,), (128,)}  # 360 and 120, padded to 16


def test_inject_hyperparams_outside_and_inside():
    params = mixed_params()
    kwargs = dict(learning_rate=SCHED, weight_decay=0.1)
    p_ref, _ = run(optax.inject_hyperparams(od.adamw)(**kwargs), params)
    p_out, s_out = run(optax.inject_hyperparams(packed(od.adamw))(**kwargs), params)
    p_in, s_in = run(packed(optax.inject_hyperparams(od.adamw))(**kwargs), params)
    assert_identical(p_out, p_ref)
    assert_identical(p_in, p_ref)
    np.testing.assert_allclose(s_out.hyperparams["learning_rate"], SCHED(STEPS - 1), rtol=1e-6)
    assert isinstance(s_in, PackedState)
    np.testing.assert_allclose(s_in.inner_state.hyperparams["weight_decay"], 0.1, rtol=1e-6)


def test_injected_hyperparameters_can_be_changed_and_vmapped():
    params = mixed_params()
    tx = optax.inject_hyperparams(packed(od.lion))(learning_rate=1e-3, weight_decay=0.3)
    ref = optax.inject_hyperparams(od.lion)(learning_rate=1e-3, weight_decay=0.3)

    def train(lr):
        def one(tx):
            state = tx.init(params)
            state.hyperparams["learning_rate"] = lr
            return run(tx, params, steps=2, state=state)[0]

        return one(tx), one(ref)

    lrs = jnp.array([1e-3, 3e-3])
    got, want = jax.jit(jax.vmap(train))(lrs)
    _assert_close_per_dtype(got, want)


def test_chain_with_global_norm_clipping():
    params = mixed_params()
    make = lambda f: optax.chain(optax.clip_by_global_norm(1.0), f(SCHED, weight_decay=0.1))
    got = run(make(packed(od.adamw)), params, steps=8)[0]
    assert_identical(got, run(make(od.adamw), params, steps=8)[0])


def test_checkpoint_round_trip_and_conversion():
    params = mixed_params()
    tx = packed(od.adamw)(SCHED, weight_decay=0.1)
    p_full, s_full = run(tx, params, steps=STEPS)

    # Save after 10 steps as plain arrays (what Orbax or np.savez store), restore, continue.
    p10, s10 = run(tx, params, steps=10)
    buf = io.BytesIO()
    np.savez(buf, *[np.asarray(x, np.float32) for x in jax.tree.leaves(s10)])
    buf.seek(0)
    stored = np.load(buf)
    template = tx.init(params)
    restored = jax.tree.unflatten(
        jax.tree.structure(template),
        [jnp.asarray(stored[f"arr_{i}"], x.dtype) for i, x in enumerate(jax.tree.leaves(template))],
    )
    chex.assert_trees_all_equal(restored, s10)
    p_res, s_res = run(tx, p10, steps=STEPS - 10, state=restored, t0=10)
    chex.assert_trees_all_equal((p_res, s_res), (p_full, s_full))  # same program: bitwise

    # An unpacked run's state converts to the packed optimizer's, and back.
    layout = packed_layout(params)
    ref = od.adamw(SCHED, weight_decay=0.1)
    pu10, su10 = run(ref, params, steps=10)
    assert_identical(layout.pack_state(su10), s10)
    assert_identical(layout.unpack_state(s10), su10)
    chex.assert_trees_all_equal(layout.unpack_state(layout.pack_state(su10)), su10)
    p_conv, _ = run(tx, pu10, steps=STEPS - 10, state=layout.pack_state(su10), t0=10)
    assert_identical(p_conv, p_full)


def test_state_conversion_keeps_low_precision_moments_and_refuses_8bit():
    """pack_state pads a buffer in its moments' dtype (bfloat16 state stays bfloat16, so the
    converted state is a valid scan carry); 8-bit moments cannot change layout: a clear error."""
    params = {"w": jnp.ones((100, 100)), "b": jnp.ones((7,)), "v": jnp.ones((3000,))}
    grads = jax.tree.map(lambda x: jnp.full_like(x, 0.1), params)
    layout = packed_layout(params)
    tx = packed(od.adamw)(1e-3, state_dtype="bfloat16")
    converted = layout.pack_state(od.adamw(1e-3, state_dtype="bfloat16").init(params))
    chex.assert_trees_all_equal_shapes_and_dtypes(converted, tx.init(params))
    jax.lax.scan(lambda s, _: (tx.update(grads, s, params)[1], None), converted, length=2)
    storage = od.BlockwiseInt8Storage(min_size=0)
    with pytest.raises(ValueError, match="pack_state: this state holds 8-bit moments"):
        layout.pack_state(od.adamw(1e-3, state_dtype=storage).init(params))
    with pytest.raises(ValueError, match="unpack_state: this state holds 8-bit moments"):
        layout.unpack_state(packed(od.adamw)(1e-3, state_dtype=storage).init(params))


def test_flat_parameters_with_the_layout_mask():
    """Parameters kept packed by the user: the plain optimizer with ``layout.mask``."""
    params = mixed_params()
    layout = packed_layout(params)
    tx = od.adamw(SCHED, weight_decay=0.1, mask=layout.mask)
    flat = layout.pack(params)
    state = tx.init(flat)
    for t in range(5):
        grads = layout.pack(grads_at(t, layout.unpack(flat)))
        updates, state = tx.update(grads, state, flat)
        flat = optax.apply_updates(flat, updates)
    p_ref, _ = run(od.adamw(SCHED, weight_decay=0.1), params, steps=5)
    assert_identical(layout.unpack(flat), p_ref)
    # Optax's own optimizers take the mask as a pytree of bools over the packed tree.
    auto = jax.tree.map(lambda p: p.ndim >= 2, params)
    auto["embed"] = False
    optax_flat = optax.adamw(1e-2, weight_decay=0.1, mask=layout.decay_tree())
    optax_tree = optax.adamw(1e-2, weight_decay=0.1, mask=auto)
    flat, ref = layout.pack(params), params
    s_flat, s_tree = optax_flat.init(flat), optax_tree.init(ref)
    for t in range(3):
        u, s_flat = optax_flat.update(layout.pack(grads_at(t, layout.unpack(flat))), s_flat, flat)
        flat = optax.apply_updates(flat, u)
        u, s_tree = optax_tree.update(grads_at(t, ref), s_tree, ref)
        ref = optax.apply_updates(ref, u)
    assert_identical(layout.unpack(flat), ref)


def _step(tx):
    def step(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    return jax.jit(step, donate_argnums=(0, 1))


def _nbytes(tree):
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


@pytest.mark.parametrize("kind", ["default", "packed", "flat"])
def test_donation_reuses_every_buffer(kind):
    """With ``donate_argnums=(0, 1)`` every parameter and state buffer is updated in place:
    the compiled step aliases all of them and allocates no parameter-sized copy."""
    params = {f"l{i}": {"kernel": jnp.ones((64, 128)), "bias": jnp.ones(2048)} for i in range(8)}
    smallest_leaf = 2048 * 4
    if kind == "flat":
        layout = packed_layout(params)
        params = layout.pack(params)
        tx = od.adamw(1e-3, weight_decay=0.1, mask=layout.mask)
    else:
        tx = (packed(od.adamw) if kind == "packed" else od.adamw)(1e-3, weight_decay=0.1)
    state = tx.init(params)
    grads = jax.tree.map(jnp.ones_like, params)
    step = _step(tx)
    mem = step.lower(params, state, grads).compile().memory_analysis()
    donated = _nbytes(params) + _nbytes(state)
    assert mem.alias_size_in_bytes == donated
    if kind == "packed":
        # Scratch for the packed gradient, parameters and update; no copy of the state.
        assert mem.temp_size_in_bytes <= 3 * _nbytes(params) + 1024
    else:
        # Scalars and the backend's scratch (about 4.5 KiB on a GPU), never a leaf's copy.
        assert mem.temp_size_in_bytes < smallest_leaf
    new_params, _ = step(params, state, grads)
    assert all(x.is_deleted() for x in jax.tree.leaves((params, state)))
    assert not any(x.is_deleted() for x in jax.tree.leaves(new_params))


def test_rejects_a_built_transformation():
    with pytest.raises(TypeError, match="factory"):
        packed(od.adamw(1e-3))
    with pytest.raises(ValueError, match="mask"):
        packed(od.adamw)(1e-3, mask="matrices")
    with pytest.raises(ValueError, match="align"):
        packed(od.adamw, align=0)
    with pytest.raises(ValueError, match="max_leaf_size"):
        packed_layout({"a": jnp.ones(2)}, max_leaf_size=-1)


def test_signature_is_the_factory_s():
    import inspect

    assert inspect.signature(packed(od.adamw)) == inspect.signature(od.adamw)


def test_the_public_path_is_the_implementation():
    """``od.contrib.packed`` is the function of ``optax_decoupled._src.packing`` (no module of
    the same name shadows it), and no ``optax_decoupled.packed`` module exists."""
    import importlib

    import optax_decoupled._src.packing as packing_module

    assert callable(od.contrib.packed) and od.contrib.packed is packing_module.packed
    assert od.contrib.packed_layout is packing_module.packed_layout
    assert od.contrib.PackedState is PackedState
    assert od.contrib.PACKED_MASK is packing_module.PACKED_MASK
    for old in ("optax_decoupled.packed", "optax_decoupled.packing"):
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module(old)


def test_state_shardings_of_a_packed_optimizer_is_a_clear_error():
    """Packed state has no per-parameter moments to place (packed optimizers are for
    unsharded parameters): sharding.state_shardings/jit_init say so instead of failing on a
    pytree mismatch, also inside chain and inject_hyperparams."""
    from optax_decoupled._src import sharding

    params = {"w": jnp.ones((8, 8)), "b": jnp.ones(8)}
    for tx in (
        od.contrib.packed(od.adamw)(1e-3),
        optax.chain(optax.clip(1.0), od.contrib.packed(od.lion)(1e-3)),
        optax.inject_hyperparams(od.contrib.packed(od.adamw))(learning_rate=1e-3),
    ):
        with pytest.raises(ValueError, match="this optimizer is packed"):
            sharding.jit_init(tx, params)
    sharding.jit_init(od.adamw(1e-3), params)  # unpacked: fine


# ---------------------------------------------------------------------------------------------
# Parameters or gradients other than those init was given (from a review; each was silently
# accepted or a cryptic error)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("factory", [od.adamw, od.lion])
def test_parameters_of_other_shapes_with_the_same_buffer_length_are_refused(factory):
    """``{"a": (3,), "b": (5,)}`` at init and ``{"a": (5,), "b": (3,)}`` at update fill the
    same buffers: the layout was rebuilt from the update's parameters and the moments of the
    two leaves were silently mixed. The unpacked optimizer refuses it; so does the packed one,
    naming the leaf."""
    tx = packed(factory)(1e-2, weight_decay=0.1)
    state = tx.init({"a": jnp.ones(3), "b": jnp.ones(5)})
    swapped = {"a": jnp.ones(5), "b": jnp.ones(3)}
    other_shape = r"parameter at \['a'\] has shape \(5,\) and dtype float32 but"
    with pytest.raises(ValueError, match=other_shape):
        tx.update(swapped, state, swapped)
    other_dtype = r"parameter at \['a'\] has shape \(3,\) and dtype bfloat16"
    with pytest.raises(ValueError, match=other_dtype):
        tx.update(
            {"a": jnp.ones(3), "b": jnp.ones(5)},
            state,
            {"a": jnp.ones(3, jnp.bfloat16), "b": jnp.ones(5)},
        )
    with pytest.raises(ValueError, match=r"the parameters have the structure"):
        extra = {"a": jnp.ones(3), "b": jnp.ones(5), "c": jnp.ones(1)}
        tx.update(extra, state, extra)


@pytest.mark.parametrize("with_params", [True, False])
def test_gradients_of_other_shapes_are_refused(with_params):
    """A transposed (3, 5) gradient of a (5, 3) kernel or a (1, 3) gradient of a (3,) bias
    was reshaped into the buffer without a word."""
    params = {"w": jnp.ones((5, 3)), "b": jnp.ones(3)}
    tx = packed(od.adamw)(1e-2, weight_decay=0.0 if not with_params else 0.1)
    state = tx.init(params)
    for grads, where, shape in [
        ({"w": jnp.ones((3, 5)), "b": jnp.ones(3)}, "w", r"\(3, 5\)"),
        ({"w": jnp.ones((5, 3)), "b": jnp.ones((1, 3))}, "b", r"\(1, 3\)"),
    ]:
        with pytest.raises(ValueError, match=rf"gradient at \['{where}'\] has shape {shape}"):
            tx.update(grads, state, params if with_params else None)


def test_numpy_float64_and_python_float_parameters_as_unpacked():
    """Parameters from NumPy (float64, computed in float32 with x64 off) named their buffers
    "float64" at init and "float32" from the first step on (a pytree error at the second
    step); a Python float leaf raised AttributeError at init."""
    params = {"w": np.linspace(-1.0, 1.0, 12).reshape(4, 3), "b": np.zeros(3), "t": 0.5}
    outs = []
    for factory in (od.adamw, packed(od.adamw)):
        tx = factory(1e-2, weight_decay=0.1)
        p, state = params, tx.init(params)
        for t in range(3):
            grads = jax.tree.map(lambda x, t=t: jnp.sin(jnp.asarray(x, jnp.float32) + t), p)
            updates, state = tx.update(grads, state, p)
            p = optax.apply_updates(p, updates)
        outs.append(p)
    chex.assert_trees_all_close(outs[1], outs[0], rtol=1e-6)  # 0-d leaf: to the last bit
    chex.assert_trees_all_equal(outs[1]["w"], outs[0]["w"])


def test_state_conversion_inside_chains_and_wrappers():
    """``unpack_state`` of a chain's or wrapper's state unpacks the PackedState inside it;
    ``pack_state`` of a wrapper's state says which field to pack (it wrapped the whole state
    and failed later with AttributeError); a scalar parameter tree no longer takes the step
    count for a moment ("entry not a 2- or 3- tuple")."""
    params = {"w": jnp.linspace(-1.0, 1.0, 12).reshape(4, 3), "b": jnp.ones(3)}
    layout = packed_layout(params)
    for wrap in (
        lambda tx: optax.chain(optax.clip_by_global_norm(1.0), tx),
        lambda tx: optax.apply_if_finite(tx, 3),
    ):
        tx_p, tx_u = wrap(packed(od.adamw)(1e-2)), wrap(od.adamw(1e-2))
        s_p, s_u = tx_p.init(params), tx_u.init(params)
        _, s_p = tx_p.update(params, s_p, params)
        _, s_u = tx_u.update(params, s_u, params)
        chex.assert_trees_all_close(layout.unpack_state(s_p), s_u, rtol=1e-6)
    with pytest.raises(ValueError, match="pack its `inner_state`"):
        layout.pack_state(s_u)
    repacked = s_u._replace(inner_state=layout.pack_state(s_u.inner_state))
    chex.assert_trees_all_close(repacked, s_p, rtol=1e-6)
    scalar = jnp.asarray(0.5)
    tx, scalar_layout = od.adamw(1e-2, mask=None), packed_layout(scalar, mask=None)
    _, state = tx.update(scalar, tx.init(scalar), scalar)
    back = scalar_layout.unpack_state(scalar_layout.pack_state(state))
    chex.assert_trees_all_equal(back, state)
