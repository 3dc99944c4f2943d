"""Every transform and alias of ``optax_decoupled`` against the float64 NumPy reference.

The reference (``tests/reference.py``) is written from the published formulas and imports
neither jax nor optax; it is itself checked against Optax and PyTorch below and in
``test_torch_golden.py``. Each comparison runs ``NUM_STEPS`` steps on a pytree of mixed shapes
(a (3, 4) matrix, a (5,) vector, a (2, 3, 2) tensor, a scalar), with and without ``jax.jit``
(``chex.variants``), and compares every step: float64 runs (``jax.enable_x64``) to ~1e-10
relative, float32 runs to ~1e-5. The grid covers the 4 decay conventions x the 4 AMSGrad
settings (None, "pytorch", "optax", "paper"), coupled and decoupled decay, and Lion, with
constant and warmup+cosine learning rates and with mask None / "auto" / a pytree / a callable.

Gradients are ``g_k = n_k + COUPLING * theta_k``: a fixed random sequence ``n_k`` (with a
decaying scale, so that AMSGrad's running maximum matters) plus the gradient of a quadratic,
so the trajectory feeds back into the gradients.
"""

from __future__ import annotations

import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from absl.testing import parameterized

import optax_decoupled as od

try:
    from tests import reference as ref
except ImportError:  # tests/ itself is on sys.path (pytest's rootdir-less "prepend" import)
    import reference as ref

NUM_STEPS = 60
COUPLING = 0.5
SHAPES = {
    "dense": {"kernel": (3, 4), "bias": (5,)},
    "conv": {"kernel": (2, 3, 2)},
    "temperature": (),
}
# What mask="auto" must select on SHAPES: ndim >= 2 leaves without bias/scale/norm/embed names.
AUTO_MASK = {
    "dense": {"kernel": True, "bias": False},
    "conv": {"kernel": True},
    "temperature": False,
}
# A user pytree mask that differs from "auto" on every leaf but one.
TREE_MASK = {
    "dense": {"kernel": False, "bias": True},
    "conv": {"kernel": True},
    "temperature": True,
}
# What callable_mask selects.
CALLABLE_MASK = {
    "dense": {"kernel": True, "bias": True},
    "conv": {"kernel": True},
    "temperature": False,
}


def callable_mask(params):
    return jax.tree.map(lambda p: jnp.ndim(p) >= 1, params)


# What od.decay_mask(exclude=r"^conv/") selects: "auto" without the conv kernel.
DECAY_MASK = {
    "dense": {"kernel": True, "bias": False},
    "conv": {"kernel": False},
    "temperature": False,
}

# mask kind -> (argument passed to optax_decoupled, mask the reference applies)
MASKS = {
    "none": (None, None),
    "auto": ("auto", AUTO_MASK),
    "tree": (TREE_MASK, TREE_MASK),
    "callable": (callable_mask, CALLABLE_MASK),
    "decay_mask": (od.decay_mask(exclude=r"^conv/"), DECAY_MASK),
}
MASK_KINDS = ("none", "auto", "tree", "callable")  # rotated through the grid

SCHEDULE = dict(
    init_value=1e-4, peak_value=1e-2, warmup_steps=10, decay_steps=NUM_STEPS, end_value=1e-3
)
CONSTANT_LR = 3e-3
# Decay strengths chosen so that every convention decays ~1e-3 .. 3e-3 per step at the peak.
WEIGHT_DECAY = {"lr": 0.3, "schedule": 3e-3, "constant": 1e-3, "corrected": 0.3}
ADAM_HP = dict(b1=0.9, b2=0.95, eps=1e-6)  # b2 < 0.999 so that AMSGrad's max acts in 60 steps

TOL = {"float64": dict(rtol=1e-10, atol=1e-12), "float32": dict(rtol=1e-5, atol=1e-6)}


# ----------------------------------------------------------------------------- helpers


def build(fn, shapes=SHAPES):
    """Maps ``fn(shape)`` over SHAPES (tuples are leaves here)."""
    if isinstance(shapes, dict):
        return {key: build(fn, sub) for key, sub in shapes.items()}
    return fn(shapes)


def draw_tree(rng: np.random.Generator, dtype: str, scale: float = 1.0):
    """A random tree, rounded to ``dtype`` (so both sides see exactly the same numbers)."""
    return build(lambda s: (scale * rng.standard_normal(s)).astype(dtype).astype(np.float64))


def noise_sequence(seed: int, dtype: str, num_steps: int = NUM_STEPS):
    rng = np.random.default_rng(seed)
    return [draw_tree(rng, dtype, 1.0 + 2.0 * math.exp(-k / 8.0)) for k in range(num_steps)]


def float_count(schedule):
    """Evaluates an Optax schedule at a floating-point count.

    Optax's linear (warmup) schedules compute ``int32 count / steps`` in float32 even under
    ``jax.enable_x64`` (e.g. ``warmup_cosine_decay_schedule(1e-4, ...)(0)`` is 9.999983e-05), which
    would swamp a 1e-10 float64 comparison. A float count gives the schedule in the default float
    dtype (float64 under x64, float32 otherwise).
    """
    return lambda count: schedule(jnp.asarray(count, dtype=float))


def learning_rate(kind: str, scale: float = 1.0):
    """(optax learning rate, reference learning rate, its peak) for "schedule" / "constant"."""
    if kind == "schedule":
        s = {k: (v * scale if "value" in k else v) for k, v in SCHEDULE.items()}
        lr = float_count(optax.warmup_cosine_decay_schedule(**s))
        return lr, ref.warmup_cosine(**s), s["peak_value"]
    return CONSTANT_LR * scale, CONSTANT_LR * scale, CONSTANT_LR * scale


def to_jax(tree, dtype: str):
    return jax.tree.map(lambda x: jnp.asarray(x, dtype=dtype), tree)


def get_path(tree, path: str):
    for key in path.split("/") if path else []:
        tree = tree[key]
    return tree


def mismatch(actual: list, expected: list, dtype: str) -> str | None:
    """First disagreement of two sequences of trees, or None if they agree.

    For trajectories entry k is theta_k (entry 0 the initial params, entry k the params after
    step k - 1 (0-based)); for transform outputs entry k is the output of step k."""
    if len(actual) != len(expected):
        return f"lengths {len(actual)} != {len(expected)}"
    tol = TOL[dtype]
    for path, _ in ref.tree_paths(expected[0]):
        exp = np.stack([np.asarray(get_path(t, path), np.float64) for t in expected])
        act = np.stack([np.asarray(get_path(t, path), np.float64) for t in actual])
        if act.shape != exp.shape:
            return f"leaf {path!r}: shape {act.shape} != {exp.shape}"
        bad = ~np.isclose(act, exp, **tol)
        if bad.any():
            step, *index = (int(i) for i in np.argwhere(bad)[0])
            a, e = act[(step, *index)], exp[(step, *index)]
            err = abs(a - e)
            return (
                f"leaf {path!r}, first bad entry {step} of the sequence, element {tuple(index)}: "
                f"got {float(a)!r}, reference {float(e)!r} (abs err {err:.3e}, "
                f"rel {err / abs(e):.3e}); "
                f"{int(bad[step].sum())}/{bad[step].size} elements off there"
            )
    return None


def check_all(actual: dict, expected: dict, dtype: str) -> None:
    """Compares named trajectories; one AssertionError listing every case that disagrees."""
    assert actual.keys() == expected.keys()
    failures = {name: mismatch(actual[name], expected[name], dtype) for name in expected}
    failures = {name: msg for name, msg in failures.items() if msg is not None}
    if failures:
        lines = [f"{len(failures)}/{len(expected)} cases disagree with the reference ({dtype}):"]
        lines += [f"  {name}: {msg}" for name, msg in failures.items()]
        raise AssertionError("\n".join(lines))


def assert_dtypes(tree, dtype: str) -> None:
    for leaf in jax.tree.leaves(tree):
        assert leaf.dtype == jnp.dtype(dtype), (leaf.dtype, dtype)


def run_ours(variant, opts: dict, params0, noises, dtype: str) -> dict:
    """Runs every optimizer of ``opts`` (name -> optimizer) from ``params0`` on
    g_k = n_k + COUPLING * theta_k, all in one step function (one compilation); returns
    name -> trajectory [theta_0, ..., theta_n] as numpy trees."""
    names = list(opts)
    params = to_jax(params0, dtype)

    def step(params, states, noise):
        new_params, new_states = [], []
        for name, p, s in zip(names, params, states, strict=True):
            grads = jax.tree.map(lambda n, x: n + COUPLING * x, noise, p)
            updates, s = opts[name].update(grads, s, p)
            new_params.append(optax.apply_updates(p, updates))
            new_states.append(s)
        return new_params, new_states

    step = variant(step)
    current = [params] * len(names)
    states = [opts[name].init(params) for name in names]
    trajectory = [current]
    for noise in noises:
        current, states = step(current, states, to_jax(noise, dtype))
        trajectory.append(current)
    assert_dtypes(current, dtype)
    trajectory = jax.device_get(trajectory)
    return {name: [t[i] for t in trajectory] for i, name in enumerate(names)}


def run_reference(opt, params0, noises):
    grad_fn = lambda k, p: ref.tree_map(lambda n, x: n + COUPLING * x, noises[k], p)
    return ref.run(opt, params0, grad_fn, len(noises))


# ----------------------------------------------------------------------------- the alias grid


def make_alias_cases():
    """One case per (alias, convention, AMSGrad variant); lr kind and mask kind rotate."""
    lr_kinds = ("schedule", "constant")
    cases = []
    for a, amsgrad in enumerate(ref.AMSGRAD_VARIANTS):
        for c, conv in enumerate(ref.DECAY_CONVENTIONS):
            lr, mask = lr_kinds[(a + c) % 2], MASK_KINDS[(a + 2 * c + c // 2) % 4]
            cases.append(dict(alias="adamw", amsgrad=amsgrad, conv=conv, lr=lr, mask=mask))
        cases.append(
            dict(
                alias="adam_l2",
                amsgrad=amsgrad,
                lr=lr_kinds[a % 2],
                mask=MASK_KINDS[(a + 1) % 4],
                wd_schedule=a % 2 == 1,
                eps_root=1e-3 if a % 2 == 0 else 0.0,
            )
        )
        if amsgrad is not None:
            conv, lr = ref.DECAY_CONVENTIONS[a], lr_kinds[a % 2]
            mask = "decay_mask" if amsgrad == "optax" else MASK_KINDS[a]
            cases.append(
                dict(alias="amsgrad", amsgrad=amsgrad, coupled=False, conv=conv, lr=lr, mask=mask)
            )
            lr, mask = lr_kinds[(a + 1) % 2], MASK_KINDS[(a + 2) % 4]
            cases.append(dict(alias="amsgrad", amsgrad=amsgrad, coupled=True, lr=lr, mask=mask))
    for c, conv in enumerate(ref.DECAY_CONVENTIONS):
        lr = "constant" if conv == "constant" else "schedule"
        mask = MASK_KINDS[(c + 1) % 4]
        cases.append(dict(alias="lion", conv=conv, lr=lr, mask=mask))
    named = []
    for case in cases:
        name = case["alias"]
        if case["alias"] != "lion":
            name += "_" + (case["amsgrad"] or "adam")
        if "conv" in case:
            name += "_decay-" + case["conv"]
        if case.get("coupled"):
            name += "_coupled"
        name += f"_lr-{case['lr']}_mask-{case['mask']}"
        named.append((name, case))
    return named


ALIAS_CASES = make_alias_cases()


def bundles():
    """The grid in five bundles (one per AMSGrad setting, plus Lion), each run as one program."""
    groups: dict[str, list] = {}
    for name, case in ALIAS_CASES:
        key = "lion" if case["alias"] == "lion" else (case["amsgrad"] or "adam")
        groups.setdefault(key, []).append((name, case))
    return [(key, key, tuple(cases)) for key, cases in groups.items()]


BUNDLES = bundles()
BUNDLE_SEEDS = {"adam": 100, "pytorch": 200, "optax": 300, "paper": 400, "lion": 500}
L2_SCHEDULE = dict(init_value=0.1, end_value=0.01, transition_steps=40)


def l2_weight_decay(case):
    """(optax_decoupled weight decay, reference weight decay) for a coupled case."""
    if case.get("wd_schedule"):
        return float_count(optax.linear_schedule(**L2_SCHEDULE)), ref.linear(**L2_SCHEDULE)
    return 0.05, 0.05


def build_alias(case):
    """(optax_decoupled optimizer, reference optimizer) for one grid case."""
    alias = case["alias"]
    scale = 0.3 if alias == "lion" else 1.0
    lr, ref_lr, peak = learning_rate(case["lr"], scale)
    mask, ref_mask = MASKS[case["mask"]]
    if alias == "lion":
        conv = case["conv"]
        wd = WEIGHT_DECAY[conv]
        kw = dict(decay_convention=conv, mask=mask)
        if conv in ("schedule", "corrected"):
            kw["peak_learning_rate"] = peak
        ours = od.lion(lr, weight_decay=wd, **kw)
        theirs = ref.Lion(
            ref_lr, weight_decay=wd, convention=conv, peak_learning_rate=peak, mask=ref_mask
        )
        return ours, theirs
    eps_root = case.get("eps_root", 0.0)
    coupled = alias == "adam_l2" or (alias == "amsgrad" and case["coupled"])
    if coupled:
        wd, ref_wd = l2_weight_decay(case)
        if alias == "adam_l2":
            ours = od.adam_l2(
                lr,
                **ADAM_HP,
                weight_decay=wd,
                amsgrad=case["amsgrad"],
                mask=mask,
                eps_root=eps_root,
            )
        else:
            ours = od.amsgrad(
                lr,
                **ADAM_HP,
                variant=case["amsgrad"],
                weight_decay=wd,
                coupled=True,
                mask=mask,
                eps_root=eps_root,
            )
        theirs = ref.AdamL2(
            ref_lr,
            **ADAM_HP,
            weight_decay=ref_wd,
            amsgrad=case["amsgrad"],
            eps_root=eps_root,
            mask=ref_mask,
        )
        return ours, theirs
    conv = case["conv"]
    wd = WEIGHT_DECAY[conv]
    kw = dict(decay_convention=conv, mask=mask, eps_root=eps_root)
    if conv in ("schedule", "corrected"):
        kw["peak_learning_rate"] = peak
    if alias == "adamw":
        ours = od.adamw(lr, **ADAM_HP, weight_decay=wd, amsgrad=case["amsgrad"], **kw)
    else:
        ours = od.amsgrad(
            lr, **ADAM_HP, variant=case["amsgrad"], weight_decay=wd, coupled=False, **kw
        )
    theirs = ref.AdamW(
        ref_lr,
        **ADAM_HP,
        weight_decay=wd,
        amsgrad=case["amsgrad"],
        convention=conv,
        peak_learning_rate=peak,
        eps_root=eps_root,
        mask=ref_mask,
    )
    return ours, theirs


class AliasesVsReferenceTest(chex.TestCase):
    """adamw / adam_l2 / amsgrad / lion over the full convention x AMSGrad grid (ALIAS_CASES)."""

    def _check(self, bundle, cases, dtype):
        rng = np.random.default_rng(BUNDLE_SEEDS[bundle])
        params0 = draw_tree(rng, dtype)
        noises = noise_sequence(BUNDLE_SEEDS[bundle] + 1, dtype)
        built = {name: build_alias(case) for name, case in cases}
        with jax.enable_x64(dtype == "float64"):
            ours = {name: opt for name, (opt, _) in built.items()}
            actual = run_ours(self.variant, ours, params0, noises, dtype)
        expected = {name: run_reference(r, params0, noises) for name, (_, r) in built.items()}
        check_all(actual, expected, dtype)

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.named_parameters(*BUNDLES)
    def test_float64(self, bundle, cases):
        self._check(bundle, cases, "float64")

    @chex.variants(with_jit=True)
    @parameterized.named_parameters(*BUNDLES)
    def test_float32(self, bundle, cases):
        self._check(bundle, cases, "float32")


# ----------------------------------------------------------------------------- transforms alone


def run_transforms(variant, txs: dict, inputs, params_seq, dtype: str):
    """Feeds ``inputs[k]`` (and ``params_seq[k]``, or None) to every transform of ``txs``
    (name -> transform) in one step function; returns name -> outputs, name -> final state."""
    names = list(txs)

    def update(x, states, params):
        outs = [txs[n].update(x, s, params) for n, s in zip(names, states, strict=True)]
        return [o[0] for o in outs], [o[1] for o in outs]

    with jax.enable_x64(dtype == "float64"):
        first = to_jax(inputs[0] if params_seq is None else params_seq[0], dtype)
        states = [txs[n].init(first) for n in names]
        update = variant(update)
        outputs = []
        for k, x in enumerate(inputs):
            params = None if params_seq is None else to_jax(params_seq[k], dtype)
            outs, states = update(to_jax(x, dtype), states, params)
            assert_dtypes(outs, dtype)
            outputs.append(outs)
        outputs, states = jax.device_get((outputs, states))
    return (
        {n: [o[i] for o in outputs] for i, n in enumerate(names)},
        dict(zip(names, states, strict=True)),
    )


ADAM_SETTINGS = {
    f"{amsgrad or 'adam'}_eps_root{eps_root:g}": (amsgrad, eps_root)
    for amsgrad in ref.AMSGRAD_VARIANTS
    for eps_root in (0.0, 1e-3)
}
L2_SETTINGS = {
    "wd-constant_mask-none": ("constant", "none"),
    "wd-schedule_mask-auto": ("schedule", "auto"),
    "wd-constant_mask-tree": ("constant", "tree"),
    "wd-schedule_mask-callable": ("schedule", "callable"),
    "wd-constant_mask-decay_mask": ("constant", "decay_mask"),
}


def make_decay_settings():
    """name -> (convention, lr kind, mask kind, weight decay is a schedule)."""
    settings = {}
    for c, conv in enumerate(ref.DECAY_CONVENTIONS):
        for lr_kind in ("schedule", "constant"):
            mask_kind = tuple(MASKS)[(c + 2 * (lr_kind == "schedule")) % 5]
            settings[f"{conv}_lr-{lr_kind}_mask-{mask_kind}"] = (conv, lr_kind, mask_kind, False)
        # the weight decay itself may be a schedule of the step count
        settings[f"{conv}_lr-schedule_wd-schedule"] = (conv, "schedule", "none", True)
    return settings


DECAY_SETTINGS = make_decay_settings()


class TransformsVsReferenceTest(chex.TestCase):
    """scale_by_adam / scale_by_lion / add_l2_gradient / decoupled_weight_decay on their own."""

    # float64 with and without jit; float32 with jit (a float32 eager run costs a few seconds
    # of one-off op compilation and adds nothing the float64 eager run does not test).
    @chex.variants(with_jit=True, without_jit=True)
    def test_scale_by_adam(self):
        self._scale_by_adam("float64")

    @chex.variants(with_jit=True, without_jit=True)
    def test_scale_by_lion(self):
        self._scale_by_lion("float64")

    @chex.variants(with_jit=True, without_jit=True)
    def test_add_l2_gradient(self):
        self._add_l2_gradient("float64")

    @chex.variants(with_jit=True, without_jit=True)
    def test_decoupled_weight_decay(self):
        self._decoupled_weight_decay("float64")

    @chex.variants(with_jit=True)
    @parameterized.parameters(
        "scale_by_adam", "scale_by_lion", "add_l2_gradient", "decoupled_weight_decay"
    )
    def test_float32(self, which):
        getattr(self, "_" + which)("float32")

    def _scale_by_adam(self, dtype):
        grads = noise_sequence(10, dtype)
        hp = dict(b1=0.8, b2=0.9, eps=1e-6)
        txs = {
            name: od.scale_by_adam(**hp, eps_root=eps_root, amsgrad=amsgrad)
            for name, (amsgrad, eps_root) in ADAM_SETTINGS.items()
        }
        outputs, states = run_transforms(self.variant, txs, grads, None, dtype)
        expected, expected_states = {}, {}
        for name, (amsgrad, eps_root) in ADAM_SETTINGS.items():
            ref_state = ref.adam_init(grads[0], amsgrad)
            expected[name] = []
            for g in grads:
                u, ref_state = ref.adam_direction(
                    g, ref_state, **hp, eps_root=eps_root, amsgrad=amsgrad
                )
                expected[name].append(u)
            expected_states[name] = ref_state
        check_all(outputs, expected, dtype)
        # the final state: count, mu, nu and nu_max (raw max, or bias-corrected for "optax")
        for name, (amsgrad, _) in ADAM_SETTINGS.items():
            state, ref_state = states[name], expected_states[name]
            self.assertEqual(int(state.count), NUM_STEPS)
            moments = {"mu": ([state.mu], [ref_state.m]), "nu": ([state.nu], [ref_state.v])}
            if amsgrad is None:
                self.assertFalse(hasattr(state, "nu_max"))  # optax.ScaleByAdamState
            else:
                moments["nu_max"] = ([state.nu_max], [ref_state.v_max])
            check_all(
                {f"{name}.{k}": v[0] for k, v in moments.items()},
                {f"{name}.{k}": v[1] for k, v in moments.items()},
                dtype,
            )

    def _scale_by_lion(self, dtype):
        grads = noise_sequence(11, dtype)
        for g in grads:  # a leaf whose gradient is always 0: sign(0) = 0 must give a 0 update
            g["temperature"] = np.zeros(())
        betas = {"default": (0.9, 0.99), "b1_0.8_b2_0.95": (0.8, 0.95)}
        txs = {name: od.scale_by_lion(b1=b1, b2=b2) for name, (b1, b2) in betas.items()}
        outputs, states = run_transforms(self.variant, txs, grads, None, dtype)
        expected, moments, ref_moments = {}, {}, {}
        for name, (b1, b2) in betas.items():
            ref_state = ref.lion_init(grads[0])
            expected[name] = []
            for g in grads:
                u, ref_state = ref.lion_direction(g, ref_state, b1=b1, b2=b2)
                expected[name].append(u)
            moments[name + ".mu"] = [states[name].mu]
            ref_moments[name + ".mu"] = [ref_state.m]
            self.assertTrue(all(float(o["temperature"]) == 0.0 for o in outputs[name]))
        check_all(outputs, expected, dtype)
        check_all(moments, ref_moments, dtype)

    def _add_l2_gradient(self, dtype):
        grads = noise_sequence(12, dtype)
        params = noise_sequence(13, dtype)
        txs, expected = {}, {}
        for name, (wd_kind, mask_kind) in L2_SETTINGS.items():
            wd, ref_wd = l2_weight_decay(dict(wd_schedule=wd_kind == "schedule"))
            mask, ref_mask = MASKS[mask_kind]
            txs[name] = od.add_l2_gradient(wd, mask=mask)
            ref_wd = ref.as_schedule(ref_wd)
            expected[name] = [
                ref.l2_gradient(g, p, ref_wd(k), ref_mask)
                for k, (g, p) in enumerate(zip(grads, params, strict=True))
            ]
        outputs, _ = run_transforms(self.variant, txs, grads, params, dtype)
        check_all(outputs, expected, dtype)

    def _decoupled_weight_decay(self, dtype):
        updates = noise_sequence(14, dtype)
        params = noise_sequence(15, dtype)
        txs, expected = {}, {}
        for name, (conv, lr_kind, mask_kind, wd_schedule) in DECAY_SETTINGS.items():
            lr, ref_lr, peak = learning_rate(lr_kind)
            mask, ref_mask = MASKS[mask_kind]
            wd = ref_wd = WEIGHT_DECAY[conv]
            if wd_schedule:  # wd * (1 -> 0.1, linearly over 40 steps)
                ramp = dict(init_value=wd, end_value=0.1 * wd, transition_steps=40)
                wd, ref_wd = float_count(optax.linear_schedule(**ramp)), ref.linear(**ramp)
            kw = dict(convention=conv, learning_rate=lr, mask=mask)
            if conv in ("schedule", "corrected"):
                kw["peak_learning_rate"] = peak
            txs[name] = od.decoupled_weight_decay(wd, **kw)
            ref_lr, ref_wd = ref.as_schedule(ref_lr), ref.as_schedule(ref_wd)
            expected[name] = [
                ref.decoupled_decay(
                    u, p, ref.decay_rate(conv, ref_wd(k), ref_lr(k), peak), ref_mask
                )
                for k, (u, p) in enumerate(zip(updates, params, strict=True))
            ]
        outputs, _ = run_transforms(self.variant, txs, updates, params, dtype)
        check_all(outputs, expected, dtype)


# ----------------------------------------------------------------------------- the reference itself


def _ref_trajectory(opt):
    rng = np.random.default_rng(0)
    return run_reference(opt, draw_tree(rng, "float64"), noise_sequence(1, "float64"))


def _max_diff(traj_a, traj_b):
    return max(
        float(np.max(np.abs(get_path(a, path) - get_path(b, path))))
        for a, b in zip(traj_a, traj_b, strict=True)
        for path, _ in ref.tree_paths(a)
    )


class ReferenceItselfTest(parameterized.TestCase):
    """The reference is right, and the test data tells the variants apart (so tests can fail)."""

    def test_warmup_cosine_matches_optax(self):
        with jax.enable_x64(True):
            sched = optax.warmup_cosine_decay_schedule(**SCHEDULE)
            expected = [float(sched(k)) for k in range(NUM_STEPS + 5)]
        mine = ref.warmup_cosine(**SCHEDULE)
        np.testing.assert_allclose([mine(k) for k in range(NUM_STEPS + 5)], expected, rtol=1e-14)

    def test_amsgrad_variants_give_different_trajectories(self):
        _, ref_lr, _ = learning_rate("schedule")
        trajs = {
            v: _ref_trajectory(ref.AdamW(ref_lr, **ADAM_HP, weight_decay=0.3, amsgrad=v))
            for v in ref.AMSGRAD_VARIANTS
        }
        for i, a in enumerate(ref.AMSGRAD_VARIANTS):
            for b in ref.AMSGRAD_VARIANTS[i + 1 :]:
                self.assertGreater(_max_diff(trajs[a], trajs[b]), 1e-3, (a, b))

    def test_decay_conventions_give_different_trajectories(self):
        # For each grid setting (convention Y with its weight decay), applying any other
        # convention's formula with the same numbers must change the trajectory.
        _, ref_lr, peak = learning_rate("schedule")

        def traj(conv, wd):
            opt = ref.AdamW(
                ref_lr, **ADAM_HP, weight_decay=wd, convention=conv, peak_learning_rate=peak
            )
            return _ref_trajectory(opt)

        for y in ref.DECAY_CONVENTIONS:
            right = traj(y, WEIGHT_DECAY[y])
            for x in ref.DECAY_CONVENTIONS:
                if x != y:
                    self.assertGreater(_max_diff(traj(x, WEIGHT_DECAY[y]), right), 1e-3, (x, y))

    def test_masks_give_different_trajectories(self):
        trajs = {
            m: _ref_trajectory(
                ref.AdamW(CONSTANT_LR, **ADAM_HP, weight_decay=0.3, mask=MASKS[m][1])
            )
            for m in MASK_KINDS
        }
        for i, a in enumerate(MASK_KINDS):
            for b in MASK_KINDS[i + 1 :]:
                self.assertGreater(_max_diff(trajs[a], trajs[b]), 1e-5, (a, b))

    def test_constant_gradient_amsgrad_pytorch_and_optax_equal_adam(self):
        # With g_t = g: v_t = (1 - b2^t) g^2 grows and vhat_t = g^2 is constant, so neither max
        # ever binds; the "paper" variant (no bias correction) differs.
        g = {"w": np.array([0.3, -2.0, 5.0])}
        states = {v: ref.adam_init(g, v) for v in ref.AMSGRAD_VARIANTS}
        for _ in range(20):
            us = {}
            for v in ref.AMSGRAD_VARIANTS:
                us[v], states[v] = ref.adam_direction(g, states[v], amsgrad=v)
            np.testing.assert_allclose(us["pytorch"]["w"], us[None]["w"], rtol=1e-14)
            np.testing.assert_allclose(us["optax"]["w"], us[None]["w"], rtol=1e-14)
            # constant gradient: mhat = g and vhat = g^2, so u = g / (|g| + eps)
            np.testing.assert_allclose(us[None]["w"], g["w"] / (np.abs(g["w"]) + 1e-8), rtol=1e-12)
        self.assertGreater(np.max(np.abs(us["paper"]["w"] - us[None]["w"])), 1e-2)

    def test_lion_first_step_is_sign_of_gradient(self):
        g = {"w": np.array([0.3, -2.0, 0.0])}
        u, _ = ref.lion_direction(g, ref.lion_init(g))
        np.testing.assert_array_equal(u["w"], [1.0, -1.0, 0.0])

    def test_decay_rate_relations(self):
        # with lr == peak: "schedule" == "constant" and "corrected" == "lr"
        self.assertAlmostEqual(ref.decay_rate("schedule", 0.1, 3e-3, 3e-3), 0.1, places=15)
        self.assertAlmostEqual(
            ref.decay_rate("corrected", 0.1, 3e-3, 3e-3), ref.decay_rate("lr", 0.1, 3e-3), places=15
        )
        self.assertAlmostEqual(ref.decay_rate("corrected", 0.1, 1e-3, 4e-3), 0.1 * 1e-6 / 4e-3)
        with pytest.raises(ValueError):
            ref.decay_rate("nope", 0.1, 1e-3)

    def test_matches_optax_in_float64(self):
        """The reference agrees with Optax's independent implementation where Optax has one."""
        lr, ref_lr, _ = learning_rate("schedule")
        hp = dict(b1=0.9, b2=0.95, eps=1e-8)
        no_bc = dict(bias_correction_mu=False, bias_correction_nu=False)
        pairs = {
            "adamw": (
                optax.adamw(lr, **hp, weight_decay=0.3),
                ref.AdamW(ref_lr, **hp, weight_decay=0.3),
            ),
            "adam_l2": (
                optax.chain(optax.add_decayed_weights(0.05), optax.adam(lr, **hp)),
                ref.AdamL2(ref_lr, **hp, weight_decay=0.05),
            ),
            "amsgrad_optax": (
                optax.amsgrad(lr, **hp),
                ref.AdamW(ref_lr, **hp, weight_decay=0.0, amsgrad="optax"),
            ),
            "amsgrad_paper": (
                optax.amsgrad(lr, **hp, **no_bc),
                ref.AdamW(ref_lr, **hp, weight_decay=0.0, amsgrad="paper"),
            ),
            "lion": (optax.lion(lr, weight_decay=0.3), ref.Lion(ref_lr, weight_decay=0.3)),
        }
        rng = np.random.default_rng(3)
        params0 = draw_tree(rng, "float64")
        noises = noise_sequence(4, "float64")
        with jax.enable_x64(True):
            opts = {name: opt for name, (opt, _) in pairs.items()}
            actual = run_ours(jax.jit, opts, params0, noises, "float64")
        expected = {name: run_reference(r, params0, noises) for name, (_, r) in pairs.items()}
        check_all(actual, expected, "float64")
