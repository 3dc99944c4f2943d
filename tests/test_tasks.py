"""Tests of the SSM tasks: generators' structure, determinism, the digits split and metrics.
(A tiny model's loss falling on each task: tests/integration/test_experiments_training.py.)"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from optax_decoupled.experiments import tasks


def test_selective_copying_structure():
    task = tasks.selective_copying(
        seq_len=16, num_tokens=3, vocab_size=8, batch_size=32, num_eval=8
    )
    batch = jax.tree.map(np.asarray, task.train_batch(jax.random.key(0), 0))
    assert task.seq_len == 19 and task.num_classes == task.vocab_size == 8
    marker = task.info["marker"]
    assert marker == 7
    assert batch["inputs"].shape == batch["targets"].shape == batch["mask"].shape == (32, 19)
    for inp, tgt, mask in zip(batch["inputs"], batch["targets"], batch["mask"], strict=True):
        region = inp[:16]
        data = region[region != 0]
        assert len(data) == 3  # exactly k data tokens, everything else is noise (0)
        assert np.all((data >= 1) & (data <= 6))
        np.testing.assert_array_equal(inp[16:], marker)
        np.testing.assert_array_equal(tgt[16:], data)  # reproduced in order after the region
        np.testing.assert_array_equal(mask, [0] * 16 + [1] * 3)
        assert not np.any(region == marker)


def test_induction_heads_structure():
    task = tasks.induction_heads(seq_len=20, vocab_size=10, batch_size=64, num_eval=8)
    batch = jax.tree.map(np.asarray, task.train_batch(jax.random.key(1), 3))
    trigger = task.info["trigger"]
    assert batch["inputs"].shape == (64, 20)
    for inp, tgt, mask in zip(batch["inputs"], batch["targets"], batch["mask"], strict=True):
        where = np.flatnonzero(inp == trigger)
        assert len(where) == 2 and where[1] == 19 and where[0] <= 17
        assert tgt[19] == inp[where[0] + 1] != trigger
        np.testing.assert_array_equal(mask, [0] * 19 + [1])
    # The answer is not always the same token and the trigger position varies.
    assert len(set(batch["targets"][:, -1])) > 3


@pytest.mark.parametrize("make", [tasks.selective_copying, tasks.induction_heads])
def test_synthetic_determinism(make):
    task = make(batch_size=8, num_eval=16)
    key = jax.random.key(5)
    a = task.train_batch(key, 7)  # eager
    # Jittable with a traced step, and a pure function of (key, step).
    sample = jax.jit(task.train_batch)
    b, c = sample(key, jnp.int32(7)), sample(key, jnp.int32(8))
    np.testing.assert_array_equal(a["inputs"], b["inputs"])
    assert not np.array_equal(a["inputs"], c["inputs"])
    again = make(batch_size=8, num_eval=16)
    np.testing.assert_array_equal(task.splits["val"]["inputs"], again.splits["val"]["inputs"])
    assert not np.array_equal(task.splits["val"]["inputs"], task.splits["test"]["inputs"])


def test_digits_split():
    from sklearn.datasets import load_digits

    splits = tasks.load_digits_splits(split_seed=0)
    sizes = {k: v["targets"].shape[0] for k, v in splits.items()}
    assert sizes == {"train": 1078, "val": 359, "test": 360}
    for split in splits.values():
        assert split["inputs"].shape[1:] == (64, 1) and split["inputs"].dtype == np.float32
        assert split["inputs"].min() >= 0.0 and split["inputs"].max() <= 1.0
        assert set(np.unique(split["targets"])) == set(range(10))
    # The documented split: one seeded permutation cut 60/20/20 (hence disjoint).
    X, y = load_digits(return_X_y=True)
    perm = np.random.default_rng(0).permutation(1797)
    cuts = {"train": perm[:1078], "val": perm[1078:1437], "test": perm[1437:]}
    for name, idx in cuts.items():
        np.testing.assert_allclose(splits[name]["inputs"][..., 0], X[idx] / 16.0, rtol=1e-6)
        np.testing.assert_array_equal(splits[name]["targets"], y[idx])
    other = tasks.load_digits_splits(split_seed=1)
    assert not np.array_equal(other["test"]["inputs"], splits["test"]["inputs"])
    with pytest.raises(ValueError, match="fractions"):
        tasks.load_digits_splits(fractions=(0.5, 0.5, 0.5))


def test_digits_epochs_draw_without_replacement():
    from collections import Counter

    task = tasks.sequential_digits(batch_size=100)
    spe = task.info["steps_per_epoch"]
    assert spe == 10
    key = jax.random.key(0)
    sample = jax.jit(task.train_batch)
    epoch0 = np.concatenate([np.asarray(sample(key, s)["inputs"]) for s in range(spe)])
    drawn = Counter(r.tobytes() for r in epoch0)
    available = Counter(r.tobytes() for r in task.splits["train"]["inputs"])
    assert sum(drawn.values()) == 1000
    assert all(drawn[r] <= available[r] for r in drawn)  # a sub-multiset: no repeats
    # The next epoch reshuffles.
    assert not np.array_equal(np.asarray(sample(key, spe)["inputs"]), epoch0[:100])


def test_metrics_respect_mask():
    logits = jnp.asarray([[[5.0, 0.0], [0.0, 5.0], [5.0, 0.0]]])  # (1, 3, 2)
    batch = {
        "targets": jnp.asarray([[0, 0, 1]]),
        "mask": jnp.asarray([[1.0, 0.0, 1.0]]),
    }
    assert float(tasks.accuracy(logits, batch)) == 0.5
    ce = float(tasks.cross_entropy(logits, batch))
    want = 0.5 * (-jax.nn.log_softmax(logits[0, 0])[0] - jax.nn.log_softmax(logits[0, 2])[1])
    np.testing.assert_allclose(ce, want, rtol=1e-6)


def test_make_task_unknown():
    with pytest.raises(ValueError, match="unknown task"):
        tasks.make_task("copying")
    assert tasks.make_task("induction_heads", seq_len=8, num_eval=4).seq_len == 8


def test_digits_rows_and_training_subset():
    """``row_length=8`` reads each image as its 8 rows (the same pixels as the pixel
    sequence, regrouped); ``train_size`` keeps the first images of the training split and
    draws batches only from them; validation and test are unchanged."""
    pixels = tasks.sequential_digits(batch_size=8)
    rows = tasks.sequential_digits(batch_size=8, row_length=8, train_size=40)
    assert (rows.seq_len, rows.input_dim) == (8, 8)
    assert rows.model_kwargs()["input_dim"] == 8
    for split in ("val", "test"):
        np.testing.assert_array_equal(
            rows.splits[split]["inputs"].reshape(-1, 64), pixels.splits[split]["inputs"][..., 0]
        )
    train = rows.splits["train"]
    assert train["inputs"].shape == (40, 8, 8) and rows.info["steps_per_epoch"] == 5
    np.testing.assert_array_equal(
        train["inputs"].reshape(40, 64), pixels.splits["train"]["inputs"][:40, :, 0]
    )
    kept = {r.tobytes() for r in train["inputs"]}
    batch = jax.jit(rows.train_batch)(jax.random.key(0), 7)
    assert all(r.tobytes() in kept for r in np.asarray(batch["inputs"]))
    with pytest.raises(ValueError, match="row_length"):
        tasks.sequential_digits(row_length=3)
    with pytest.raises(ValueError, match="train_size"):
        tasks.sequential_digits(train_size=0)
