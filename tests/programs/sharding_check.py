"""Run in its own process with 8 simulated CPU devices (see tests/test_sharding.py).

For every mesh kind (Explicit axes from ``jax.make_mesh``, Auto axes from ``Mesh``) x alias x
state dtype: after eager init, jitted init (``sharding.jit_init``) and a jitted update, every
moment has its parameter's sharding (8-bit moments: codes and scales as
``storage.stored_sharding`` lays them out, split along the leading axis like the parameter's
when the blocks allow it), every update has its parameter's sharding, and state and updates
equal those of the same steps on one device; four more steps stay within DRIFT of the
one-device run. Prints one JSON object {case: [problems]}.
"""

import json
import os
import sys

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
)
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import optax_decoupled as od  # noqa: E402
from optax_decoupled._src import sharding, storage  # noqa: E402
from optax_decoupled._src.quantization import QuantizedArray  # noqa: E402

ALIASES = {
    "adamw": lambda sd: od.adamw(1e-3, weight_decay=0.1, state_dtype=sd),
    "adam_l2": lambda sd: od.adam_l2(1e-3, weight_decay=0.1, state_dtype=sd),
    "amsgrad": lambda sd: od.amsgrad(1e-3, weight_decay=0.1, state_dtype=sd),
    "lion": lambda sd: od.lion(1e-4, weight_decay=0.1, state_dtype=sd),
}


def check_moments(tx, state, params, label, problems):
    """Each param-shaped state leaf must carry its parameter's sharding (via optax's map)."""
    param_shardings = jax.tree.map(lambda p: p.sharding, params)

    def compare(sharding_of_param, leaf):
        # int8: codes (n_blocks, B) and absmax (n_blocks,) split like the param's leading axis
        # when n_blocks allows it, else replicated (storage.stored_sharding).
        expected = storage.stored_sharding(leaf, sharding_of_param)
        for x, sh in zip(jax.tree.leaves(leaf), jax.tree.leaves(expected), strict=True):
            if not x.sharding.is_equivalent_to(sh, x.ndim):
                problems.append(f"{label}: {x.shape} has {x.sharding}, expected {sh}")
        return leaf

    optax.tree_utils.tree_map_params(
        tx, lambda leaf, sh: compare(sh, leaf), state, param_shardings,
        transform_non_params=lambda x: x,
        is_leaf=lambda x: isinstance(x, QuantizedArray),
    )  # fmt: skip


def main(state_dtypes):
    assert jax.device_count() == 8, jax.devices()
    results = {}
    # jax.make_mesh gives Explicit axes (sharding in types); Mesh(...) the classic Auto axes.
    for kind, mesh in (
        ("explicit", jax.make_mesh((8,), ("fsdp",))),
        ("auto", jax.sharding.Mesh(jax.devices(), ("fsdp",))),
    ):
        run_mesh(kind, mesh, state_dtypes, results)
    results["mixed-devices"] = check_mixed_devices(jax.make_mesh((8,), ("fsdp",)))
    results["masks"] = check_masks(jax.make_mesh((8,), ("fsdp",)))
    print(json.dumps(results))


def check_mixed_devices(mesh):
    """An uncommitted one-device or NumPy parameter (first in tree order) next to mesh-sharded ones:
    its moments and the step counts go on the mesh, replicated (where jit puts it), and
    jit_init works; no parameters at all: the default device."""
    problems = []
    # A NumPy parameter (tx.init takes one; it has no .sharding) is placed as uncommitted.
    for kind, bias in (("jax", jnp.ones((5,))), ("numpy", np.ones((5,), np.float32))):
        params = {
            "a_bias": bias,
            "w": jax.device_put(jnp.ones((64, 256)), NamedSharding(mesh, P("fsdp"))),
        }
        for sd in (None, "int8"):
            tx = od.adamw(1e-3, state_dtype=sd)
            state = sharding.jit_init(tx, params)
            count, mu = state[0].count, state[0].mu
            if not count.sharding.is_equivalent_to(NamedSharding(mesh, P()), 0):
                problems.append(f"{kind} {sd}: count has {count.sharding}")
            if not mu["a_bias"].sharding.is_equivalent_to(NamedSharding(mesh, P()), 1):
                problems.append(f"{kind} {sd}: mu of a_bias has {mu['a_bias'].sharding}")
    default = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    empty = sharding.state_shardings(od.adamw(1e-3), {})
    if empty[0].count != default:
        problems.append(f"no parameters: count has {empty[0].count}")
    only_numpy = sharding.state_shardings(od.adamw(1e-3), {"w": np.ones((4, 4), np.float32)})
    if only_numpy[0].mu["w"] != default:
        problems.append(f"NumPy parameters only: mu has {only_numpy[0].mu['w']}")
    return problems


def check_masks(mesh):
    """jit_init with a pytree decay mask (optax's tree_map_params hands init a placeholder for
    the parameters, which a mask pytree cannot be checked against): every moment on its
    parameter's sharding; also for optax.masked and optax.multi_transform, whose states
    tree_map_params cannot map."""
    problems = []
    params = {
        "w": jax.device_put(jnp.ones((64, 256)), NamedSharding(mesh, P("fsdp"))),
        "b": jax.device_put(jnp.ones((256,)), NamedSharding(mesh, P())),
    }
    mask = {"w": True, "b": False}
    for name, tx in (
        ("adamw", od.adamw(1e-3, mask=mask)),
        ("adam_l2", od.adam_l2(1e-3, weight_decay=0.1, mask=mask)),
        ("lion", od.lion(1e-4, mask=lambda p: {"w": True, "b": False})),
    ):
        try:
            check_moments(tx, sharding.jit_init(tx, params), params, f"{name} mask", problems)
        except ValueError as e:
            problems.append(f"{name}: {e}")
    # optax.masked / optax.multi_transform: their moments are trees of a part of the
    # parameters, which tree_map_params cannot pair with them (matched by key path instead).
    # Expected shardings written out per field, not derived by the same matching.
    fsdp, rep = NamedSharding(mesh, P("fsdp")), NamedSharding(mesh, P())
    for sd in (None, "int8"):
        cases = {
            "masked": (
                optax.masked(od.adamw(1e-3, mask=None, state_dtype=sd), mask),
                lambda s: {"count": s.inner_state[0].count, "mu_w": s.inner_state[0].mu["w"],
                           "nu_w": s.inner_state[0].nu["w"]},
            ),
            "multi_transform": (
                optax.multi_transform(
                    {"x": od.adamw(1e-3, state_dtype=sd), "y": od.lion(1e-4, state_dtype=sd)},
                    {"w": "x", "b": "y"},
                ),
                lambda s: {"count": s.inner_states["x"].inner_state[0].count,
                           "mu_w": s.inner_states["x"].inner_state[0].mu["w"],
                           "nu_w": s.inner_states["x"].inner_state[0].nu["w"],
                           "mu_b": s.inner_states["y"].inner_state[0].mu["b"]},
            ),
        }  # fmt: skip
        for name, (tx, fields) in cases.items():
            label = f"{name} {sd}"
            try:
                state = sharding.jit_init(tx, params)
            except ValueError as e:
                problems.append(f"{label}: {e}")
                continue
            if sd == "int8" and not isinstance(fields(state)["mu_w"], QuantizedArray):
                problems.append(f"{label}: mu of w is not quantized")
            expected = {"count": rep, "mu_w": fsdp, "nu_w": fsdp, "mu_b": rep}
            for when in ("init", "update"):
                if when == "update":
                    updates, state = jax.jit(tx.update)(params, state, params)
                    if not updates["w"].sharding.is_equivalent_to(fsdp, 2):
                        problems.append(f"{label}: update of w has {updates['w'].sharding}")
                for field, leaf in fields(state).items():
                    want = storage.stored_sharding(leaf, expected[field])
                    for x, sh in zip(jax.tree.leaves(leaf), jax.tree.leaves(want), strict=True):
                        if not x.sharding.is_equivalent_to(sh, x.ndim):
                            problems.append(f"{label} {field} ({when}): {x.sharding}, not {sh}")
    return problems


def check_block_placement(codes, param, problems):
    """Each device holds the blocks of its own rows of the parameter (8-bit, whole blocks)."""
    blocks, rows = codes.shape[0] // 8, param.shape[0] // 8
    param_rows = {s.device: s.index[0].start // rows for s in param.addressable_shards}
    for s in codes.addressable_shards:
        if s.index[0].start // blocks != param_rows[s.device]:
            problems.append(f"codes {s.index} on {s.device}, its rows elsewhere")


def same(a, b, ulps=0):
    """Equal leaves, or float leaves at most ``ulps`` units in the last place apart."""

    def close(x, y):
        x, y = np.asarray(x), np.asarray(y)
        if x.shape != y.shape:
            return False
        if not ulps or not np.issubdtype(x.dtype, np.floating):
            return np.array_equal(x, y, equal_nan=True)
        finite = np.isfinite(x) & np.isfinite(y)
        if not np.array_equal(x[~finite], y[~finite], equal_nan=True):
            return False
        return bool(np.all(np.abs(x - y)[finite] <= ulps * np.spacing(np.abs(y[finite]))))

    return all(close(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


#: How far the sharded run may drift from the one-device run in STEPS more steps, relative to
#: the largest parameter. Float32 state: XLA's partitioned and one-device programs round alike
#: (none allowed). bfloat16 and 8-bit state: the one-device program (for 8-bit state, the CPU
#: loop over chunks of blocks) and the partitioned one may contract a multiply-add
#: differently and so round a moment to the neighbouring bfloat16 value or code.
DRIFT = {"bfloat16": 1e-5, "int8": 1e-5}
STEPS = 4


def follow_steps(tx, params, state, host_params, host_updates, host_state, problems):
    """STEPS more steps, sharded and on one device, from the first step's results; the
    gradients depend on the parameters, so differences feed back."""
    step = jax.jit(lambda p, s: _step(tx, p, s))
    host = (jax.jit(optax.apply_updates)(host_params, host_updates), host_state)
    for _ in range(STEPS):
        params, state = step(params, state)
        host = step(*host)
    dtypes = {np.dtype(jnp.result_type(x)) for x in jax.tree.leaves(state)}
    sd = None
    if np.dtype(np.uint8) in dtypes:
        sd = "int8"
    elif np.dtype(jnp.bfloat16) in dtypes:
        sd = "bfloat16"
    scale = max(float(jnp.max(jnp.abs(x))) for x in jax.tree.leaves(host[0]))
    drift = max(
        float(np.max(np.abs(np.asarray(x) - np.asarray(y))))
        for x, y in zip(jax.tree.leaves(params), jax.tree.leaves(host[0]), strict=True)
    )
    if drift > DRIFT.get(sd, 0.0) * scale:
        problems.append(f"after {STEPS + 1} steps the parameters differ by {drift:.3g}")


def _step(tx, params, state):
    grads = jax.tree.map(lambda p: p * 0.5 + 0.01, params)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state


def run_mesh(kind, mesh, state_dtypes, results):
    fsdp, rep = NamedSharding(mesh, P("fsdp")), NamedSharding(mesh, P())
    cols = NamedSharding(mesh, P(None, "fsdp"))
    normal = lambda i, shape: jax.random.normal(jax.random.key(i), shape)  # noqa: E731
    params = {
        # FSDP on the leading axis; int8: 24 blocks of 256, 3 whole blocks per shard.
        "big": {"kernel": jax.device_put(normal(0, (64, 96)), fsdp)},
        # int8: 32 blocks (the last padded), split over the shards but not along their rows.
        "odd": {"kernel": jax.device_put(normal(1, (8, 1000)), fsdp)},
        # Split along the second axis; int8: codes and scales replicated.
        "cols": {"kernel": jax.device_put(normal(2, (96, 64)), cols)},
        "stack": {"kernel": jax.device_put(jnp.ones((16, 8, 8)), fsdp)},  # int8: float32
        "bias": jax.device_put(jnp.ones((96,)), rep),  # replicated
        "A_log": jax.device_put(jnp.zeros((8,)), rep),
    }
    grads = jax.tree.map(lambda p: p * 0.5 + 0.01, params)
    host_params, host_grads = jax.device_get((params, grads))  # the one-device reference
    for name, make in ALIASES.items():
        for sd in state_dtypes:
            tx, problems = make(sd), []
            ref_updates, ref_state = jax.jit(tx.update)(
                host_grads, tx.init(host_params), host_params
            )
            check_moments(tx, tx.init(params), params, "eager init", problems)
            state = sharding.jit_init(tx, params)
            check_moments(tx, state, params, "jit init", problems)
            updates, state = jax.jit(tx.update)(grads, state, params)
            check_moments(tx, state, params, "jit update", problems)
            # 8-bit and bfloat16 state: where the gradient is computed in the step (adam_l2's
            # g + wd p), the one-device and the partitioned programs may contract a
            # multiply-add differently: up to a few ulps.
            ulps = 4 if sd in ("int8", "bfloat16") else 0
            if not same(state, ref_state) or not same(updates, ref_updates, ulps):
                problems.append("state or updates differ from the one-device step")
            for u, p in zip(jax.tree.leaves(updates), jax.tree.leaves(params), strict=True):
                if not u.sharding.is_equivalent_to(p.sharding, u.ndim):
                    problems.append(f"update {u.shape} has {u.sharding}")
            scaling = next(s for s in state if hasattr(s, "mu"))  # a direct look as well
            mu = scaling.mu["big"]["kernel"]
            if isinstance(mu, QuantizedArray):
                check_block_placement(mu.codes, params["big"]["kernel"], problems)
                check_block_placement(mu.absmax, params["big"]["kernel"], problems)
            mu = getattr(mu, "codes", mu)  # int8: the (n_blocks, B) codes split like the param
            if not mu.sharding.is_equivalent_to(fsdp, 2) or mu.sharding.spec[0] != "fsdp":
                problems.append(f"mu of big/kernel has {mu.sharding}")
            new = jax.jit(optax.apply_updates)(params, updates)
            if not all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(new)):  # on host
                problems.append("non-finite parameters")
            follow_steps(tx, new, state, host_params, ref_updates, ref_state, problems)
            results[f"{kind}/{name}/{sd}"] = problems


if __name__ == "__main__":
    main([None if s == "None" else s for s in (sys.argv[1:] or ["None", "bfloat16"])])
