"""Bad input to the optimizers: one test per row of docs/bad_input.md, and a hypothesis fuzz.

``CASES`` holds every bad input of the core that the documentation's first table lists, with
a trigger. ``test_documented_bad_input`` raises each one and ``test_docs_table_is_current``
checks that the table in docs/bad_input.md shows exactly these rows with the messages the code
really produces (``python tests/test_fuzz.py`` prints the rows to paste after a change).

The fuzz draws random parameter pytrees (nested dicts, lists and tuples; ``None`` leaves,
zero-size arrays, scalars; float32/bfloat16/float16 and, rarely, integer, bool or complex
leaves) and random hyperparameters for every public alias, valid or not (negative, NaN, Inf,
bools, schedules where only numbers are allowed, unknown names, masks that do not match, ...).
Building the optimizer, ``init`` and two ``update`` steps may raise only a ``ValueError``
whose message matches one of ``DOCUMENTED``, and where every setting, leaf dtype and the
gradients' structure is valid, only one of ``COMBINATION_ERRORS`` (settings that are valid one
by one but not together); anything that does not raise must return updates with the
gradients' structure, shapes and dtypes, finite for sane settings.
"""

from __future__ import annotations

import dataclasses
import math
import os
import pathlib
import re
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import optax_decoupled as od
from optax_decoupled._src import storage

DOC = pathlib.Path(__file__).parent.parent / "docs" / "bad_input.md"
PARAMS = {"w": jnp.ones((2, 3)), "b": jnp.ones(3)}
SCHED = optax.cosine_decay_schedule(1e-3, 100)

# ---------------------------------------------------------------------------------------------
# The documented bad inputs (one row of docs/bad_input.md each).
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Case:
    what: str  # the bad input, in words (the table's first column)
    trigger: Callable[[], object]
    error: type[BaseException] = ValueError


def _update(tx, grads, params=PARAMS, with_params=True):
    state = tx.init(params)
    return tx.update(grads, state, params) if with_params else tx.update(grads, state)


CASES: dict[str, Case] = {
    "lr-negative": Case("a negative learning rate (any alias)", lambda: od.adamw(-1e-3)),
    "lr-nan": Case("a NaN or infinite learning rate", lambda: od.lion(float("nan"))),
    "wd-negative": Case(
        "`weight_decay` < 0, NaN or ±Inf", lambda: od.adam_l2(1e-3, weight_decay=-0.1)
    ),
    "bool-hyperparameter": Case(
        "a bool where a number is expected", lambda: od.adamw(1e-3, weight_decay=True)
    ),
    "beta-out-of-range": Case("`b1`/`b2` outside [0, 1)", lambda: od.adamw(1e-3, b2=1.0)),
    "beta-schedule": Case(
        "a schedule for `b1`, `b2`, `eps` or `eps_root` (only the learning rate and the weight "
        "decay take schedules)",
        lambda: od.scale_by_adam(b1=lambda count: 0.9),
    ),
    "array-out-of-range": Case(
        "a concrete JAX or NumPy array with an element out of range (checked like a number)",
        lambda: od.adamw(jnp.array([1e-3, -1e-3])),
    ),
    "schedule-value-out-of-range": Case(
        "a learning-rate or weight-decay schedule whose value at a step is negative or not "
        "finite (checked by an eager `update`; under `jit` the value is traced and not checked)",
        lambda: _update(od.adamw(lambda count: -1e-3), PARAMS),
    ),
    "string-hyperparameter": Case(
        "a string (or other non-number) where a number is expected",
        lambda: od.lion("1e-4"),
    ),
    "eps-negative": Case("`eps`/`eps_root` < 0", lambda: od.amsgrad(1e-3, eps=-1e-8)),
    "unknown-convention": Case(
        "an unknown `decay_convention`", lambda: od.adamw(1e-3, decay_convention="decoupled")
    ),
    "unknown-amsgrad": Case(
        "an unknown `amsgrad` (including `True`)", lambda: od.adamw(1e-3, amsgrad=True)
    ),
    "unknown-variant": Case("an unknown AMSGrad `variant`", lambda: od.amsgrad(1e-3, variant=None)),
    "choice-not-string": Case(
        "a `decay_convention`, `amsgrad` or `variant` that is not a string (e.g. a NumPy array)",
        lambda: od.adamw(1e-3, decay_convention=np.array(["lr", "schedule"])),
    ),
    "coupled-not-bool": Case(
        "`coupled` that is not a bool", lambda: od.amsgrad(1e-3, coupled="yes")
    ),
    "coupled-with-convention": Case(
        "`coupled=True` with a decay convention",
        lambda: od.amsgrad(1e-3, coupled=True, decay_convention="schedule"),
    ),
    "unknown-state-dtype": Case(
        "an unknown `state_dtype` (e.g. `jnp.int32`, `'int4'`)",
        lambda: od.adamw(1e-3, state_dtype="int4"),
    ),
    "storage-class": Case(
        "a storage class instead of a storage object (`state_dtype=od.BlockwiseInt8Storage`)",
        lambda: od.adamw(1e-3, state_dtype=od.BlockwiseInt8Storage),
    ),
    "int8-block-size": Case(
        "8-bit storage with `block_size` < 1",
        lambda: storage.BlockwiseInt8Storage(block_size=0),
    ),
    "int8-min-size": Case(
        "8-bit storage with `min_size` < 0",
        lambda: storage.BlockwiseInt8Storage(min_size=-1),
    ),
    "float-storage-dtype": Case(
        "`FloatStorage` with a dtype that is not floating (e.g. `jnp.int8`)",
        lambda: storage.FloatStorage(jnp.int8),
    ),
    "float-storage-rounding": Case(
        "`FloatStorage` with an unknown `rounding`",
        lambda: storage.FloatStorage(jnp.bfloat16, rounding="up"),
    ),
    "stochastic-rounding-dtype": Case(
        "`FloatStorage` with `rounding='stochastic'` and a dtype other than bfloat16",
        lambda: storage.FloatStorage(jnp.float16, rounding="stochastic"),
    ),
    "peak-lr-unused-but-invalid": Case(
        "`peak_learning_rate` invalid where the decay convention does not use it",
        lambda: od.adamw(1e-3, peak_learning_rate=-5.0),
    ),
    "schedule-without-peak": Case(
        '`decay_convention="schedule"` or `"corrected"` with a scheduled or traced learning rate '
        "and no `peak_learning_rate`",
        lambda: od.adamw(SCHED, decay_convention="schedule"),
    ),
    "peak-not-positive": Case(
        "`peak_learning_rate` <= 0",
        lambda: od.lion(SCHED, decay_convention="corrected", peak_learning_rate=0.0),
    ),
    "peak-schedule": Case(
        "a schedule for `peak_learning_rate`",
        lambda: od.adamw(SCHED, decay_convention="schedule", peak_learning_rate=SCHED),
    ),
    "decay-without-lr": Case(
        '`decoupled_weight_decay` without `learning_rate` (conventions other than `"constant"`)',
        lambda: od.decoupled_weight_decay(0.1),
    ),
    "mask-string": Case("a mask string other than `'auto'`", lambda: od.adamw(1e-3, mask="all")),
    "mask-missing-leaf": Case(
        "a mask pytree without an entry for a parameter",
        lambda: od.adamw(1e-3, mask={"w": True}).init(PARAMS),
    ),
    "mask-extra-leaf": Case(
        "a mask pytree with an entry that is not a parameter",
        lambda: od.adamw(1e-3, mask={"w": True, "b": False, "c": True}).init(PARAMS),
    ),
    "mask-not-bool": Case(
        "a mask leaf that is not a Python bool (e.g. an array)",
        lambda: od.adam_l2(1e-3, weight_decay=0.1, mask={"w": jnp.ones(()), "b": False}).init(
            PARAMS
        ),
    ),
    "mask-single-value": Case(
        "a single bool as the mask of a pytree (or, inside `optax.inject_hyperparams`, a "
        "callable mask not in `static_args`)",
        lambda: od.adamw(1e-3, mask=False).init(PARAMS),
    ),
    "mask-callable-mismatch": Case(
        "a mask callable whose result does not match the parameters",
        lambda: od.lion(1e-4, mask=lambda p: {"w": True}).init(PARAMS),
    ),
    "decay-mask-regex": Case(
        "an invalid regular expression in `decay_mask`", lambda: od.decay_mask(include="(")
    ),
    "decay-mask-default": Case(
        "`decay_mask(default=...)` other than `'auto'`/`'all'`",
        lambda: od.decay_mask(default="none"),
    ),
    "integer-params": Case(
        "integer or bool parameter leaves",
        lambda: od.adamw(1e-3).init({"w": jnp.ones((2, 2)), "steps": jnp.zeros(3, jnp.int32)}),
    ),
    "complex-params-low-precision": Case(
        "complex parameter leaves with a `state_dtype` (complex ones need `state_dtype=None`)",
        lambda: od.lion(1e-4, state_dtype="bfloat16").init({"z": jnp.ones((2, 2), jnp.complex64)}),
    ),
    "update-without-params": Case(
        "`update(grads, state)` without the parameters (every decaying alias needs them)",
        lambda: _update(od.adamw(1e-3), PARAMS, with_params=False),
    ),
    "grads-missing-leaf": Case(
        "gradients with fewer leaves than the parameters",
        lambda: _update(od.adamw(1e-3), {"w": jnp.ones((2, 3))}),
    ),
    "grads-renamed-leaf": Case(
        "gradients with other keys than the parameters",
        lambda: _update(od.amsgrad(1e-3), {"w": jnp.ones((2, 3)), "c": jnp.ones(3)}),
    ),
    "grads-other-container": Case(
        "gradients in another container type (a list for a dict)",
        lambda: _update(od.lion(1e-4), [jnp.ones((2, 3)), jnp.ones(3)]),
    ),
    "grads-incompatible-shape": Case(
        "a gradient leaf whose shape does not broadcast to its parameter's",
        lambda: _update(od.adamw(1e-3), {"w": jnp.ones((2, 4)), "b": jnp.ones(3)}),
    ),
    "grads-broadcastable-shape": Case(
        "a gradient leaf whose shape only broadcasts to its parameter's ((3,) for (2, 3))",
        lambda: _update(od.adamw(1e-3), {"w": jnp.ones((3,)), "b": jnp.ones(3)}),
    ),
    "hyperparameter-shape": Case(
        "an array hyperparameter whose shape does not broadcast to a parameter's without "
        "changing it ((3, 1) against (2, 3); checked by `update` on the leaves it applies to, "
        "traced arrays too; a schedule's value on the scaled updates)",
        lambda: _update(
            od.adamw(1e-3, weight_decay=jnp.full((3, 1), 0.1)),
            {"w": jnp.ones((2, 3)), "b": jnp.ones(3)},
        ),
    ),
    "packed-other-params": Case(
        "`od.contrib.packed`: parameters other than those `init` was given (another shape, "
        "dtype or structure; also when their leaves would fill the same buffers)",
        lambda: od.contrib.packed(od.adamw)(1e-3).update(
            {"a": jnp.ones(5), "b": jnp.ones(3)},
            od.contrib.packed(od.adamw)(1e-3).init({"a": jnp.ones(3), "b": jnp.ones(5)}),
            {"a": jnp.ones(5), "b": jnp.ones(3)},
        ),
    ),
    "packed-grads-shape": Case(
        "`od.contrib.packed`: a gradient leaf of another shape than its parameter (a transposed "
        "one too)",
        lambda: _update(
            od.contrib.packed(od.adamw)(1e-3), {"w": jnp.ones((3, 2)), "b": jnp.ones(3)}
        ),
    ),
    "grads-shape-8bit": Case(
        "a gradient leaf that fills another number of blocks than its 8-bit moment, `update` "
        "without `params` (8-bit moments keep no shape: a size that fills the same blocks, "
        "e.g. 400 for 300 with blocks of 256, passes; with `params`, as the aliases call it, "
        "any other shape is named as above)",
        lambda: _update(
            od.scale_by_adam(state_dtype=storage.BlockwiseInt8Storage(block_size=4, min_size=0)),
            {"w": jnp.ones((3, 3)), "b": jnp.ones(3)},
            with_params=False,
        ),
    ),
}

#: The messages a user can get from the core for bad input (the fuzz allows exactly these).
DOCUMENTED = [
    r"^`\w+` must be a finite number >= 0, got ",
    r"^`\w+` must be a finite number > 0, got ",
    r"^`\w+` must be a number, a schedule or an array, got the bool ",
    r"^`\w+` must lie in \[0, 1\), got ",
    r"^`\w+` must be a number or an array, not a schedule; only the learning rate",
    r"^every element of `\w+` must (be a finite number|lie in)",
    r"^`\w+` must be a number, a schedule or an array of numbers, got ",
    r"^`dtype` of FloatStorage must be a floating dtype",
    r"^`\w+` must be 'auto', None, a decay_mask\(...\), a pytree of bools",
    r"^\w+: the update at .* but the 8-bit .* holds \d+ blocks of",
    r"^`\w+` must be one of \(",
    r"^`coupled` must be a bool, got ",
    r"^`decay_convention`/`peak_learning_rate` apply to decoupled decay only",
    r"^`state_dtype` must be None \(the parameter dtype\)",
    r"^`state_dtype` got the class \w+, not a storage object",
    r"^`block_size` must be a positive int",
    r"^`min_size` must be a non-negative int",
    r"^`rounding`='stochastic' is implemented for bfloat16 storage only",
    r"^The decay convention '\w+' divides by the peak learning rate",
    r"^`peak_learning_rate` must be a number or an array, not a schedule",
    r"^convention='\w+' needs `learning_rate`",
    r"^`\w+` string must be 'auto', got ",
    r"^`\w+` does not match the parameters: ",
    r"^`\w+` leaf at '.*' must be a Python bool",
    r"^`(include|exclude)` pattern",
    r"^`default` must be 'auto' or 'all'",
    r"^\w+: parameter .* has dtype ",
    r"^`state_dtype`=.* cannot keep the moments of the complex parameter ",
    r"^\w+ needs the current parameters: call update\(updates, state, params\)",
    r"^pytree structure error: ",  # JAX's tree utilities, naming the key path
    r"^Custom node type mismatch",  # JAX, for NamedTuple/dataclass containers
    r"^\w+: the update at .* has shape .* but the .* has shape",
    r"^packed: the (parameter|gradient) at .* has shape ",
    r"^packed: the (parameters|gradients) have the structure ",
    r"^\w+: `\w+` has shape .*, which does not broadcast to the update at ",
    r"^scale_by_learning_rate: `learning_rate` \(a schedule\) changed the shape of the update",
]


def documented(err: BaseException, patterns: Sequence[str] = DOCUMENTED) -> bool:
    return any(re.search(p, str(err)) for p in patterns)


def excerpt(err: BaseException, width: int = 120) -> str:
    """The message as the table shows it: its first line, cut at ``width`` characters."""
    line = str(err).splitlines()[0].strip() if str(err) else ""
    line = re.sub(r" at 0x[0-9a-f]+", "", line)
    line = re.sub(r"'/[^']*'", "'<dir>'", line)  # temporary directories
    if len(line) > width:
        line = line[: width - 1].rstrip() + "…"
    return line.replace("|", "\\|")


def trigger(case: Case) -> BaseException:
    with pytest.raises(case.error) as info:
        case.trigger()
    return info.value


def table_rows(cases: dict[str, Case], module: str, test: str) -> list[str]:
    """The markdown rows of ``cases``, messages produced by actually triggering each case."""
    rows = []
    for name, case in cases.items():
        err = trigger(case)
        rows.append(
            f"| {case.what} | `{type(err).__name__}` | {excerpt(err)} | "
            f"`{module}::{test}[{name}]` |"
        )
    return rows


def doc_rows(module: str) -> dict[str, str]:
    """The table rows of docs/bad_input.md whose test lives in ``module``, by case name."""
    rows = {}
    for line in DOC.read_text(encoding="utf-8").splitlines():
        m = re.search(rf"`{re.escape(module)}::\w+\[([\w-]+)\]`", line)
        if line.startswith("|") and m:
            rows[m.group(1)] = line.strip()
    return rows


@pytest.mark.parametrize("name", list(CASES))
def test_documented_bad_input(name):
    err = trigger(CASES[name])
    assert documented(err), f"{name}: undocumented message {err}"


def test_docs_table_is_current():
    expected = dict(
        zip(CASES, table_rows(CASES, "test_fuzz.py", "test_documented_bad_input"), strict=True)
    )
    assert doc_rows("test_fuzz.py") == expected, "regenerate with: python tests/test_fuzz.py"


def test_python_float_gradient_leaves():
    params = {"a": 1.0}
    updates, _ = _update(od.adamw(1e-3, mask=None), {"a": 0.5}, params)
    assert np.isfinite(float(updates["a"]))


@pytest.mark.parametrize("convention", ["schedule", "corrected"])
def test_zero_constant_learning_rate_with_relative_convention(convention):
    """A constant learning rate is its own peak: the ratio eta/eta_peak is exactly 1, also for
    eta = 0 (no 0/0). With g = 0: "schedule" decays by wd, "corrected" by wd * eta = 0."""
    params = {"w": jnp.ones((2, 3))}
    tx = od.adamw(0.0, weight_decay=0.1, decay_convention=convention, mask=None)
    updates, _ = tx.update({"w": jnp.zeros((2, 3))}, tx.init(params), params)
    expected = -0.1 if convention == "schedule" else 0.0
    np.testing.assert_allclose(updates["w"], expected, rtol=1e-6)


# ---------------------------------------------------------------------------------------------
# The fuzz.
# ---------------------------------------------------------------------------------------------

INT8_ALL = storage.BlockwiseInt8Storage(block_size=4, min_size=0)
NAMES = ["kernel", "bias", "w", "scale", "A_log", "embedding", "D", "layers", "0", "x"]
GOOD_DTYPES = ["float32", "bfloat16", "float16"]
BAD_DTYPES = ["int32", "bool", "complex64"]


def _leaf_spec():
    shape = st.lists(st.integers(0, 3), max_size=3).map(tuple)
    dtype = st.sampled_from(GOOD_DTYPES * 8 + BAD_DTYPES)  # a bad leaf dtype about 1 in 9
    array = st.tuples(shape, dtype)
    return st.one_of(array, array, array, st.none())  # None leaves about 1 in 4


SUBTREES = st.recursive(
    _leaf_spec(),
    lambda children: st.one_of(
        st.dictionaries(st.sampled_from(NAMES), children, min_size=1, max_size=3),
        st.lists(children, min_size=1, max_size=3),
        st.lists(children, max_size=2).map(tuple),
        st.just({}),
    ),
    max_leaves=5,
)
TREES = st.one_of(
    st.dictionaries(st.sampled_from(NAMES), SUBTREES, min_size=1, max_size=3),
    st.lists(SUBTREES, min_size=1, max_size=3),
    SUBTREES,
)


def _materialise(spec, rng):
    if spec is None:
        return None
    if isinstance(spec, dict):
        return {k: _materialise(v, rng) for k, v in spec.items()}
    if isinstance(spec, list):
        return [_materialise(v, rng) for v in spec]
    if isinstance(spec, tuple) and len(spec) == 2 and isinstance(spec[1], str):
        shape, dtype = spec
        x = rng.standard_normal(shape).astype(np.float32)
        return jnp.asarray(x * 3 if dtype != "bool" else x > 0, dtype)
    return tuple(_materialise(v, rng) for v in spec)


def _sched(count):
    return 1e-3 * jnp.exp(-1e-3 * count)


# Sane values (finite results expected) first, then the bad ones.
GOOD = {
    "learning_rate": [1e-3, 0.1, 0.0, _sched, "array"],
    "weight_decay": [0.0, 0.1, 1.0, _sched, "array"],
    "b1": [0.0, 0.9, 0.5],
    "b2": [0.0, 0.99, 0.999],
    "eps": [1e-8, 1e-3],
    "eps_root": [0.0, 1e-8],
    "amsgrad": [None, "pytorch", "optax", "paper"],
    "variant": ["pytorch", "optax", "paper"],
    "coupled": [False, True],
    "decay_convention": list(od.DECAY_CONVENTIONS),
    "peak_learning_rate": [None, 1e-3, 0.1],
    "mask": ["auto", None, "all-true", "decay_mask", "callable"],
    "state_dtype": [None, "float32", "bfloat16", "float16", "int8", INT8_ALL],
}
BAD = {
    "learning_rate": [-1e-3, math.nan, math.inf, True],
    "weight_decay": [-0.1, math.nan, -math.inf, True],
    "b1": [1.0, -0.1, math.nan, 1.5, _sched, True],
    "b2": [1.0, -1e-9, math.nan, _sched],
    "eps": [-1e-8, math.nan, math.inf, 0.0],
    "eps_root": [-1.0, math.inf],
    "amsgrad": ["keras", True, 1],
    "variant": [None, "torch"],
    "coupled": ["yes", 1],
    "decay_convention": ["decoupled", None],
    "peak_learning_rate": [0.0, -1.0, math.nan, _sched],
    "mask": ["all", "missing-leaf", "extra-leaf", "array-leaf"],
    "state_dtype": ["int4", "float8", "int32"],
}
ALIAS_ARGS = {
    "adamw": ["b1", "b2", "eps", "eps_root", "amsgrad", "decay_convention", "peak_learning_rate"],
    "adam_l2": ["b1", "b2", "eps", "eps_root", "amsgrad"],
    "amsgrad": [
        "b1", "b2", "eps", "eps_root", "variant", "coupled", "decay_convention",
        "peak_learning_rate",
    ],
    "lion": ["b1", "b2", "decay_convention", "peak_learning_rate"],
}  # fmt: skip
ALIASES = {"adamw": od.adamw, "adam_l2": od.adam_l2, "amsgrad": od.amsgrad, "lion": od.lion}


def _mask(kind, params):
    leaves_true = lambda: jax.tree.map(lambda _: True, params)  # noqa: E731
    if kind == "all-true":
        return leaves_true()
    if kind == "decay_mask":
        return od.decay_mask(exclude=r"bias$")
    if kind == "callable":
        return lambda p: jax.tree.map(lambda x: jnp.ndim(x) >= 2, p)
    if kind == "missing-leaf":
        return {"__nothing__": True} if jax.tree.leaves(params) else {"__extra__": True}
    if kind == "extra-leaf":
        return [leaves_true(), True]
    if kind == "array-leaf":
        return jax.tree.map(lambda _: jnp.ones((), bool), params) or {"a": jnp.ones((), bool)}
    return kind  # "auto", None, "all"


@st.composite
def hyperparameters(draw, alias):
    names = ["learning_rate", "weight_decay", "mask", "state_dtype", *ALIAS_ARGS[alias]]
    values, sane = {}, True
    for name in names:
        if draw(st.integers(0, 14)) == 0:  # about one bad value in fifteen
            values[name], sane = draw(st.sampled_from(BAD[name])), False
        else:
            values[name] = draw(st.sampled_from(GOOD[name]))
    return values, sane


@st.composite
def problems(draw):
    alias = draw(st.sampled_from(sorted(ALIASES)))
    hp, sane = draw(hyperparameters(alias))
    return alias, hp, sane, draw(TREES), draw(st.integers(0, 2**16)), draw(st.integers(0, 19))


def _leaf_dtypes(params) -> set[str]:
    return {jnp.result_type(x).name for x in jax.tree.leaves(params)}


def _finite_expected(hp, alias, params, sane):
    """Whether the settings are sane enough that the updates must be finite."""
    if not sane:
        return False
    dtypes = _leaf_dtypes(params)
    # float16 moments cannot hold g**2 for |g| < 2.4e-4 nor eps = 1e-8 (both round to 0).
    low_precision_state = hp["state_dtype"] in (None, "float16") and "float16" in dtypes
    low_precision_state |= hp["state_dtype"] == "float16"
    return not low_precision_state


#: Documented errors that settings valid one by one may still raise together: a relative decay
#: convention with a schedule and no peak learning rate; a decay convention (or a peak) for
#: AMSGrad's coupled L2.
COMBINATION_ERRORS = (
    r"^The decay convention '\w+' divides by the peak learning rate",
    r"^`decay_convention`/`peak_learning_rate` apply to decoupled decay only",
)


def _must_run(sane, params, grads_mode):
    """Whether every setting, leaf dtype and the gradients' structure is valid and there are
    parameters (a tree that is one ``None`` leaf is no parameters: ``update`` refuses it), so
    that only a :data:`COMBINATION_ERRORS` error may be raised."""
    valid_tree = params is not None and _leaf_dtypes(params) <= set(GOOD_DTYPES)
    return sane and grads_mode != 7 and valid_tree


def _run(alias, hp, sane, params, seed, grads_mode):
    kwargs = dict(hp)
    if kwargs["learning_rate"] == "array":
        kwargs["learning_rate"] = jnp.asarray(1e-3)
    if kwargs["weight_decay"] == "array":
        kwargs["weight_decay"] = jnp.asarray(0.1)
    kwargs["mask"] = _mask(kwargs["mask"], params)
    mismatched = grads_mode == 7  # one example in twenty: gradients of another structure
    rng = np.random.default_rng(seed)
    try:
        tx = ALIASES[alias](**kwargs)
        state = tx.init(params)
        for t in range(2):
            grads = jax.tree.map(
                lambda p, t=t: jnp.asarray(rng.standard_normal(jnp.shape(p)) * (t + 1), p.dtype),
                params,
            )
            if mismatched:
                grads = [grads, jnp.ones(2)]
            updates, state = tx.update(grads, state, params)
            assert jax.tree.structure(updates) == jax.tree.structure(grads)
            for u, g in zip(jax.tree.leaves(updates), jax.tree.leaves(grads), strict=True):
                assert u.shape == g.shape and u.dtype == g.dtype, (u, g)
                if _finite_expected(hp, alias, params, sane):
                    assert bool(jnp.all(jnp.isfinite(u))), (u, hp)
            params = optax.apply_updates(params, updates)
    except ValueError as err:
        assert documented(err), f"undocumented ValueError: {err}"
        if _must_run(sane, params, grads_mode):  # e.g. not a valid b2 refused
            message = f"valid settings raised: {err} ({alias}, {hp})"
            assert documented(err, COMBINATION_ERRORS), message
        return "error"
    return "ok"


@settings(
    # 6x the profile's count (tests/conftest.py): 36 in the unit tier, 300 in the thorough one.
    max_examples=int(os.environ.get("FUZZ_EXAMPLES", 6 * settings.default.max_examples)),
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(problem=problems())
def test_fuzz_aliases(problem):
    alias, hp, sane, spec, seed, grads_mode = problem
    params = _materialise(spec, np.random.default_rng(seed))
    outcome = _run(alias, hp, sane, params, seed, grads_mode)
    event(f"{outcome} ({'sane' if sane else 'bad hyperparameter'})")
    event(f"{len(jax.tree.leaves(params))} leaves")


def test_fuzz_reaches_both_outcomes():
    """The fuzz's generators produce valid configurations as well as documented errors."""
    rng = np.random.default_rng(0)
    params = {"w": jnp.ones((2, 3)), "bias": jnp.ones(3)}
    good = {n: v[0] for n, v in GOOD.items()}
    assert _run("adamw", {k: good[k] for k in ["learning_rate", "weight_decay", "mask",
        "state_dtype", *ALIAS_ARGS["adamw"]]}, True, params, 0, 1) == "ok"  # fmt: skip
    bad = {k: good[k] for k in ["learning_rate", "weight_decay", "mask", "state_dtype",
        *ALIAS_ARGS["lion"]]}  # fmt: skip
    bad["b1"] = BAD["b1"][rng.integers(len(BAD["b1"]))]
    assert _run("lion", bad, False, params, 0, 1) == "error"


if __name__ == "__main__":  # print the table rows of docs/bad_input.md for these cases
    print("\n".join(table_rows(CASES, "test_fuzz.py", "test_documented_bad_input")))
