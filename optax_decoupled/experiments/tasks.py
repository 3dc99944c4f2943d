"""Sequence tasks for the SSM test bed: two synthetic ones (generated) and one small real one.

* :func:`selective_copying` -- Gu & Dao 2023 ("Mamba"), App. E.1 / §4.1.1: ``k`` data tokens
  scattered among noise tokens in a length-``L`` region must be reproduced, in order, after it.
* :func:`induction_heads` -- Gu & Dao 2023, §4.1.2 (after Olsson et al. 2022): a trigger token
  followed by an answer token occurs once; at the end the trigger appears again and the model
  must output the answer.
* :func:`sequential_digits` -- scikit-learn's bundled ``load_digits`` (1797 8x8 images, shipped
  in the wheel, no download), each image read as a 64-step sequence of pixel intensities in
  ``[0, 1]``, 10 classes, a fixed seeded 60/20/20 train/validation/test split.

A task is a :class:`Task`: a pure, jittable training-batch sampler ``train_batch(key, step)``
(so each seed of a vmapped grid draws its own data inside the compiled step), fixed evaluation
splits, and :func:`accuracy` / :func:`cross_entropy` that honour the batch's ``mask``.

A batch is a dict ``{"inputs", "targets", "mask"}``:

* token tasks: ``inputs`` int32 ``(b, l)``, ``targets`` int32 ``(b, l)``, ``mask`` float32
  ``(b, l)`` (1 where the position is scored);
* sequence tasks: ``inputs`` float32 ``(b, l, 1)``, ``targets`` int32 ``(b,)``, ``mask``
  float32 ``(b,)`` (0 only for padding added to make evaluation chunks equal in size).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

Batch = dict[str, jax.Array]


@dataclasses.dataclass(frozen=True, eq=False)
class Task:
    """A task: shapes, a pure training sampler and fixed evaluation splits.

    Attributes:
      name: short name.
      seq_len: input length ``l``.
      num_classes: number of output classes.
      head: ``"token"`` (score positions selected by ``mask``) or ``"sequence"``.
      vocab_size: number of input token ids for token inputs, else ``None``.
      input_dim: feature size of real-valued inputs, else ``None``.
      train_batch: ``(key, step) -> Batch`` of ``batch_size`` examples; pure and jittable.
        ``step`` matters only for finite data sets (epoch-wise shuffling); synthetic tasks draw
        fresh examples from ``fold_in(key, step)``.
      batch_size: training batch size bound into ``train_batch``.
      splits: fixed evaluation sets by name (``"val"``, ``"test"``), as NumPy batches.
      info: free-form description (sizes, token ids), for logs and reports.

    Instances compare and hash by identity, so a task can key compiled-function caches.
    """

    name: str
    seq_len: int
    num_classes: int
    head: Literal["token", "sequence"]
    vocab_size: int | None
    input_dim: int | None
    train_batch: Callable[[jax.Array, jax.Array], Batch]
    batch_size: int
    splits: dict[str, dict[str, np.ndarray]]
    info: dict = dataclasses.field(default_factory=dict)

    def model_kwargs(self) -> dict:
        """Keyword arguments of :class:`~optax_decoupled.experiments.ssm.SSMConfig` fixed by
        the task (input kind, classes, head)."""
        return dict(
            vocab_size=self.vocab_size,
            input_dim=self.input_dim,
            num_classes=self.num_classes,
            head=self.head,
        )


# ---------------------------------------------------------------------------------------------
# Metrics.
# ---------------------------------------------------------------------------------------------


def cross_entropy_sum(logits: jax.Array, batch: Batch) -> tuple[jax.Array, jax.Array]:
    """Masked sum of softmax cross-entropies and the mask's sum (the count of scored targets)."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    nll = -jnp.take_along_axis(logp, batch["targets"][..., None], axis=-1)[..., 0]
    mask = batch["mask"].astype(jnp.float32)
    return jnp.sum(nll * mask), jnp.sum(mask)


def correct_sum(logits: jax.Array, batch: Batch) -> jax.Array:
    """Masked count of correct argmax predictions."""
    hits = (jnp.argmax(logits, axis=-1) == batch["targets"]).astype(jnp.float32)
    return jnp.sum(hits * batch["mask"].astype(jnp.float32))


def cross_entropy(logits: jax.Array, batch: Batch) -> jax.Array:
    """Mean cross-entropy over scored targets (mask > 0)."""
    total, count = cross_entropy_sum(logits, batch)
    return total / jnp.maximum(count, 1.0)


def accuracy(logits: jax.Array, batch: Batch) -> jax.Array:
    """Accuracy over scored targets: per-token for token tasks, per-sequence otherwise."""
    return correct_sum(logits, batch) / jnp.maximum(jnp.sum(batch["mask"]), 1.0)


# ---------------------------------------------------------------------------------------------
# Selective copying.
# ---------------------------------------------------------------------------------------------


def _selective_copying_example(
    key: jax.Array, seq_len: int, num_tokens: int, num_data: int, marker: int
) -> Batch:
    k_pos, k_tok = jax.random.split(key)
    positions = jnp.sort(jax.random.permutation(k_pos, seq_len)[:num_tokens])  # (k,)
    tokens = jax.random.randint(k_tok, (num_tokens,), 1, num_data + 1)  # (k,) in [1, num_data]
    region = jnp.zeros((seq_len,), jnp.int32).at[positions].set(tokens)  # noise = 0
    inputs = jnp.concatenate([region, jnp.full((num_tokens,), marker, jnp.int32)])
    targets = jnp.concatenate([jnp.zeros((seq_len,), jnp.int32), tokens.astype(jnp.int32)])
    mask = jnp.concatenate([jnp.zeros((seq_len,)), jnp.ones((num_tokens,))]).astype(jnp.float32)
    return {"inputs": inputs, "targets": targets, "mask": mask}


def _synthetic_sampler(
    one: Callable[[jax.Array], Batch], batch_size: int, seed: int, salt: int, num_eval: int
) -> tuple[Callable[[jax.Array, jax.Array], Batch], dict[str, dict[str, np.ndarray]]]:
    """A synthetic task's pure training sampler and its fixed ``val``/``test`` splits.

    ``one`` maps a batch of keys to a batch of examples. Training draws fresh examples from
    ``fold_in(key, step)``; the splits come from keys derived from ``seed`` and ``salt``.
    """

    @functools.partial(jax.jit, static_argnums=1)
    def sample(key: jax.Array, n: int) -> Batch:
        return one(jax.random.split(key, n))

    def train_batch(key: jax.Array, step: jax.Array) -> Batch:
        return sample(jax.random.fold_in(key, step), batch_size)

    eval_key = jax.random.fold_in(jax.random.key(seed), salt)
    splits = {
        name: jax.tree.map(np.asarray, sample(jax.random.fold_in(eval_key, i), num_eval))
        for i, name in enumerate(("val", "test"))
    }
    return train_batch, splits


def selective_copying(
    seq_len: int = 32,
    num_tokens: int = 4,
    vocab_size: int = 16,
    *,
    batch_size: int = 64,
    num_eval: int = 1024,
    seed: int = 0,
) -> Task:
    """Selective copying (Gu & Dao 2023, App. E.1).

    Token ids: ``0`` is noise, ``1 .. vocab_size - 2`` are data tokens, ``vocab_size - 1`` is
    the marker. An example is a length-``seq_len`` region of noise with ``num_tokens`` data
    tokens at random (sorted) positions, followed by ``num_tokens`` marker tokens; at the i-th
    marker the model must output the i-th data token. Input length ``seq_len + num_tokens``;
    only the marker positions are scored (``mask``). Accuracy is per token.

    ``splits["val"]`` and ``splits["test"]`` hold ``num_eval`` examples each, drawn from keys
    derived from ``seed`` that training (which uses the trainer's per-run data key) never sees
    with probability one.
    """
    if num_tokens > seq_len:
        raise ValueError(f"num_tokens ({num_tokens}) must be <= seq_len ({seq_len}).")
    if vocab_size < 3:
        raise ValueError(f"vocab_size must be >= 3 (noise, marker, data), got {vocab_size}.")
    num_data, marker = vocab_size - 2, vocab_size - 1
    one = jax.vmap(lambda k: _selective_copying_example(k, seq_len, num_tokens, num_data, marker))
    train_batch, splits = _synthetic_sampler(one, batch_size, seed, 0x5E1, num_eval)
    return Task(
        name="selective_copying",
        seq_len=seq_len + num_tokens,
        num_classes=vocab_size,
        head="token",
        vocab_size=vocab_size,
        input_dim=None,
        train_batch=train_batch,
        batch_size=batch_size,
        splits=splits,
        info=dict(region_len=seq_len, num_tokens=num_tokens, noise=0, marker=marker),
    )


# ---------------------------------------------------------------------------------------------
# Induction heads.
# ---------------------------------------------------------------------------------------------


def _induction_example(key: jax.Array, seq_len: int, vocab_size: int) -> Batch:
    trigger = vocab_size - 1
    k_seq, k_pos = jax.random.split(key)
    seq = jax.random.randint(k_seq, (seq_len,), 0, vocab_size - 1)  # no trigger in the filler
    pos = jax.random.randint(k_pos, (), 0, seq_len - 2)  # trigger at pos, answer at pos + 1
    answer = seq[pos + 1]
    seq = seq.at[pos].set(trigger).at[seq_len - 1].set(trigger)
    targets = jnp.zeros((seq_len,), jnp.int32).at[seq_len - 1].set(answer)
    mask = jnp.zeros((seq_len,), jnp.float32).at[seq_len - 1].set(1.0)
    return {"inputs": seq.astype(jnp.int32), "targets": targets, "mask": mask}


def induction_heads(
    seq_len: int = 64,
    vocab_size: int = 16,
    *,
    batch_size: int = 64,
    num_eval: int = 1024,
    seed: int = 0,
) -> Task:
    """Induction heads (Gu & Dao 2023, §4.1.2).

    Token ids ``0 .. vocab_size - 2`` are filler, ``vocab_size - 1`` is the trigger. An example
    is ``seq_len`` random filler tokens; the trigger is written at a random position ``j <=
    seq_len - 3``, its successor at ``j + 1`` is the answer, and the last token is the trigger
    again. Only the last position is scored: its target is the answer.
    """
    if seq_len < 4:
        raise ValueError(f"seq_len must be >= 4, got {seq_len}.")
    if vocab_size < 3:
        raise ValueError(f"vocab_size must be >= 3, got {vocab_size}.")
    one = jax.vmap(lambda k: _induction_example(k, seq_len, vocab_size))
    train_batch, splits = _synthetic_sampler(one, batch_size, seed, 0x1DC, num_eval)
    return Task(
        name="induction_heads",
        seq_len=seq_len,
        num_classes=vocab_size,
        head="token",
        vocab_size=vocab_size,
        input_dim=None,
        train_batch=train_batch,
        batch_size=batch_size,
        splits=splits,
        info=dict(trigger=vocab_size - 1),
    )


# ---------------------------------------------------------------------------------------------
# Sequential digits.
# ---------------------------------------------------------------------------------------------


def load_digits_splits(
    split_seed: int = 0,
    fractions: tuple[float, float, float] = (0.6, 0.2, 0.2),
    *,
    row_length: int = 1,
) -> dict[str, dict[str, np.ndarray]]:
    """scikit-learn's bundled digits as pixel sequences, split train/val/test with a fixed seed.

    Returns ``{"train", "val", "test"}`` batches: ``inputs`` float32 ``(n, 64 // row_length,
    row_length)`` (pixels in row-major order, ``row_length`` of them per step, scaled from
    0..16 to [0, 1]), ``targets`` int32 ``(n,)``, ``mask`` ones.

    Raises:
      ValueError: for fractions that are not three positive numbers summing to 1, or a
        ``row_length`` that does not divide 64.
    """
    from sklearn.datasets import load_digits

    if len(fractions) != 3 or abs(sum(fractions) - 1.0) > 1e-6 or min(fractions) <= 0:
        raise ValueError(f"fractions must be three positive numbers summing to 1, got {fractions}.")
    if row_length < 1 or 64 % row_length:
        raise ValueError(f"`row_length` must divide 64 (1, 2, 4, 8, ...), got {row_length}.")
    X, y = load_digits(return_X_y=True)  # (1797, 64) in 0..16, (1797,)
    perm = np.random.default_rng(split_seed).permutation(len(y))
    n_train = int(round(fractions[0] * len(y)))
    n_val = int(round(fractions[1] * len(y)))
    parts = {
        "train": perm[:n_train],
        "val": perm[n_train : n_train + n_val],
        "test": perm[n_train + n_val :],
    }
    return {
        name: {
            "inputs": (X[idx] / 16.0).astype(np.float32).reshape(len(idx), -1, row_length),
            "targets": y[idx].astype(np.int32),
            "mask": np.ones((len(idx),), np.float32),
        }
        for name, idx in parts.items()
    }


def sequential_digits(
    *,
    batch_size: int = 64,
    split_seed: int = 0,
    fractions: tuple[float, float, float] = (0.6, 0.2, 0.2),
    row_length: int = 1,
    train_size: int | None = None,
) -> Task:
    """Sequential digits: 8x8 images read as sequences, 10 classes.

    ``row_length=1`` reads one pixel per step (64 steps, pixel-sequential); ``row_length=8``
    one row per step (8 steps of 8 pixels, as row-sequential MNIST is read). ``train_size``
    keeps only the first ``train_size`` images of the training split (a small training set
    that a model can overfit; validation and test are unchanged).

    Training batches walk through the training set in epochs: epoch ``e`` uses the
    permutation ``permutation(fold_in(key, e))`` and step ``s`` takes batch ``s mod
    steps_per_epoch`` of it (the remainder of each epoch is dropped), so the data order is a
    pure function of the run's key and the step. ``splits`` holds ``"val"`` and ``"test"``
    (``"train"`` too -- the training set as trained on -- for the generalisation gap).

    Raises:
      ValueError: for a ``train_size`` outside ``[1, len(train split)]`` or a ``batch_size``
        larger than the training set.
    """
    data = load_digits_splits(split_seed, fractions, row_length=row_length)
    if train_size is not None:
        available = int(data["train"]["targets"].shape[0])
        if not 1 <= train_size <= available:
            raise ValueError(f"`train_size` must be in [1, {available}], got {train_size}.")
        data["train"] = {k: v[:train_size] for k, v in data["train"].items()}
    train = {k: jnp.asarray(v) for k, v in data["train"].items()}
    n_train = int(train["targets"].shape[0])
    if batch_size > n_train:
        raise ValueError(f"batch_size ({batch_size}) exceeds the training split ({n_train}).")
    steps_per_epoch = n_train // batch_size

    def train_batch(key: jax.Array, step: jax.Array) -> Batch:
        epoch, within = jnp.divmod(step, steps_per_epoch)
        perm = jax.random.permutation(jax.random.fold_in(key, epoch), n_train)
        idx = jax.lax.dynamic_slice_in_dim(perm, within * batch_size, batch_size)
        return jax.tree.map(lambda v: v[idx], train)

    return Task(
        name="sequential_digits",
        seq_len=64 // row_length,
        num_classes=10,
        head="sequence",
        vocab_size=None,
        input_dim=row_length,
        train_batch=train_batch,
        batch_size=batch_size,
        splits=data,
        info=dict(
            sizes={k: int(v["targets"].shape[0]) for k, v in data.items()},
            steps_per_epoch=steps_per_epoch,
            row_length=row_length,
        ),
    )


TASKS: dict[str, Callable[..., Task]] = {
    "selective_copying": selective_copying,
    "induction_heads": induction_heads,
    "sequential_digits": sequential_digits,
}


def make_task(name: str, **kwargs) -> Task:
    """Build a task by name (``selective_copying``, ``induction_heads``, ``sequential_digits``)."""
    try:
        builder = TASKS[name]
    except KeyError:
        raise ValueError(f"unknown task {name!r}; choose one of {sorted(TASKS)}.") from None
    return builder(**kwargs)
