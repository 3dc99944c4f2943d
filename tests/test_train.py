"""Tests of the SSM trainer: pure step, vmapped grid = one-by-one runs, checkpoint/resume
bit-identity and errors, JSON lines and schedules. The tests that train a whole grid with
checkpoints are marked slow and run in the integration tier (``make test-integration``), as
does optax_decoupled.adamw training in a grid (tests/integration/test_experiments_training.py)."""

import dataclasses
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_decoupled as od
from optax_decoupled.experiments import (
    checkpoints,
    programs,
    schedules,
    ssm,
    tasks,
    train_results,
    training_step,
)
from optax_decoupled.experiments import train as train_lib

STEPS = 8
HPARAMS = {"learning_rate": [1e-3, 3e-3, 1e-2], "weight_decay": [0.0, 0.1, 0.01]}
SEEDS = [0, 1, 2]
# One make_tx object for the whole module, so the compiled programs are shared.
MAKE_TX = schedules.scheduled(optax.adamw, total_steps=STEPS, warmup_steps=2, clip_norm=1.0)
LOOP = train_lib.TrainConfig(steps=STEPS, eval_every=4, eval_batch_size=64, progress=False)


@pytest.fixture(scope="module")
def task():
    return tasks.induction_heads(seq_len=16, vocab_size=8, batch_size=16, num_eval=64)


@pytest.fixture(scope="module")
def model_config(task):
    return ssm.SSMConfig(
        d_model=16, n_layers=1, d_state=8, headdim=8, chunk_size=8, **task.model_kwargs()
    )


@pytest.fixture(scope="module")
def grid(task, model_config, tmp_path_factory):
    """The reference: 3 configurations trained for STEPS steps as one vmapped program."""
    root = tmp_path_factory.mktemp("grid")
    result = train_lib.train_grid(
        task,
        model_config,
        MAKE_TX,
        HPARAMS,
        SEEDS,
        LOOP,
        checkpoint_dir=root / "ckpt",
        metrics_path=root / "metrics.jsonl",
    )
    return result, root


@pytest.mark.slow  # a whole trained grid with checkpoints: the integration tier
def test_grid_equals_one_by_one(task, model_config, grid):
    """Each vmapped configuration equals the same configuration trained alone with the pure
    functional core (init_model, task.train_batch, train_step) in a plain loop."""
    result, _ = grid

    @jax.jit
    def step(params, opt_state, hp, data_key, s, rest):
        batch = task.train_batch(data_key, s)
        return training_step.train_step(
            params, opt_state, batch, hp, graphdef=graphdef, rest=rest, make_tx=MAKE_TX
        )

    for k in range(3):
        hp = {n: jnp.float32(v[k]) for n, v in HPARAMS.items()}
        model_key, data_key = training_step.seed_keys(SEEDS[k])
        graphdef, params, rest = training_step.init_model(model_config, model_key)
        opt_state = MAKE_TX(**hp).init(params)
        losses = []
        for s in range(STEPS):
            params, opt_state, metrics = step(params, opt_state, hp, data_key, s, rest)
            losses.append(float(metrics["loss"]))
        run = result.runs[k]
        assert run.seed == SEEDS[k] and run.hparams["learning_rate"] == pytest.approx(
            hp["learning_rate"]
        )
        np.testing.assert_allclose(run.train_loss, losses, rtol=2e-5, atol=1e-6)
        jax.tree.map(
            lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-6), run.params, params
        )
    # The three configurations really differ.
    assert not np.allclose(result.runs[0].train_loss, result.runs[2].train_loss)


def test_init_models_are_init_model_bit_for_bit(model_config):
    """The grid's initial models (one program for K keys) are exactly the models init_model
    builds one at a time, so a configuration's run does not depend on the grid it is in."""
    keys = jnp.stack([training_step.seed_keys(s)[0] for s in (0, 7, 3)])
    graphdef, params, rest = training_step.init_models(model_config, keys)
    assert graphdef == training_step.model_graphdef(model_config)
    for i in range(3):
        _, one, one_rest = training_step.init_model(model_config, keys[i])
        for a, b in zip(jax.tree.leaves((params, rest)), jax.tree.leaves((one, one_rest)),
                        strict=True):  # fmt: skip
            assert a.shape == (3, *b.shape)
            np.testing.assert_array_equal(a[i], b)
    # Different keys, different models.
    assert not np.array_equal(jax.tree.leaves(params)[0][0], jax.tree.leaves(params)[0][1])


@pytest.mark.slow  # a whole trained grid with checkpoints: the integration tier
def test_grid_result_contents(grid):
    result, root = grid
    assert len(result.runs) == 3 and result.start_step == 0
    for run in result.runs:
        assert run.train_loss.shape == run.train_accuracy.shape == run.grad_norm.shape == (STEPS,)
        assert np.all(np.isfinite(run.train_loss))
        assert [e["step"] for e in run.evals] == [4, 8]
        assert set(run.final) == {"val_loss", "val_accuracy", "test_loss", "test_accuracy"}
        assert 0.0 <= run.final["test_accuracy"] <= 1.0
    assert result.step_time_s > 0 and result.tokens_per_s > 0
    records = train_results.read_jsonl(root / "metrics.jsonl")
    evals = [r for r in records if r["event"] == "eval"]
    finals = [r for r in records if r["event"] == "final"]
    assert len(evals) == 6 and len(finals) == 3
    assert {"run", "seed", "hparams", "step", "train_loss", "val_loss", "val_accuracy"} <= set(
        evals[0]
    )
    assert finals[1]["train_loss"] == pytest.approx(result.runs[1].train_loss.tolist())
    assert finals[2]["hparams"]["weight_decay"] == pytest.approx(0.01)


@pytest.mark.slow  # a whole trained grid with checkpoints: the integration tier
def test_resume_is_bit_identical(task, model_config, grid, tmp_path):
    result, root = grid
    kwargs = dict(checkpoint_dir=tmp_path / "ckpt", metrics_path=tmp_path / "m.jsonl")
    part = train_lib.train_grid(
        task, model_config, MAKE_TX, HPARAMS, SEEDS, LOOP, stop_at=5, **kwargs
    )
    assert part.runs[0].final == {}
    assert checkpoints.latest_checkpoint_step(tmp_path / "ckpt") == 5
    resumed = train_lib.train_grid(
        task, model_config, MAKE_TX, HPARAMS, SEEDS, LOOP, resume=True, **kwargs
    )
    assert resumed.start_step == 5
    for a, b in zip(resumed.runs, result.runs, strict=True):
        jax.tree.map(np.testing.assert_array_equal, a.params, b.params)
        np.testing.assert_array_equal(a.train_loss, b.train_loss)
        assert a.evals == b.evals and a.final == b.final
    # Another layout of the configurations (here: one vmap instead of lax.map chunks) is not
    # bit-identical to the uninterrupted run: the resume says so.
    chunk = programs.resolve_config_chunk(LOOP.config_chunk)
    other = dataclasses.replace(LOOP, config_chunk=2 if chunk is None else None)
    with pytest.warns(UserWarning, match="another layout"):
        train_lib.train_grid(
            task, model_config, MAKE_TX, HPARAMS, SEEDS, other, resume=True, **kwargs
        )
    # The JSON lines of the interrupted, resumed and resumed-again run: the uninterrupted
    # run's records, none twice (the finished run's "final" records were written again).
    key = lambda r: (r["event"], r.get("step"), r["run"])  # noqa: E731
    records = train_results.read_jsonl(tmp_path / "m.jsonl")
    reference = train_results.read_jsonl(root / "metrics.jsonl")
    assert sorted(map(key, records)) == sorted(map(key, reference))


@pytest.mark.slow  # a whole trained grid: the integration tier
def test_eval_records_average_the_steps_since_the_last_eval(task, model_config, tmp_path):
    """With steps not a multiple of eval_every, the last record's train_loss is the mean of
    the steps after the previous evaluation (it reached back into the window before)."""
    loop = dataclasses.replace(LOOP, eval_every=3)  # evaluations at steps 3, 6 and 8
    res = train_lib.train_grid(
        task, model_config, MAKE_TX, HPARAMS, SEEDS, loop, metrics_path=tmp_path / "m.jsonl"
    )
    evals = [r for r in train_results.read_jsonl(tmp_path / "m.jsonl") if r["event"] == "eval"]
    assert sorted({r["step"] for r in evals}) == [3, 6, 8]
    for r in evals:
        since = (r["step"] - 1) // 3 * 3
        expected = np.mean(res.runs[r["run"]].train_loss[since : r["step"]])
        assert r["train_loss"] == pytest.approx(float(expected), rel=1e-6)


@pytest.mark.slow  # a whole trained grid with checkpoints: the integration tier
def test_resume_errors(task, model_config, grid, tmp_path):
    _, root = grid
    run = lambda d, **kw: train_lib.train_grid(  # noqa: E731
        task,
        model_config,
        kw.pop("make_tx", MAKE_TX),
        kw.pop("hp", HPARAMS),
        SEEDS,
        LOOP,
        checkpoint_dir=d,
        resume=True,
        **kw,
    )
    # Missing: no directory, or a directory without checkpoints.
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        run(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        run(tmp_path / "empty")
    # A checkpoint of a different run.
    other = {**HPARAMS, "weight_decay": [0.5, 0.5, 0.5]}
    with pytest.raises(checkpoints.CheckpointError, match="different run"):
        run(root / "ckpt", hp=other)
    # The same task name with other data (a resume compared only the name), and another
    # evaluation schedule (the recorded evals and the metrics file would mix two).
    same_name = tasks.induction_heads(seq_len=16, vocab_size=8, batch_size=16, num_eval=32)
    assert same_name.name == task.name
    with pytest.raises(checkpoints.CheckpointError, match="task_data is .*splits_sha256"):
        train_lib.train_grid(
            same_name, model_config, MAKE_TX, HPARAMS, SEEDS, LOOP,
            checkpoint_dir=root / "ckpt", resume=True,
        )  # fmt: skip
    with pytest.raises(checkpoints.CheckpointError, match="evaluation is .*'eval_every': 4"):
        train_lib.train_grid(
            task, model_config, MAKE_TX, HPARAMS, SEEDS, dataclasses.replace(LOOP, eval_every=2),
            checkpoint_dir=root / "ckpt", resume=True,
        )  # fmt: skip
    # Another optimizer with the same state structure and grid: a fixed setting inside
    # make_tx (the clipping threshold here) is told apart by the optimizer's fingerprint, and
    # said (a warning: the fingerprint also changes with the package's code or kernels).
    clipped = schedules.scheduled(optax.adamw, total_steps=STEPS, warmup_steps=2, clip_norm=0.5)
    with pytest.warns(UserWarning, match="optimizer that computes something else"):
        run(root / "ckpt", make_tx=clipped)
    # Corrupt: overwrite every array file of the latest checkpoint with garbage.
    corrupt = tmp_path / "corrupt"
    shutil.copytree(root / "ckpt", corrupt)
    step_dir = corrupt / str(checkpoints.latest_checkpoint_step(corrupt)) / "state"
    damaged = 0
    for dirpath, _, files in os.walk(step_dir):
        for name in files:
            with open(os.path.join(dirpath, name), "wb") as f:
                f.write(b"not a checkpoint")
            damaged += 1
    assert damaged > 0
    with pytest.raises(checkpoints.CheckpointError, match="corrupt"):
        run(corrupt)


@pytest.mark.slow  # a whole trained grid with checkpoints: the integration tier
def test_optimizer_fingerprint(monkeypatch, task, model_config, grid):
    """The fingerprint of resumes: equal for equal factories (also a new but equal one),
    different for any fixed setting inside make_tx, blind to the grid's values; a checkpoint
    of other versions resumes with a warning that the check was not possible."""
    params = {"w": jnp.ones((4, 3)), "b": jnp.ones((3,))}
    names = sorted(HPARAMS)

    def fp(make_tx):
        return checkpoints.optimizer_fingerprint(make_tx, params, names)["sha256"]

    same = schedules.scheduled(optax.adamw, total_steps=STEPS, warmup_steps=2, clip_norm=1.0)
    assert fp(MAKE_TX) == fp(same)

    # An array constant enters by value (jaxprs print it as a type only).
    def per_element(v):
        c = jax.tree.map(lambda x: np.full(x.shape, v, np.float32), params)
        scale = optax.stateless(lambda u, p=None: jax.tree.map(lambda a, b: a * b, u, c))
        return lambda **hp: optax.chain(MAKE_TX(**hp), scale)

    assert fp(per_element(0.5)) == fp(per_element(0.5)) != fp(per_element(0.25))
    for other in (
        schedules.scheduled(optax.adamw, total_steps=STEPS + 1, warmup_steps=2, clip_norm=1.0),
        schedules.scheduled(optax.adamw, total_steps=STEPS, warmup_steps=3, clip_norm=1.0),
        schedules.scheduled(optax.adamw, total_steps=STEPS, warmup_steps=2, clip_norm=1.0, b1=0.8),
        schedules.scheduled(od.adamw, total_steps=STEPS, warmup_steps=2, clip_norm=1.0, mask=None),
    ):
        assert fp(other) != fp(MAKE_TX)
    _, root = grid
    monkeypatch.setattr(od, "__version__", "0.0.0+other")
    with pytest.warns(UserWarning, match="cannot be checked"):
        train_lib.train_grid(
            task, model_config, MAKE_TX, HPARAMS, SEEDS, LOOP,
            checkpoint_dir=root / "ckpt", resume=True,
        )  # fmt: skip


def test_restore_checkpoint_roundtrip_and_missing_step(tmp_path):
    tree = {"a": np.arange(3.0), "b": {"c": np.ones((2, 2), np.int32)}}
    checkpoints.save_checkpoint(tmp_path, 3, tree, {"note": "x"})
    restored, meta, step = checkpoints.restore_checkpoint(tmp_path, tree)
    assert step == 3 and meta == {"note": "x"}
    jax.tree.map(np.testing.assert_array_equal, restored, tree)
    with pytest.raises(FileNotFoundError, match="step 4"):
        checkpoints.restore_checkpoint(tmp_path, tree, step=4)
    with pytest.raises(checkpoints.CheckpointError):
        checkpoints.restore_checkpoint(tmp_path, {"a": np.arange(3.0)})


def test_warmup_cosine_accepts_traced_peak():
    peaks = jnp.asarray([1e-3, 1e-2])
    counts = jnp.arange(12)
    got = jax.jit(
        jax.vmap(
            lambda p: jax.vmap(schedules.warmup_cosine(p, total_steps=10, warmup_steps=3))(counts)
        )
    )(peaks)
    for p, row in zip([1e-3, 1e-2], got, strict=True):
        want = optax.warmup_cosine_decay_schedule(0.0, p, 3, 10)(counts)
        # rtol 1e-5: float32 cos differs by an ulp between backends (GPU), and near the end
        # of the cosine 1 + cos(x) cancels, which magnifies it to ~1e-6 relative.
        np.testing.assert_allclose(row, want, rtol=1e-5, atol=1e-12)
    no_warmup = schedules.warmup_cosine(2.0, total_steps=4)
    np.testing.assert_allclose(
        no_warmup(jnp.arange(5)), 2.0 * optax.cosine_decay_schedule(1.0, 4)(jnp.arange(5))
    )


def test_scheduled_matches_hand_built_chain():
    params = {"w": jnp.asarray([[1.0, -2.0], [0.5, 3.0]])}
    grads = {"w": jnp.asarray([[4.0, 0.1], [-2.0, 1.0]])}
    make_tx = schedules.scheduled(optax.adamw, total_steps=10, warmup_steps=2, clip_norm=1.0)
    tx = make_tx(learning_rate=0.1, weight_decay=0.3)
    ref = optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.adamw(optax.warmup_cosine_decay_schedule(0.0, 0.1, 2, 10), weight_decay=0.3),
    )
    sa, sb = tx.init(params), ref.init(params)
    for _ in range(4):
        ua, sa = tx.update(grads, sa, params)
        ub, sb = ref.update(grads, sb, params)
        np.testing.assert_allclose(ua["w"], ub["w"], rtol=1e-6)
    with pytest.raises(TypeError, match="learning_rate"):
        make_tx(weight_decay=0.1)


def test_product_grid():
    hp, seeds = train_lib.product_grid(
        {"learning_rate": [1e-3, 1e-2], "weight_decay": [0, 1]}, [7, 8]
    )
    assert hp["learning_rate"].tolist() == pytest.approx([1e-3] * 4 + [1e-2] * 4)
    assert hp["weight_decay"].tolist() == [0, 0, 1, 1, 0, 0, 1, 1]
    assert seeds.tolist() == [7, 8] * 4


def test_argument_errors(task, model_config):
    with pytest.raises(ValueError, match="inconsistent"):
        train_lib.train_grid(task, model_config, MAKE_TX, {"learning_rate": [1, 2]}, [0, 1, 2])
    wrong = ssm.SSMConfig(d_model=16, headdim=8, vocab_size=5, num_classes=5)
    with pytest.raises(ValueError, match="vocab_size"):
        train_lib.train_grid(task, wrong, optax.sgd(0.1))
    with pytest.raises(ValueError, match="checkpoint_dir"):
        train_lib.train_grid(task, model_config, optax.sgd(0.1), resume=True)
    with pytest.raises(ValueError):
        train_lib.TrainConfig(steps=0)
    # Found by a review: these failed late (after training, at the first log or save) or not
    # at all (max_to_keep=0 deleted every checkpoint; stop_at=0 saved none).
    with pytest.raises(ValueError, match="log_every"):
        train_lib.TrainConfig(log_every=0)
    with pytest.raises(ValueError, match="max_to_keep"):
        train_lib.TrainConfig(max_to_keep=0)
    bad_split = dataclasses.replace(LOOP, final_splits=("tset",))
    with pytest.raises(ValueError, match=r"final_splits names \['tset'\]"):
        train_lib.train_grid(task, model_config, optax.sgd(0.1), config=bad_split)
    with pytest.raises(ValueError, match="stop_at"):
        train_lib.train_grid(task, model_config, optax.sgd(0.1), checkpoint_dir="x", stop_at=0)


def test_schedule_arguments_are_checked_up_front():
    """Named errors when the factory is built, not Optax's `decay_steps` from the first step;
    a negative clip_norm (gradient ascent) or zero (no steps) is refused."""
    for kw, name in (
        (dict(total_steps=0), "total_steps"),
        (dict(total_steps=10, warmup_steps=10), "warmup_steps"),
        (dict(total_steps=10, warmup_steps=-1), "warmup_steps"),
        (dict(total_steps=10, clip_norm=-1.0), "clip_norm"),
        (dict(total_steps=10, clip_norm=0.0), "clip_norm"),
    ):
        with pytest.raises(ValueError, match=f"`{name}`"):
            schedules.scheduled(optax.adamw, **kw)
    with pytest.raises(ValueError, match="`total_steps`"):
        schedules.warmup_cosine(1e-3, total_steps=0)
    schedules.scheduled(optax.adamw, total_steps=10, warmup_steps=9, clip_norm=None)


def test_config_chunk_resolution():
    assert programs.resolve_config_chunk("auto", "cpu") == programs.CPU_CONFIG_CHUNK
    assert programs.resolve_config_chunk("auto", "gpu") is None
    assert programs.resolve_config_chunk(3, "gpu") == 3
    assert programs.resolve_config_chunk(None, "cpu") is None
    assert programs.config_mesh(3, shard=False) is None
    assert programs.config_mesh(1) is None
    mesh = programs.config_mesh(1000)
    assert (mesh.size if mesh else 1) == len(jax.local_devices())
