"""The experiments' trainer and simulations run whole: a tiny SSM's loss falls on each task,
optax_decoupled.adamw trains in a grid with the mask written out by hand, NaN/Inf injected
into an SSM run with ``skip_nonfinite=True`` ends as a run without those steps (and resumes
after a corrupt checkpoint), and the Reddi simulation over 10^7 float32 steps. (The trainer's
contracts on a smaller scale -- a grid equals its runs, resume is bit-identical, checkpoints
survive failed saves -- are unit tests: tests/test_train.py, tests/test_reliability.py.)"""

import dataclasses
import functools
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

try:
    from tests import checkpoint_damage
except ImportError:  # tests/ itself is on sys.path (pytest's rootdir-less "prepend" import)
    import checkpoint_damage

import optax_decoupled as od
from optax_decoupled.experiments import (
    checkpoints,
    reddi_problems,
    reddi_simulation,
    schedules,
    ssm,
    tasks,
    train_results,
    training_step,
)
from optax_decoupled.experiments import train as train_lib

TINY = dict(d_model=16, n_layers=1, d_state=8, headdim=8, chunk_size=8)


@pytest.mark.parametrize(
    "task_fn, steps",
    [
        (
            lambda: tasks.selective_copying(
                seq_len=12, num_tokens=2, vocab_size=8, batch_size=32, num_eval=8
            ),
            30,
        ),
        (lambda: tasks.induction_heads(seq_len=16, vocab_size=8, batch_size=32, num_eval=8), 30),
        (lambda: tasks.sequential_digits(batch_size=32), 30),
    ],
    ids=["selective_copying", "induction_heads", "sequential_digits"],
)
def test_tiny_model_loss_decreases(task_fn, steps):
    task = task_fn()
    config = ssm.SSMConfig(**TINY, **task.model_kwargs())
    result = train_lib.train(
        task,
        config,
        optax.adam(1e-2),
        config=train_lib.TrainConfig(
            steps=steps, eval_every=steps, eval_splits=(), final_splits=(), progress=False
        ),
        keep_params=False,
    )
    loss = result.train_loss
    assert np.all(np.isfinite(loss))
    first, last = loss[:3].mean(), loss[-5:].mean()
    assert last < first - 0.05, (first, last)


def test_optax_decoupled_adamw_plugs_in():
    """optax_decoupled.adamw(mask="auto") trains in the grid, and its mask on the SSM's
    parameters is the one written out by hand: decay only the >= 2-D kernels, never A_log, D,
    dt_bias, norm scales, biases or the embedding."""
    task = tasks.induction_heads(seq_len=16, vocab_size=8, batch_size=16, num_eval=64)
    model_config = ssm.SSMConfig(
        d_model=16, n_layers=1, d_state=8, headdim=8, chunk_size=8, **task.model_kwargs()
    )
    _, params, _ = training_step.init_model(model_config, 0)
    by_hand = jax.tree_util.tree_map_with_path(lambda path, _: path[-1].key == "kernel", params)
    assert od.resolve_mask("auto", params) == by_hand

    steps = 6
    loop = train_lib.TrainConfig(
        steps=steps, eval_every=steps, eval_splits=(), final_splits=(), progress=False
    )
    make_tx = schedules.scheduled(
        od.adamw, total_steps=steps, warmup_steps=1, clip_norm=1.0, mask="auto"
    )
    hp = {"learning_rate": [1e-2, 1e-2], "weight_decay": [0.0, 0.5]}
    result = train_lib.train_grid(task, model_config, make_tx, hp, 0, loop)
    no_decay, decay = result.runs
    assert np.all(np.isfinite(no_decay.train_loss)) and np.all(np.isfinite(decay.train_loss))
    # Same seed, same data: the first step (taken before any decay acts on the loss) agrees.
    assert no_decay.train_loss[0] == decay.train_loss[0]
    # Decay shrinks the decayed kernels relative to the undecayed run.
    k0 = no_decay.params["layers"][0]["mixer"]["in_proj"]["kernel"]
    k1 = decay.params["layers"][0]["mixer"]["in_proj"]["kernel"]
    assert np.linalg.norm(k1) < np.linalg.norm(k0)


LONG = 10**7


def test_reddi_theorem1_ten_million_float32_steps():
    """Every optimizer of the Reddi experiment, Theorem-1 problem, 10^7 float32 steps: finite
    throughout, iterates in [-1, 1], and the paper's outcome (Adam with beta1 = 0,
    beta2 = 0.1 at +1, AMSGrad at the optimum -1)."""
    runs = [
        reddi_simulation.Run(opt, alpha=0.5, b1=b1, b2=b2)
        for opt in reddi_simulation.OPTIMIZERS
        for b1, b2 in ((0.0, 0.1), (0.9, 0.999))
    ]
    res = reddi_simulation.simulate(reddi_problems.theorem1_problem(), runs, LONG)
    assert res.record_t[-1] == LONG
    for name in ("x", "avg_regret", "x_final", "avg_regret_final", "x_tail_mean"):
        assert np.all(np.isfinite(getattr(res, name))), name
    assert np.all(np.abs(res.x) <= 1.0)
    final = {(r.optimizer, r.b1): x for r, x in zip(runs, res.x_final, strict=True)}
    assert final[("adam", 0.0)] > 0.99
    for variant in ("amsgrad_paper", "amsgrad_pytorch", "amsgrad_optax"):
        assert final[(variant, 0.0)] < -0.999 and final[(variant, 0.9)] < -0.999


# ---------------------------------------------------------------------------------------------
# The trainer's option, with NaN/Inf injected into a real SSM run.
# ---------------------------------------------------------------------------------------------

STEPS = 10
INJECT = {3: np.nan, 6: np.inf}  # trainer steps whose inputs are multiplied by NaN / Inf
KEPT = [s for s in range(STEPS) if s not in INJECT]
HP = {"learning_rate": [3e-3, 1e-2], "weight_decay": [0.1, 0.0]}
SEEDS = [0, 1]


def _remapped(base: tasks.Task, index, scale, name: str) -> tasks.Task:
    """``base`` whose trainer step ``s`` gets batch ``index[s]`` with inputs times ``scale[s]``.

    The same code for both runs (only the two constant tables differ), so both compile to the
    same computation; multiplying by 1.0 is exact.
    """
    index = jnp.asarray(index, jnp.int32)
    scale = jnp.asarray(scale, jnp.float32)

    def train_batch(key, step):
        batch = base.train_batch(key, index[step])
        return {**batch, "inputs": batch["inputs"] * scale[step]}

    return dataclasses.replace(base, name=name, train_batch=train_batch)


@pytest.fixture(scope="module")
def nonfinite_setup():
    base = tasks.sequential_digits(batch_size=16)
    config = ssm.SSMConfig(
        d_model=16, n_layers=1, d_state=8, headdim=8, chunk_size=16, **base.model_kwargs()
    )
    scale = np.ones(STEPS, np.float32)
    for s, v in INJECT.items():
        scale[s] = v
    injected = _remapped(base, np.arange(STEPS), scale, "digits+nonfinite")
    absent = _remapped(base, KEPT, np.ones(len(KEPT)), "digits-without-those-steps")
    # One make_tx: the schedule's length is the number of *applied* updates in both runs.
    make_tx = schedules.scheduled(od.adamw, total_steps=len(KEPT), warmup_steps=2, clip_norm=1.0)
    loop = train_lib.TrainConfig(
        steps=STEPS, eval_every=5, eval_splits=(), final_splits=(), progress=False,
        skip_nonfinite=True,
    )  # fmt: skip
    return config, injected, absent, make_tx, loop


@pytest.fixture(scope="module")
def absent_run(nonfinite_setup):
    config, _, absent, make_tx, loop = nonfinite_setup
    loop = dataclasses.replace(loop, steps=len(KEPT))
    return train_lib.train_grid(absent, config, make_tx, HP, SEEDS, loop)


def test_injected_nonfinite_steps_are_absent_steps(nonfinite_setup, absent_run, tmp_path):
    """NaN/Inf inputs at trainer steps 3 and 6 of 10 (so NaN/Inf gradients) with
    ``skip_nonfinite=True`` end bit-identical to an 8-step run without those two steps.

    What the comparison holds fixed: (1) the data -- the sequential-digits sampler is a pure
    function of (data key, step), and the 8-step run's step ``j`` draws the batch of the
    injected run's ``j``-th clean step; (2) the optimizer's own step count, hence the warmup +
    cosine schedule and Adam's bias corrections -- ``apply_if_finite`` does not advance the
    inner state on a skipped step, so at the ``j``-th clean step both runs' inner count is
    ``j``; the schedule is built for the 8 applied updates in both runs; (3) the model init
    (same seeds). The trainer's own step counter differs (10 vs 8); it only selects data.
    """
    config, injected, _, make_tx, loop = nonfinite_setup
    metrics = tmp_path / "metrics.jsonl"
    result = train_lib.train_grid(injected, config, make_tx, HP, SEEDS, loop, metrics_path=metrics)
    for run, ref in zip(result.runs, absent_run.runs, strict=True):
        assert run.skipped_steps == len(INJECT) and ref.skipped_steps == 0
        bad = sorted(INJECT)
        assert not np.any(np.isfinite(run.grad_norm[bad]))  # the gradients were non-finite
        assert np.all(np.isfinite(run.grad_norm[KEPT])) and np.all(
            np.isfinite(run.train_loss[KEPT])
        )
        np.testing.assert_array_equal(run.train_loss[KEPT], ref.train_loss)
        np.testing.assert_array_equal(run.grad_norm[KEPT], ref.grad_norm)
        jax.tree.map(np.testing.assert_array_equal, run.params, ref.params)
        assert [e["skipped_steps"] for e in run.evals] == [1, 2]
    records = train_results.read_jsonl(metrics)
    assert [r["skipped_steps"] for r in records if r["event"] == "final"] == [2, 2]
    assert [r["skipped_steps"] for r in records if r["event"] == "eval"] == [1, 1, 2, 2]
    # An eval record's train_loss is the mean of its window's finite losses (the skipped
    # steps' NaN/Inf losses left out; it was NaN): steps 1-5 and 6-10, without 3 and 6.
    for r in (r for r in records if r["event"] == "eval"):
        losses = result.runs[r["run"]].train_loss[r["step"] - 5 : r["step"]]
        assert not np.isfinite(losses).all()  # each window holds one skipped step's loss
        assert r["train_loss"] == pytest.approx(np.mean(losses[np.isfinite(losses)]), rel=1e-6)


def test_resume_after_corrupt_latest_checkpoint(nonfinite_setup, absent_run, tmp_path):
    """A corrupt latest checkpoint is refused, the previous one is intact, and resuming from
    it (once the corrupt one is removed) ends bit-identical to the uninterrupted run."""
    config, _, absent, make_tx, loop = nonfinite_setup
    loop = dataclasses.replace(loop, steps=len(KEPT), checkpoint_every=2, max_to_keep=2)
    ckpt = tmp_path / "ckpt"
    run = functools.partial(
        train_lib.train_grid, absent, config, make_tx, HP, SEEDS, loop, checkpoint_dir=ckpt
    )
    run(stop_at=6)
    assert sorted(int(p.name) for p in ckpt.iterdir() if p.name.isdigit()) == [4, 6]
    previous = checkpoint_damage.file_bytes(ckpt / "4")
    checkpoint_damage.corrupt(ckpt / "6")
    with pytest.raises(checkpoints.CheckpointError, match="corrupt"):
        run(resume=True)
    assert (
        checkpoint_damage.file_bytes(ckpt / "4") == previous
    )  # the failed restore touched nothing
    shutil.rmtree(ckpt / "6")
    resumed = run(resume=True)
    assert resumed.start_step == 4
    for a, b in zip(resumed.runs, absent_run.runs, strict=True):
        jax.tree.map(np.testing.assert_array_equal, a.params, b.params)
        np.testing.assert_array_equal(a.train_loss, b.train_loss)
