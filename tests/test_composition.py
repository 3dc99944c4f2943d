"""The aliases compose with Optax's wrappers: inject_hyperparams, MultiSteps, apply_if_finite,
chain, jit and vmap. Each wrapper's result is compared with the same computation written out."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from absl.testing import parameterized

import optax_decoupled as od

try:
    from tests import wrapper_checks
except ImportError:  # tests/ itself is on sys.path (pytest's rootdir-less "prepend" import)
    import wrapper_checks

SCHED = optax.warmup_cosine_decay_schedule(0.0, 1e-2, 3, 30)

# Each factory takes (learning_rate, weight_decay) so the same code injects both.
FACTORIES = {
    "adamw": lambda learning_rate, weight_decay: od.adamw(
        learning_rate, weight_decay=weight_decay
    ),
    "adamw_schedule": lambda learning_rate, weight_decay: od.adamw(
        learning_rate, weight_decay=weight_decay, decay_convention="schedule",
        peak_learning_rate=1e-2
    ),
    "adam_l2": lambda learning_rate, weight_decay: od.adam_l2(
        learning_rate, weight_decay=weight_decay
    ),
    "amsgrad": lambda learning_rate, weight_decay: od.amsgrad(
        learning_rate, weight_decay=weight_decay, variant="pytorch"
    ),
    "lion": lambda learning_rate, weight_decay: od.lion(
        learning_rate, weight_decay=weight_decay
    ),
}  # fmt: skip


def make_params():
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    return {
        "dense": {"kernel": jax.random.normal(k1, (4, 3)), "bias": jax.random.normal(k2, (3,))},
        "conv": jax.random.normal(k3, (2, 2, 3)),
    }


def grads_at(t, params):
    """A deterministic gradient sequence that depends on the parameters (a quadratic)."""
    key = jax.random.fold_in(jax.random.key(1), t)
    noise = jax.tree.map(
        lambda p, k: jax.random.normal(k, p.shape), params, _split_like(key, params)
    )
    return jax.tree.map(lambda p, n: p + 0.5 * n, params, noise)


def _split_like(key, tree):
    leaves, treedef = jax.tree.flatten(tree)
    return treedef.unflatten(list(jax.random.split(key, len(leaves))))


def run(tx, steps, params=None, grad_fn=grads_at):
    params = make_params() if params is None else params
    state = tx.init(params)
    for t in range(steps):
        updates, state = tx.update(grad_fn(t, params), state, params)
        params = optax.apply_updates(params, updates)
    return params, state


#: chex's eager variants run in the integration tier (tests/conftest.py): each compiles its
#: operations one by one, and the unit tier keeps every alias's eager path in
#: ``test_jit_equals_eager``, which compares eager and jitted runs.
SLOW_VARIANTS = ("__without_jit",)


class InjectHyperparamsTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.named_parameters((n, n) for n in FACTORIES)
    def test_injected_equals_direct(self, name):
        factory = FACTORIES[name]
        direct = factory(SCHED, 0.05)
        injected = optax.inject_hyperparams(factory)(learning_rate=SCHED, weight_decay=0.05)
        params = make_params()
        sd, si = direct.init(params), injected.init(params)
        pd = pi = params
        upd_d, upd_i = self.variant(direct.update), self.variant(injected.update)
        for t in range(8):
            ud, sd = upd_d(grads_at(t, pd), sd, pd)
            ui, si = upd_i(grads_at(t, pi), si, pi)
            pd, pi = optax.apply_updates(pd, ud), optax.apply_updates(pi, ui)
        chex.assert_trees_all_close(pd, pi, rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(si.hyperparams["learning_rate"], SCHED(7), rtol=1e-6)

    @parameterized.named_parameters((n, n) for n in FACTORIES)
    def test_vmap_over_injected_lr_and_wd(self, name):
        """A batch of (lr, wd) configurations as one vmapped program equals separate runs."""
        factory = FACTORIES[name]
        lrs = jnp.array([1e-3, 3e-3, 1e-2])
        wds = jnp.array([0.0, 0.1, 0.3])
        params0 = make_params()

        def train(lr, wd):
            tx = optax.inject_hyperparams(factory)(learning_rate=lr, weight_decay=wd)
            state = tx.init(params0)

            def body(carry, t):
                params, state = carry
                updates, state = tx.update(grads_at(t, params), state, params)
                return (optax.apply_updates(params, updates), state), None

            (params, _), _ = jax.lax.scan(body, (params0, state), jnp.arange(6))
            return params

        batched = jax.jit(jax.vmap(train))(lrs, wds)
        for i in range(3):
            one = jax.jit(train)(lrs[i], wds[i])
            chex.assert_trees_all_close(jax.tree.map(lambda x: x[i], batched), one, rtol=1e-6)

    def test_mask_is_never_taken_for_a_hyperparameter(self):
        mask = od.decay_mask(exclude="bias")
        tx = optax.inject_hyperparams(od.adamw)(learning_rate=1e-2, weight_decay=0.1, mask=mask)
        state = tx.init(make_params())
        assert set(state.hyperparams) == {
            "learning_rate", "b1", "b2", "eps", "weight_decay", "eps_root",
        }  # fmt: skip
        # A plain callable mask works when declared static, as Optax documents.
        fn_mask = lambda p: jax.tree.map(lambda x: x.ndim > 1, p)
        tx2 = optax.inject_hyperparams(od.adamw, static_args=("mask",))(
            learning_rate=1e-2, weight_decay=0.1, mask=fn_mask
        )
        p1, _ = run(tx, 4)
        p2, _ = run(tx2, 4)
        chex.assert_trees_all_close(p1, p2)

    def test_changing_injected_lr_mid_run(self):
        tx = optax.inject_hyperparams(od.adamw)(learning_rate=1e-2, weight_decay=0.1)
        params = make_params()
        state = tx.init(params)
        updates, state = tx.update(grads_at(0, params), state, params)
        state.hyperparams["learning_rate"] = jnp.asarray(0.0)
        state.hyperparams["weight_decay"] = jnp.asarray(0.0)
        updates, state = tx.update(grads_at(1, params), state, params)
        chex.assert_trees_all_close(updates, jax.tree.map(jnp.zeros_like, updates))


class WrapperTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.named_parameters((n, n) for n in FACTORIES)
    def test_multi_steps_equals_averaged_gradients(self, name):
        k = 3
        inner = FACTORIES[name](SCHED, 0.05)
        multi = optax.MultiSteps(FACTORIES[name](SCHED, 0.05), every_k_schedule=k)
        rounds = wrapper_checks.multi_steps_vs_averaged_gradients(
            multi, inner, make_params(), grads_at, every_k=k,
            update_multi=self.variant(multi.update),
        )  # fmt: skip
        for pm, pi in rounds:
            chex.assert_trees_all_close(pm, pi, rtol=2e-5, atol=1e-6)

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.named_parameters((n, n) for n in FACTORIES)
    def test_apply_if_finite_skips_bad_steps_and_loses_nothing(self, name):
        bad_steps = {1: jnp.nan, 3: jnp.inf}
        guarded = optax.apply_if_finite(FACTORIES[name](SCHED, 0.05), max_consecutive_errors=3)
        plain = FACTORIES[name](SCHED, 0.05)
        params = make_params()
        pg, sg = params, guarded.init(params)
        pp, sp = params, plain.init(params)
        update = self.variant(guarded.update)
        clean_t = 0
        for t in range(6):
            if t in bad_steps:
                g = jax.tree.map(lambda x, v=bad_steps[t]: x.at[(0,) * x.ndim].set(v), pg)
                before = (pg, sg.inner_state)
                u, sg = update(g, sg, pg)
                pg = optax.apply_updates(pg, u)
                chex.assert_trees_all_equal((pg, sg.inner_state), before)
                continue
            u, sg = update(grads_at(clean_t, pg), sg, pg)
            pg = optax.apply_updates(pg, u)
            u, sp = plain.update(grads_at(clean_t, pp), sp, pp)
            pp = optax.apply_updates(pp, u)
            clean_t += 1
        assert int(sg.total_notfinite) == 2
        chex.assert_trees_all_close(pg, pp, rtol=1e-6, atol=1e-7)

    @chex.variants(with_jit=True, without_jit=True)
    def test_chain_after_clipping(self):
        max_norm = 0.5
        tx = optax.chain(optax.clip_by_global_norm(max_norm), od.adamw(SCHED, weight_decay=0.1))
        ref = od.adamw(SCHED, weight_decay=0.1)
        params = make_params()
        p1, s1, p2, s2 = params, tx.init(params), params, ref.init(params)
        update = self.variant(tx.update)
        for t in range(6):
            g = grads_at(t, p1)
            u, s1 = update(g, s1, p1)
            p1 = optax.apply_updates(p1, u)
            norm = optax.tree.norm(g)
            clipped = jax.tree.map(lambda x: x * jnp.minimum(1.0, max_norm / norm), g)
            u, s2 = ref.update(clipped, s2, p2)
            p2 = optax.apply_updates(p2, u)
        chex.assert_trees_all_close(p1, p2, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("name", list(FACTORIES))
def test_jit_equals_eager(name):
    tx = FACTORIES[name](SCHED, 0.05)
    params = make_params()
    se, sj = tx.init(params), tx.init(params)
    pe = pj = params
    update = jax.jit(tx.update)
    for t in range(10):
        u, se = tx.update(grads_at(t, pe), se, pe)
        pe = optax.apply_updates(pe, u)
        u, sj = update(grads_at(t, pj), sj, pj)
        pj = optax.apply_updates(pj, u)
    chex.assert_trees_all_close(pe, pj, rtol=1e-5, atol=1e-6)
    chex.assert_trees_all_equal_structs(se, sj)


@pytest.mark.parametrize("name", list(FACTORIES))
def test_vmap_over_parameter_batches(name):
    """Per-example models: vmap over a leading batch of parameters and gradients."""
    tx = FACTORIES[name](1e-2, 0.1)
    batch = jax.tree.map(lambda x: jnp.stack([x, 2 * x]), make_params())

    def step(params):
        state = tx.init(params)
        updates, state = tx.update(grads_at(0, params), state, params)
        return optax.apply_updates(params, updates)

    out = jax.vmap(step)(batch)
    for i in range(2):
        one = step(jax.tree.map(lambda x: x[i], batch))
        chex.assert_trees_all_close(jax.tree.map(lambda x: x[i], out), one, rtol=1e-6)


def test_weight_decay_schedule_is_read_at_the_step():
    """A scheduled weight decay in each transform is evaluated at the same 0-based step."""
    wd_sched = lambda count: 0.1 * (count + 1)
    params = {"w": jnp.ones((2, 2))}
    zero = jax.tree.map(jnp.zeros_like, params)
    tx = od.decoupled_weight_decay(wd_sched, convention="constant", mask=None)
    l2 = od.add_l2_gradient(wd_sched, mask=None)
    s, s2 = tx.init(params), l2.init(params)
    for t in range(3):
        u, s = tx.update(zero, s, params)
        g, s2 = l2.update(zero, s2, params)
        np.testing.assert_allclose(u["w"], -0.1 * (t + 1), rtol=1e-6)
        np.testing.assert_allclose(g["w"], 0.1 * (t + 1), rtol=1e-6)


# ---------------------------------------------------------------------------------------------
# Flax NNX: nnx.Optimizer
# ---------------------------------------------------------------------------------------------

NNX_FACTORIES = {
    "adamw": lambda sd: od.adamw(1e-2, weight_decay=0.1, state_dtype=sd),
    "adam_l2": lambda sd: od.adam_l2(1e-2, weight_decay=0.1, state_dtype=sd),
    "amsgrad_optax": lambda sd: od.amsgrad(1e-2, weight_decay=0.1, variant="optax", state_dtype=sd),
    "lion": lambda sd: od.lion(1e-3, weight_decay=0.5, state_dtype=sd),
}


def _nnx_model_and_batch(nnx):
    class MLP(nnx.Module):
        def __init__(self, rngs):
            # 64 x 128 = 8,192 elements: 8-bit moments (>= 4096); the rest stay float32.
            self.up, self.down = nnx.Linear(64, 128, rngs=rngs), nnx.Linear(128, 3, rngs=rngs)

        def __call__(self, x):
            return self.down(jax.nn.gelu(self.up(x)))

    x = jax.random.normal(jax.random.key(1), (8, 64))
    y = jax.random.normal(jax.random.key(2), (8, 3))
    return MLP(nnx.Rngs(0)), x, y


@pytest.mark.parametrize(
    ("name", "state_dtype"),
    # Every optimizer with float32 state and every storage with adamw in the unit tier; the
    # rest of the cross (one compiled program pair each) in the integration tier.
    [
        pytest.param(name, sd, marks=() if sd is None or name == "adamw" else pytest.mark.slow)
        for name in NNX_FACTORIES
        for sd in (None, "bfloat16", "int8")
    ],
)
def test_nnx_optimizer_equals_the_optax_loop(name, state_dtype):
    """``nnx.Optimizer(model, tx, wrt=nnx.Param)`` under ``nnx.jit`` takes the same steps as
    ``tx`` on the plain parameter dict, bit for bit. With 8-bit state the second step raised
    AttributeError ('No attribute astype in State'): the optimizer writes its state back
    through ``nnx.state``, which flattens each QuantizedArray into a State of its fields."""
    nnx = pytest.importorskip("flax.nnx")
    model, x, y = _nnx_model_and_batch(nnx)
    tx = NNX_FACTORIES[name](state_dtype)
    params = jax.tree.map(jnp.copy, nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    opt = nnx.Optimizer(model, tx, wrt=nnx.Param)

    def loss(m):
        return jnp.mean((m(x) - y) ** 2)

    @nnx.jit
    def nnx_step(model, opt):
        grads = nnx.grad(loss)(model)
        opt.update(model, grads)

    graphdef = nnx.graphdef(model)

    @jax.jit
    def optax_step(params, state):
        def pure_loss(p):
            return loss(nnx.merge(graphdef, p))

        grads = jax.grad(pure_loss)(params)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    state = tx.init(params)
    for _ in range(4):
        nnx_step(model, opt)
        params, state = optax_step(params, state)
        chex.assert_trees_all_equal(nnx.to_pure_dict(nnx.state(model, nnx.Param)), params)


def test_nnx_optimizer_with_8bit_state_compiles_once_in_state_form():
    """``nnx.Optimizer`` writes 8-bit moments back as ``nnx.State`` of their fields after the
    first step, so a jitted step is traced twice. Putting the state in that form at once
    (``docs/guides/memory.md``, *With Flax NNX*) traces it once, and the steps are the same
    as without it, bit for bit."""
    nnx = pytest.importorskip("flax.nnx")
    traces = {"as built": 0, "state form": 0}
    models = {}
    for form in traces:
        model, x, y = _nnx_model_and_batch(nnx)
        opt = nnx.Optimizer(model, od.adamw(1e-2, state_dtype="int8"), wrt=nnx.Param)
        if form == "state form":
            nnx.update(opt.opt_state, nnx.state(nnx.as_pure(opt.opt_state)))

        @nnx.jit
        def step(model, opt, form=form):
            traces[form] += 1
            grads = nnx.grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
            opt.update(model, grads)

        for _ in range(3):
            step(model, opt)
        models[form] = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    # Flax 0.12 traces the step as built twice; a Flax that kept the form would trace it once.
    assert traces["state form"] == 1 and traces["as built"] in (1, 2)
    chex.assert_trees_all_equal(models["as built"], models["state form"])


@pytest.mark.parametrize("state_dtype", [None, "bfloat16", "int8", "int8, state form"])
def test_nnx_optimizer_checkpoint_resumes_exactly(state_dtype, tmp_path):
    """``nnx.state(model)`` and ``nnx.state(optimizer)`` saved with orbax's
    ``StandardCheckpointer`` after two steps restore into a new model and optimizer (their own
    states as the target), and two more steps from there equal two more steps of the
    uninterrupted run, bit for bit (``docs/guides/memory.md``, *With Flax NNX*). The 8-bit
    state is saved as ``nnx.State``s of codes and scales; the new optimizer's state is
    restored as built, or first put in that form."""
    nnx = pytest.importorskip("flax.nnx")
    ocp = pytest.importorskip("orbax.checkpoint")
    dtype = None if state_dtype is None else state_dtype.split(",")[0]

    def make():
        model, x, y = _nnx_model_and_batch(nnx)
        opt = nnx.Optimizer(model, od.adamw(1e-2, state_dtype=dtype), wrt=nnx.Param)
        if state_dtype == "int8, state form":
            nnx.update(opt.opt_state, nnx.state(nnx.as_pure(opt.opt_state)))
        return model, opt, x, y

    @nnx.jit
    def step(model, opt, x, y):
        grads = nnx.grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
        opt.update(model, grads)

    model, opt, x, y = make()
    for _ in range(2):
        step(model, opt, x, y)
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(tmp_path / "model", nnx.state(model))
    checkpointer.save(tmp_path / "optimizer", nnx.state(opt))
    checkpointer.wait_until_finished()
    for _ in range(2):
        step(model, opt, x, y)

    resumed, resumed_opt, _, _ = make()
    nnx.update(resumed, checkpointer.restore(tmp_path / "model", nnx.state(resumed)))
    nnx.update(resumed_opt, checkpointer.restore(tmp_path / "optimizer", nnx.state(resumed_opt)))
    assert int(resumed_opt.step[...]) == 2
    for _ in range(2):
        step(resumed, resumed_opt, x, y)
    for a, b in ((model, resumed), (opt, resumed_opt)):
        chex.assert_trees_all_equal(nnx.to_pure_dict(nnx.state(a)), nnx.to_pure_dict(nnx.state(b)))
    if dtype == "int8":  # the 8-bit moments were saved and restored as codes and scales
        kernel = nnx.to_pure_dict(nnx.state(resumed_opt))["opt_state"][0]["mu"]["up"]["kernel"]
        assert kernel["codes"].dtype == jnp.uint8
