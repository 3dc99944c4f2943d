"""Run in its own process with 8 simulated CPU devices (see tests/test_reliability.py).

A data-parallel + FSDP training step of the SSM on a 2x4 mesh ``('data', 'fsdp')``: the batch
is split over ``'data'`` (its leading axis), every parameter is split over ``'fsdp'`` along its
first axis whose size 4 divides (the rest are replicated), and the optimizer state takes its
parameter's sharding (``optax_decoupled.contrib.jit_init``). The same pure step, jitted
without any sharding on one device, is the reference. Prints one JSON object: both loss
trajectories, their largest relative difference, the largest parameter difference at the end,
and a list of problems (shardings that were not kept, non-finite values).

Usage: ssm_dp_fsdp.py [ALIAS] [STEPS], ALIAS one of adamw, adam_l2, amsgrad, lion.
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
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import optax_decoupled as od  # noqa: E402
from optax_decoupled._src import sharding  # noqa: E402
from optax_decoupled.experiments import ssm, tasks, training_step  # noqa: E402

ALIASES = {
    "adamw": lambda: od.adamw(1e-2, weight_decay=0.1),
    "adam_l2": lambda: od.adam_l2(1e-2, weight_decay=1e-3),
    "amsgrad": lambda: od.amsgrad(1e-2, weight_decay=0.1),
    "lion": lambda: od.lion(1e-3, weight_decay=0.3),
}
DATA, FSDP = 2, 4


def fsdp_spec(shape):
    """Split the first axis whose size FSDP divides over 'fsdp'; replicate otherwise."""
    for axis, size in enumerate(shape):
        if size % FSDP == 0:
            return P(*([None] * axis), "fsdp")
    return P()


def main(alias: str, steps: int) -> None:
    assert jax.device_count() == 8, jax.devices()
    task = tasks.induction_heads(seq_len=16, vocab_size=8, batch_size=16, num_eval=8)
    config = ssm.SSMConfig(
        d_model=16, n_layers=1, d_state=8, headdim=8, chunk_size=8, **task.model_kwargs()
    )
    graphdef, params0, rest = training_step.init_model(config, 0)
    _, data_key = training_step.seed_keys(0)
    batches = [jax.tree.map(np.asarray, task.train_batch(data_key, s)) for s in range(steps)]
    tx = ALIASES[alias]()

    def step(params, opt_state, batch):
        def loss(p):
            return training_step.loss_fn(p, batch, graphdef=graphdef, rest=rest)[0]

        value, grads = jax.value_and_grad(loss)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    # One device: the reference.
    single = jax.jit(step)
    params, opt_state = params0, tx.init(params0)
    losses_1 = []
    for batch in batches:
        params, opt_state, value = single(params, opt_state, batch)
        losses_1.append(float(value))
    params_1 = params

    # 2x4 mesh: batch over 'data', parameters and moments FSDP over 'fsdp'.
    mesh = Mesh(np.asarray(jax.devices()).reshape(DATA, FSDP), ("data", "fsdp"))
    param_sh = jax.tree.map(lambda p: NamedSharding(mesh, fsdp_spec(p.shape)), params0)
    batch_sh = jax.tree.map(lambda _: NamedSharding(mesh, P("data")), batches[0])
    replicated = NamedSharding(mesh, P())
    params = jax.device_put(params0, param_sh)
    opt_state = sharding.jit_init(tx, params)
    state_sh = sharding.state_shardings(tx, params)
    sharded = jax.jit(
        step,
        in_shardings=(param_sh, state_sh, batch_sh),
        out_shardings=(param_sh, state_sh, replicated),
    )
    problems = []
    losses_8 = []
    for batch in batches:
        batch = jax.device_put(batch, batch_sh)
        params, opt_state, value = sharded(params, opt_state, batch)
        losses_8.append(float(value))

    def check(tree, shardings, label):
        for (path, leaf), sh in zip(
            jax.tree_util.tree_leaves_with_path(tree), jax.tree.leaves(shardings), strict=True
        ):
            if not leaf.sharding.is_equivalent_to(sh, leaf.ndim):
                problems.append(f"{label} {jax.tree_util.keystr(path)}: {leaf.sharding}")
            if not np.isfinite(np.asarray(leaf)).all() and leaf.dtype != jnp.int32:  # on host
                problems.append(f"{label} {jax.tree_util.keystr(path)}: non-finite")

    check(params, param_sh, "params")
    check(opt_state, state_sh, "opt_state")
    n_sharded = sum(1 for s in jax.tree.leaves(param_sh) if s.spec != P())
    if n_sharded == 0:
        problems.append("no parameter is FSDP-sharded")

    l1, l8 = np.asarray(losses_1), np.asarray(losses_8)
    param_diff = max(
        float(np.max(np.abs(np.asarray(a) - np.asarray(b)), initial=0.0))
        for a, b in zip(jax.tree.leaves(params_1), jax.tree.leaves(params), strict=True)
    )
    print(
        json.dumps(
            {
                "alias": alias,
                "losses_1": losses_1,
                "losses_8": losses_8,
                "max_rel_loss_diff": float(np.max(np.abs(l8 - l1) / np.abs(l1))),
                "max_abs_param_diff": param_diff,
                "n_params": len(jax.tree.leaves(param_sh)),
                "n_fsdp_sharded": n_sharded,
                "problems": problems,
            }
        )
    )


if __name__ == "__main__":
    main(
        sys.argv[1] if len(sys.argv) > 1 else "adamw", int(sys.argv[2]) if len(sys.argv) > 2 else 5
    )
