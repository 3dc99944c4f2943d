"""Run in its own process with 8 simulated CPU devices (see tests/test_sharding.py).

For every alias x state dtype: after eager init, jitted init (``sharding.jit_init``) and a
jitted update, every moment has its parameter's sharding, and so has every update. Prints one
JSON object {case: [problems]}.
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
import optax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import optax_decoupled as od  # noqa: E402
from optax_decoupled import sharding  # noqa: E402
from optax_decoupled.quantization import QuantizedArray  # noqa: E402

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
        leaf = getattr(leaf, "codes", leaf)  # int8: codes (n_blocks, B) split like the param
        if not leaf.sharding.is_equivalent_to(sharding_of_param, leaf.ndim):
            problems.append(f"{label}: {leaf.shape} has {leaf.sharding}")
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
    print(json.dumps(results))


def run_mesh(kind, mesh, state_dtypes, results):
    if kind == "explicit":
        # Known limitation: eager int8 init on a mesh with Explicit axes fails in the
        # quantizer's reshape (docs/devices.md); int8 is checked on Auto meshes.
        state_dtypes = [sd for sd in state_dtypes if sd != "int8"]
    fsdp, rep = NamedSharding(mesh, P("fsdp")), NamedSharding(mesh, P())
    params = {
        "big": {"kernel": jax.device_put(jnp.ones((64, 96)), fsdp)},  # FSDP on the leading axis
        "stack": {"kernel": jax.device_put(jnp.ones((16, 8, 8)), fsdp)},
        "bias": jax.device_put(jnp.ones((96,)), rep),  # replicated
        "A_log": jax.device_put(jnp.zeros((8,)), rep),
    }
    grads = jax.tree.map(lambda p: p * 0.5, params)
    for name, make in ALIASES.items():
        for sd in state_dtypes:
            tx, problems = make(sd), []
            check_moments(tx, tx.init(params), params, "eager init", problems)
            state = sharding.jit_init(tx, params)
            check_moments(tx, state, params, "jit init", problems)
            updates, state = jax.jit(tx.update)(grads, state, params)
            check_moments(tx, state, params, "jit update", problems)
            for u, p in zip(jax.tree.leaves(updates), jax.tree.leaves(params), strict=True):
                if not u.sharding.is_equivalent_to(p.sharding, u.ndim):
                    problems.append(f"update {u.shape} has {u.sharding}")
            scaling = next(s for s in state if hasattr(s, "mu"))  # a direct look as well
            mu = scaling.mu["big"]["kernel"]
            mu = getattr(mu, "codes", mu)  # int8: the (n_blocks, B) codes split like the param
            if not mu.sharding.is_equivalent_to(fsdp, 2) or mu.sharding.spec[0] != "fsdp":
                problems.append(f"mu of big/kernel has {mu.sharding}")
            new = jax.jit(optax.apply_updates)(params, updates)
            if not all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(new)):
                problems.append("non-finite parameters")
            results[f"{kind}/{name}/{sd}"] = problems


if __name__ == "__main__":
    main([None if s == "None" else s for s in (sys.argv[1:] or ["None", "bfloat16"])])
