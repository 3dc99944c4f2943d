"""Reliability (issue 8): non-finite gradients lose nothing, numerics over 10^7 steps, and the
trainer's bad inputs and checkpoints. (DP + FSDP training against one device:
``tests/integration/test_multi_device.py``.)

* ``optax.apply_if_finite`` around every alias, for ``state_dtype`` None, ``"bfloat16"`` and
  ``"int8"`` (8-bit block-wise moments): a step with a NaN or an Inf in the gradients leaves the
  parameters and every leaf of the optimizer state bit-identical and is counted; the run then
  continues exactly as if the step had not been there.
* The trainer's ``TrainConfig(skip_nonfinite=True)`` on a real SSM run, and resuming after a
  corrupt checkpoint: ``tests/integration/test_experiments_training.py``.
* 10^7 float32 steps of Reddi et al.'s Theorem-1 problem: no NaN/Inf, and once beta^t underflows
  the bias corrections are exactly 1.
* Checkpoints: a failed or corrupt save leaves the previous checkpoint intact and usable.
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import pathlib
import re
import shutil
import tempfile

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from test_fuzz import Case, doc_rows, table_rows, trigger

try:
    from tests import checkpoint_damage
except ImportError:  # tests/ itself is on sys.path (pytest's rootdir-less "prepend" import)
    import checkpoint_damage

import optax_decoupled as od
from optax_decoupled.experiments import (
    checkpoints,
    ssm,
    tasks,
)
from optax_decoupled.experiments import train as train_lib

# ---------------------------------------------------------------------------------------------
# The recipe: optax.apply_if_finite around every alias.
# ---------------------------------------------------------------------------------------------

SCHED = optax.warmup_cosine_decay_schedule(0.0, 1e-2, 2, 20)
ALIASES = {
    "adamw_schedule": lambda sd: od.adamw(
        SCHED, weight_decay=0.1, decay_convention="schedule", peak_learning_rate=1e-2,
        state_dtype=sd,
    ),
    "adam_l2": lambda sd: od.adam_l2(SCHED, weight_decay=1e-3, state_dtype=sd),
    "amsgrad_pytorch": lambda sd: od.amsgrad(SCHED, weight_decay=0.1, state_dtype=sd),
    "amsgrad_optax_coupled": lambda sd: od.amsgrad(
        SCHED, variant="optax", coupled=True, weight_decay=1e-3, state_dtype=sd
    ),
    "amsgrad_paper": lambda sd: od.amsgrad(1e-2, variant="paper", state_dtype=sd),
    "lion": lambda sd: od.lion(SCHED, weight_decay=0.3, state_dtype=sd),
}  # fmt: skip
# "int8" quantizes leaves of >= 4096 elements (the 64x64 kernel); the others stay float32.
STATE_DTYPES = {
    "param": None,
    "bfloat16": "bfloat16",
    # seeded by the step count, which a skipped step does not advance
    "bfloat16-stochastic": od.FloatStorage(jnp.bfloat16, "bfloat16", rounding="stochastic"),
    "int8": "int8",
}
BAD_STEPS = {1: np.nan, 3: np.inf, 4: -np.inf}  # 3 and 4 are consecutive
MAX_ERRORS = 3


def _params():
    k1, k2 = jax.random.split(jax.random.key(0))
    return {
        "dense": {"kernel": jax.random.normal(k1, (64, 64)), "bias": jnp.full((64,), 0.5)},
        "A_log": jax.random.normal(k2, (4,)),
        "scale": jnp.asarray(2.0),
    }


def _grads(t, params):
    """A deterministic gradient that depends on the parameters (a noisy quadratic)."""
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.fold_in(jax.random.key(1), t), len(leaves))
    noise = [jax.random.normal(k, jnp.shape(x)) for k, x in zip(keys, leaves, strict=True)]
    return treedef.unflatten([x + 0.5 * n for x, n in zip(leaves, noise, strict=True)])


def _poison(grads, value, t):
    """Put ``value`` into one element of every leaf (the step-3 case: into all of them)."""
    if t == 3:
        return jax.tree.map(lambda g: jnp.full_like(g, value), grads)
    return jax.tree.map(lambda g: g.at[(0,) * g.ndim].set(value), grads)


# tests/test_composition.py covers apply_if_finite with the parameters' own dtype for adamw
# (both conventions), adam_l2, amsgrad ("pytorch") and lion; here every alias gets bfloat16 and
# 8-bit moments, and the AMSGrad conventions not covered there the parameters' dtype too. The
# unit tier runs every alias with 8-bit moments and every storage with two aliases (one Adam,
# one AMSGrad); the rest of the cross, one compiled program each, runs in the integration tier.
_UNIT_ALIASES = ("adamw_schedule", "amsgrad_pytorch")
RECIPE_CASES = [
    pytest.param(
        alias,
        sd,
        marks=() if sd in ("int8", "param") or alias in _UNIT_ALIASES else pytest.mark.slow,
    )
    for alias in ALIASES
    for sd in STATE_DTYPES
    if sd != "param" or alias in ("amsgrad_optax_coupled", "amsgrad_paper")
]


@pytest.mark.parametrize(("alias", "state_dtype"), RECIPE_CASES)
def test_nonfinite_step_changes_nothing_and_is_counted(alias, state_dtype):
    sd = STATE_DTYPES[state_dtype]
    tx = optax.apply_if_finite(ALIASES[alias](sd), max_consecutive_errors=MAX_ERRORS)
    update = jax.jit(tx.update)
    params0 = _params()
    state0 = tx.init(params0)
    if state_dtype == "int8":  # the 8-bit moments really are quantized
        leaves = jax.tree.leaves(state0)
        assert any(x.dtype == jnp.uint8 for x in leaves), alias

    # Guarded run with bad steps, and the same program fed only the clean steps.
    p, s = params0, state0
    clean_p, clean_s = params0, state0
    clean_t = 0
    expected_total = expected_streak = 0
    for t in range(7):
        if t in BAD_STEPS:
            before = (p, s.inner_state)
            g = _poison(_grads(clean_t, p), BAD_STEPS[t], t)
            u, s = update(g, s, p)
            p = optax.apply_updates(p, u)
            expected_total += 1
            expected_streak += 1
            chex.assert_trees_all_equal((p, s.inner_state), before)  # bit-identical
            assert int(s.notfinite_count) == expected_streak
            assert int(s.total_notfinite) == expected_total
            assert not bool(s.last_finite)
            continue
        u, s = update(_grads(clean_t, p), s, p)
        p = optax.apply_updates(p, u)
        expected_streak = 0
        assert int(s.notfinite_count) == 0 and bool(s.last_finite)
        u, clean_s = update(_grads(clean_t, clean_p), clean_s, clean_p)
        clean_p = optax.apply_updates(clean_p, u)
        clean_t += 1
    assert int(s.total_notfinite) == len(BAD_STEPS)
    chex.assert_tree_all_finite(p)
    # Training continued exactly as if the bad steps had not been there.
    chex.assert_trees_all_equal(p, clean_p)
    chex.assert_trees_all_equal(s.inner_state, clean_s.inner_state)
    chex.assert_trees_all_equal_dtypes(s, state0)


def test_docs_recipe_runs():
    """The recipe's code block in docs/bad_input.md runs and its assertions hold."""
    text = (pathlib.Path(__file__).parent.parent / "docs" / "bad_input.md").read_text("utf-8")
    blocks = re.findall(r"^```python[ \t]*\n(.*?)^```[ \t]*$", text, re.DOTALL | re.MULTILINE)
    assert blocks
    for block in blocks:
        exec(compile(block, "docs/bad_input.md", "exec"), {})


def test_too_many_consecutive_nonfinite_steps_are_applied():
    """apply_if_finite gives up after max_consecutive_errors bad steps in a row: the next bad
    update reaches the parameters (a diverged run does not silently stand still)."""
    tx = optax.apply_if_finite(od.adamw(1e-3, mask=None), max_consecutive_errors=1)
    params = {"w": jnp.ones((2, 2))}
    state = tx.init(params)
    bad = {"w": jnp.full((2, 2), jnp.nan)}
    u, state = tx.update(bad, state, params)
    assert bool(jnp.all(u["w"] == 0))
    u, state = tx.update(bad, state, params)  # the second in a row: applied
    assert bool(jnp.all(jnp.isnan(u["w"]))) and int(state.total_notfinite) == 2


TREE = {"a": np.arange(3.0, dtype=np.float32), "b": {"c": np.ones((2, 2), np.int32)}}


def test_failed_save_leaves_previous_checkpoint_intact(tmp_path):
    """A save that fails part-way (here: a leaf orbax cannot write) leaves only a temporary
    directory behind; the previous checkpoint is still the latest and restores bit-identically,
    even with max_to_keep=1, and a later save succeeds."""
    checkpoints.save_checkpoint(tmp_path, 1, TREE, {"n": 1}, max_to_keep=1)
    with pytest.raises(ValueError, match="Unsupported type"):
        checkpoints.save_checkpoint(tmp_path, 2, {"a": object()}, {"n": 2}, max_to_keep=1)
    assert checkpoints.latest_checkpoint_step(tmp_path) == 1
    restored, meta, step = checkpoints.restore_checkpoint(tmp_path, TREE)
    assert step == 1 and meta == {"n": 1}
    jax.tree.map(np.testing.assert_array_equal, restored, TREE)
    checkpoints.save_checkpoint(tmp_path, 2, TREE, {"n": 2}, max_to_keep=1)
    assert checkpoints.latest_checkpoint_step(tmp_path) == 2


def test_corrupt_checkpoint_leaves_previous_intact(tmp_path):
    checkpoints.save_checkpoint(tmp_path, 1, TREE, {"n": 1}, max_to_keep=2)
    later = jax.tree.map(lambda x: x + 1, TREE)
    checkpoints.save_checkpoint(tmp_path, 2, later, {"n": 2}, max_to_keep=2)
    checkpoint_damage.corrupt(tmp_path / "2")
    with pytest.raises(checkpoints.CheckpointError, match="corrupt"):
        checkpoints.restore_checkpoint(tmp_path, TREE)
    restored, meta, step = checkpoints.restore_checkpoint(tmp_path, TREE, step=1)
    assert step == 1 and meta == {"n": 1}
    jax.tree.map(np.testing.assert_array_equal, restored, TREE)


# ---------------------------------------------------------------------------------------------
# 10^7 float32 steps (the Reddi experiment's simulation over them:
# tests/integration/test_experiments_training.py).
# ---------------------------------------------------------------------------------------------

LONG = 10**7


def _theorem1_adam(amsgrad, steps):
    """``steps`` updates of scale_by_adam(0.9, 0.999) on Theorem 1's gradients, in one loop;
    also whether every update and moment stayed finite."""
    tx = od.scale_by_adam(0.9, 0.999, 1e-8, amsgrad=amsgrad)

    def body(i, carry):
        state, ok = carry
        g = jnp.where((i + 1) % 3 == 1, jnp.float32(3.0), jnp.float32(-1.0))
        u, state = tx.update(g, state)
        finite = [jnp.isfinite(x) for x in (u, *jax.tree.leaves(state)) if x.dtype != jnp.int32]
        return state, ok & jnp.all(jnp.stack(finite))

    return jax.lax.fori_loop(0, steps, body, (tx.init(jnp.zeros((), jnp.float32)), True))


@jax.jit
def _uncorrected(mu, nu):
    return mu / (jnp.sqrt(nu) + jnp.float32(1e-8))


@pytest.mark.parametrize("amsgrad", [None, "pytorch", "optax", "paper"])
def test_bias_corrections_are_exactly_one_after_beta_underflows(amsgrad):
    """After 10^7 float32 steps (b2^t underflowed to 0 near t = 87 000, 1 - b2^t rounded to
    exactly 1 from t = 17 321) the update is exactly the uncorrected mu / (sqrt(nu) + eps),
    bit for bit; after 10 steps it is not (except for the paper's AMSGrad, never corrected)."""
    tx = od.scale_by_adam(0.9, 0.999, 1e-8, amsgrad=amsgrad)
    run = jax.jit(_theorem1_adam, static_argnums=(0, 1))
    for steps, corrected in ((10, amsgrad != "paper"), (LONG, False)):
        state, ok = run(amsgrad, steps)
        assert bool(ok) and int(state.count) == steps
        u, new = jax.jit(tx.update)(jnp.float32(-1.0), state)
        nu = new.nu if amsgrad is None else new.nu_max
        # The uncorrected formula on the same backend: GPUs' float32 sqrt and division need
        # not round like NumPy's, so only the corrections (exactly 1 or not) may differ.
        uncorrected = np.float32(_uncorrected(new.mu, nu))
        assert (np.float32(u) == uncorrected) != corrected, (steps, np.float32(u), uncorrected)
        assert np.isfinite(np.float32(u))
    # The corrections themselves, as the transform computes them (count an int32).
    t = jnp.arange(1, 200_001, dtype=jnp.int32)
    bc2 = 1 - 0.999**t
    assert int(jnp.argmax(bc2 == 1.0)) + 1 == 17_321 and bool(jnp.all(bc2[17_320:] == 1.0))
    count = jnp.int32(LONG)
    assert float(0.999**count) == 0.0 and float(0.9**count) == 0.0
    assert float(1 - 0.999**count) == 1.0 and float(1 - 0.9**count) == 1.0


# ---------------------------------------------------------------------------------------------
# The trainer's bad inputs (the second table of docs/bad_input.md).
# ---------------------------------------------------------------------------------------------


_TMP = tempfile.mkdtemp(prefix="optax-decoupled-bad-input-")
atexit.register(shutil.rmtree, _TMP, True)


@functools.cache
def _tiny():
    task = tasks.induction_heads(seq_len=8, vocab_size=6, batch_size=4, num_eval=4)
    config = ssm.SSMConfig(d_model=8, headdim=8, chunk_size=8, **task.model_kwargs())
    return task, config


def _saved(corrupt: bool = False) -> str:
    directory = tempfile.mkdtemp(dir=_TMP)
    checkpoints.save_checkpoint(directory, 3, TREE, {"n": 3})
    if corrupt:
        checkpoint_damage.corrupt(pathlib.Path(directory) / "3")
    return directory


TRAINER_CASES: dict[str, Case] = {
    "train-config": Case(
        "`TrainConfig` with `steps`, `eval_every` or `eval_batch_size` < 1",
        lambda: train_lib.TrainConfig(steps=0),
    ),
    "max-consecutive-nonfinite": Case(
        "`TrainConfig(max_consecutive_nonfinite=...)` < 0",
        lambda: train_lib.TrainConfig(skip_nonfinite=True, max_consecutive_nonfinite=-1),
    ),
    "config-chunk": Case(
        '`TrainConfig(config_chunk=...)` not `None`, `"auto"` or an int >= 1',
        lambda: train_lib.TrainConfig(config_chunk=0),
    ),
    "model-config-mismatch": Case(
        "a model config whose inputs/head do not fit the task",
        lambda: train_lib.train_grid(
            _tiny()[0], dataclasses.replace(_tiny()[1], vocab_size=5), optax.sgd(0.1)
        ),
    ),
    "grid-sizes": Case(
        "hyperparameter arrays and seeds of different lengths",
        lambda: train_lib.train_grid(
            *_tiny(), optax.sgd(0.1), {"learning_rate": [0.1, 0.2]}, seeds=[0, 1, 2]
        ),
    ),
    "resume-without-dir": Case(
        "`resume`, `stop_at` or `checkpoint_every` without a `checkpoint_dir`",
        lambda: train_lib.train_grid(*_tiny(), optax.sgd(0.1), resume=True),
    ),
    "missing-checkpoint-dir": Case(
        "resuming from a directory that does not exist",
        lambda: checkpoints.restore_checkpoint(tempfile.mkdtemp(dir=_TMP) + "/nowhere", TREE),
        FileNotFoundError,
    ),
    "empty-checkpoint-dir": Case(
        "resuming from a directory without checkpoints",
        lambda: checkpoints.restore_checkpoint(tempfile.mkdtemp(dir=_TMP), TREE),
        FileNotFoundError,
    ),
    "missing-checkpoint-step": Case(
        "restoring a step that was not saved",
        lambda: checkpoints.restore_checkpoint(_saved(), TREE, step=4),
        FileNotFoundError,
    ),
    "corrupt-checkpoint": Case(
        "a corrupt checkpoint (damaged files); the previous checkpoint stays intact",
        lambda: checkpoints.restore_checkpoint(_saved(corrupt=True), TREE),
        checkpoints.CheckpointError,
    ),
    "incompatible-checkpoint": Case(
        "a checkpoint of another state structure",
        lambda: checkpoints.restore_checkpoint(_saved(), {"a": TREE["a"]}),
        checkpoints.CheckpointError,
    ),
    "incompatible-checkpoint-shape": Case(
        "a checkpoint with other array shapes",
        lambda: checkpoints.restore_checkpoint(_saved(), {**TREE, "a": np.zeros(4, np.float32)}),
        checkpoints.CheckpointError,
    ),
    "failed-save": Case(
        "a save that fails part-way (here: a leaf orbax cannot write); the previous "
        "checkpoint stays the latest",
        lambda: checkpoints.save_checkpoint(_saved(), 4, {"a": object()}, {}),
    ),
}


@pytest.mark.parametrize("name", list(TRAINER_CASES))
def test_trainer_bad_input(name):
    err = trigger(TRAINER_CASES[name])
    assert str(err), name


def test_trainer_docs_table_is_current():
    expected = dict(
        zip(
            TRAINER_CASES,
            table_rows(TRAINER_CASES, "test_reliability.py", "test_trainer_bad_input"),
            strict=True,
        )
    )
    assert doc_rows("test_reliability.py") == expected, (
        "regenerate with: python tests/test_reliability.py"
    )


if __name__ == "__main__":  # print the trainer rows of docs/bad_input.md
    print("\n".join(table_rows(TRAINER_CASES, "test_reliability.py", "test_trainer_bad_input")))
