"""PyTorch trajectories (``tests/golden/torch_*.npz``, written by ``tests/golden/make_golden.py``
with torch 2.13.0) replayed through the aliases with ``mask=None``.

Each file records torch's parameters before and after every step, the gradient torch used at
every step (from a small deterministic loss at torch's own parameters) and the learning rate set
by hand before every step (warmup + cosine). The tests feed the recorded gradients to our
optimizer and compare the parameters after every step: rtol 1e-5 in float32 (atol 1e-6; the
parameters are O(1)) and rtol 1e-10 in float64. The float64 NumPy reference is checked against
the same files, so reference and PyTorch vouch for each other. torch is not needed here.
"""

from __future__ import annotations

import functools
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_decoupled as od

try:
    from tests import reference as ref
except ImportError:  # tests/ itself is on sys.path (pytest's rootdir-less "prepend" import)
    import reference as ref

GOLDEN = pathlib.Path(__file__).resolve().parent / "golden"
CASES = ("adam_l2", "adamw", "adamw_amsgrad")
DTYPES = ("float32", "float64")
TOL = {"float32": dict(rtol=1e-5, atol=1e-6), "float64": dict(rtol=1e-10, atol=1e-12)}


def load(case: str, dtype: str):
    """(meta, lrs, params trajectory tree (n+1, ...), grads tree (n, ...))."""
    with np.load(GOLDEN / f"torch_{case}_{dtype}.npz") as data:
        meta = json.loads(str(data["meta"]))
        arrays = {key: data[key] for key in data.files}
    assert meta["case"] == case and meta["dtype"] == dtype, meta
    assert meta["torch_version"].startswith("2.13.0"), meta["torch_version"]

    def tree(prefix):
        out = {}
        for path in meta["shapes"]:
            node = out
            *parents, leaf = path.split("/")
            for key in parents:
                node = node.setdefault(key, {})
            node[leaf] = arrays[f"{prefix}.{path}"]
        return out

    return meta, arrays["lr"], tree("param"), tree("grad")


def schedule_kwargs(meta):
    return {k: v for k, v in meta["schedule"].items() if k != "kind"}


def optax_schedule(meta):
    sched = optax.warmup_cosine_decay_schedule(**schedule_kwargs(meta))
    # Float count: Optax's linear warmup divides an int32 count in float32 even under x64.
    return lambda count: sched(jnp.asarray(count, dtype=float))


def ours_for(case: str, meta, *, via_amsgrad_alias: bool = False):
    kw = meta["optimizer_kwargs"]
    b1, b2 = kw["betas"]
    hp = dict(b1=b1, b2=b2, eps=kw["eps"])
    lr = optax_schedule(meta)
    wd = kw["weight_decay"]
    if case == "adam_l2":
        return od.adam_l2(lr, **hp, weight_decay=wd, mask=None)
    amsgrad = "pytorch" if kw["amsgrad"] else None
    if via_amsgrad_alias:
        return od.amsgrad(lr, **hp, variant=amsgrad, weight_decay=wd, mask=None)
    return od.adamw(lr, **hp, weight_decay=wd, amsgrad=amsgrad, mask=None)


def reference_for(case: str, meta):
    kw = meta["optimizer_kwargs"]
    b1, b2 = kw["betas"]
    lr = ref.warmup_cosine(**schedule_kwargs(meta))
    if case == "adam_l2":
        return ref.AdamL2(lr, b1, b2, kw["eps"], weight_decay=kw["weight_decay"])
    amsgrad = "pytorch" if kw["amsgrad"] else None
    return ref.AdamW(lr, b1, b2, kw["eps"], weight_decay=kw["weight_decay"], amsgrad=amsgrad)


def replay(runs: dict):
    """``runs``: name -> (optimizer, params0, grads tree of (n, ...)); replays the recorded
    gradients through every optimizer in one jitted program. Returns name -> tree of (n, ...)
    arrays, the parameters after each step."""
    names = list(runs)
    opts = [runs[name][0] for name in names]

    @jax.jit
    def run(params, grads):
        def body(carry, g):
            new = []
            for opt, (p, s), g_ in zip(opts, carry, g, strict=True):
                updates, s = opt.update(g_, s, p)
                new.append((optax.apply_updates(p, updates), s))
            return new, [p for p, _ in new]

        init = [(p, opt.init(p)) for opt, p in zip(opts, params, strict=True)]
        return jax.lax.scan(body, init, grads)[1]

    params = [jax.tree.map(jnp.asarray, runs[name][1]) for name in names]
    grads = [jax.tree.map(jnp.asarray, runs[name][2]) for name in names]
    return dict(zip(names, jax.device_get(run(params, grads)), strict=True))


@functools.cache
def replayed(dtype: str):
    """Our aliases (mask=None) on every golden file of ``dtype``, plus od.amsgrad on the
    AdamW(amsgrad=True) file; name -> (recorded params (n+1, ...), our params (n, ...))."""
    runs, recorded = {}, {}
    with jax.enable_x64(dtype == "float64"):
        for case in CASES:
            meta, _, params, grads = load(case, dtype)
            params0 = jax.tree.map(lambda x: x[0], params)
            runs[case] = (ours_for(case, meta), params0, grads)
            recorded[case] = params
        meta, _, params, grads = load("adamw_amsgrad", dtype)
        opt = ours_for("adamw_amsgrad", meta, via_amsgrad_alias=True)
        runs["amsgrad_alias"] = (opt, jax.tree.map(lambda x: x[0], params), grads)
        recorded["amsgrad_alias"] = params
        actual = replay(runs)
    return {name: (recorded[name], actual[name]) for name in runs}


def assert_trajectory_close(actual, expected, dtype: str, what: str) -> None:
    """``actual``/``expected``: trees of (n, ...) arrays; reports the first step that differs."""
    for path, exp in ref.tree_paths(expected):
        act = actual
        for key in path.split("/"):
            act = act[key]
        assert act.shape == exp.shape, (what, path, act.shape, exp.shape)
        bad = ~np.isclose(act, exp, **TOL[dtype])
        step = int(np.argwhere(bad)[0][0]) if bad.any() else 0
        np.testing.assert_allclose(
            act[step], exp[step], **TOL[dtype], err_msg=f"{what}: {path}, after step {step}"
        )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES)
def test_golden_file_is_consistent(case, dtype):
    meta, lrs, params, grads = load(case, dtype)
    n = meta["num_steps"]
    assert n >= 50
    assert len(lrs) == n
    for path, shape in meta["shapes"].items():
        p = params
        g = grads
        for key in path.split("/"):
            p, g = p[key], g[key]
        assert p.shape == (n + 1, *shape) and g.shape == (n, *shape)
        assert p.dtype == np.dtype(dtype) and g.dtype == np.dtype(dtype)
    # the recorded learning rates are the schedule we rebuild (reference and Optax)
    mine = ref.warmup_cosine(**schedule_kwargs(meta))
    np.testing.assert_allclose([mine(k) for k in range(n)], lrs, rtol=1e-14)
    with jax.enable_x64(True):
        sched = optax_schedule(meta)
        np.testing.assert_allclose(np.asarray(sched(jnp.arange(n))), lrs, rtol=1e-14)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES)
def test_alias_matches_torch(case, dtype):
    """od.adam_l2 == torch Adam(weight_decay), od.adamw == torch AdamW (amsgrad="pytorch" ==
    AdamW(amsgrad=True)), with mask=None, on torch's recorded gradients."""
    recorded, actual = replayed(dtype)[case]
    for leaf in jax.tree.leaves(actual):
        assert leaf.dtype == np.dtype(dtype)
    expected = jax.tree.map(lambda x: x[1:], recorded)
    assert_trajectory_close(actual, expected, dtype, f"{case} vs torch ({dtype})")


@pytest.mark.parametrize("dtype", DTYPES)
def test_amsgrad_alias_matches_torch(dtype):
    """od.amsgrad(variant="pytorch", weight_decay=wd) == torch AdamW(amsgrad=True)."""
    recorded, actual = replayed(dtype)["amsgrad_alias"]
    expected = jax.tree.map(lambda x: x[1:], recorded)
    assert_trajectory_close(actual, expected, dtype, f"od.amsgrad vs torch ({dtype})")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES)
def test_reference_matches_torch(case, dtype):
    """The NumPy reference (float64) reproduces torch; float32 files to float32 accuracy."""
    meta, _, params, grads = load(case, dtype)
    n = meta["num_steps"]
    params0 = ref.tree_map(lambda x: x[0], params)
    traj = ref.run(
        reference_for(case, meta), params0, lambda k, _: ref.tree_map(lambda g: g[k], grads), n
    )
    actual = ref.tree_map(lambda *steps: np.stack(steps), *traj[1:])
    expected = ref.tree_map(lambda x: x[1:], params)
    assert_trajectory_close(actual, expected, dtype, f"reference vs {meta['optimizer']}")


def test_golden_cases_differ():
    """The three torch optimizers give visibly different trajectories (the tests can fail)."""
    _, _, base, _ = load("adamw", "float64")
    for other in ("adam_l2", "adamw_amsgrad"):
        _, _, params, _ = load(other, "float64")
        diff = max(
            float(np.max(np.abs(a - b)))
            for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(base), strict=True)
        )
        assert diff > 1e-2, (other, diff)
