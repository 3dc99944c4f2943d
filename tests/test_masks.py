"""Weight-decay masks: the "auto" rule, user forms, structures (Linen dicts, NNX, NamedTuples)."""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_decoupled as od
from optax_decoupled._src import masks


def linen_params():
    """A Linen-style parameter dict with every kind of leaf the "auto" rule knows."""
    z = jnp.zeros
    return {
        "Embed_0": {"embedding": z((10, 4))},
        "Dense_0": {"kernel": z((4, 8)), "bias": z((8,))},
        "LayerNorm_0": {"scale": z((8,)), "bias": z((8,))},
        "mixer": {
            "A_log": z((2,)),
            "D": z((2,)),
            "dt_bias": z((2,)),
            "conv1d": {"kernel": z((4, 1, 8)), "bias": z((8,))},
        },
        "RMSNorm_0": {"weight": z((8,))},
        "final_norm": {"kernel_like": z((8, 8))},  # 2-D but under a norm module
        "head": {"w": z((8, 3)), "b": z((3,))},
        "temperature": z(()),
    }


def flat(tree):
    return {masks.path_string(p): v for p, v in jax.tree_util.tree_flatten_with_path(tree)[0]}


def test_auto_mask_decays_weight_matrices_only():
    got = flat(od.resolve_mask("auto", linen_params()))
    decayed = sorted(k for k, v in got.items() if v)
    assert decayed == ["Dense_0/kernel", "head/w", "mixer/conv1d/kernel"]
    assert all(isinstance(v, bool) for v in got.values())


def test_name_rules_win_over_ndim_rule():
    # A 2-D A_log and scan-stacked biases / norm scales (leading layer axis) stay excluded.
    params = {
        "layers": {
            "A_log": jnp.zeros((3, 2)),
            "D": jnp.zeros((3, 2)),
            "dt_bias": jnp.zeros((3, 2)),
            "in_proj": {"kernel": jnp.zeros((3, 4, 4)), "bias": jnp.zeros((3, 4))},
            "norm": {"scale": jnp.zeros((3, 4))},
        }
    }
    got = flat(od.resolve_mask("auto", params))
    assert [k for k, v in got.items() if v] == ["layers/in_proj/kernel"]


def test_none_decays_everything():
    assert all(flat(od.resolve_mask(None, linen_params())).values())


def test_pytree_and_callable_masks():
    params = {"a": jnp.zeros((2, 2)), "b": jnp.zeros((2,))}
    tree = {"a": False, "b": True}
    assert od.resolve_mask(tree, params) == tree
    assert od.resolve_mask(lambda p: jax.tree.map(lambda x: x.ndim == 1, p), params) == tree
    assert od.resolve_mask({"a": np.bool_(True), "b": False}, params) == {"a": True, "b": False}


def test_decay_mask_rules():
    params = linen_params()
    only_head = flat(od.resolve_mask(od.decay_mask(include=r"^head/"), params))
    assert sorted(k for k, v in only_head.items() if v) == ["head/b", "head/w"]
    no_head = flat(od.resolve_mask(od.decay_mask(exclude=r"^head/"), params))
    assert sorted(k for k, v in no_head.items() if v) == ["Dense_0/kernel", "mixer/conv1d/kernel"]
    all_but_bias = flat(od.resolve_mask(od.decay_mask(exclude="bias$", default="all"), params))
    assert not all_but_bias["Dense_0/bias"] and all_but_bias["LayerNorm_0/scale"]
    # exclude wins over include
    both = flat(od.resolve_mask(od.decay_mask(include="kernel", exclude="conv1d"), params))
    assert sorted(k for k, v in both.items() if v) == ["Dense_0/kernel", "final_norm/kernel_like"]


def test_decay_mask_bad_arguments():
    with pytest.raises(ValueError, match="`include` pattern"):
        od.decay_mask(include="(")
    with pytest.raises(ValueError, match="`default`"):
        od.decay_mask(default="some")
    with pytest.raises(ValueError, match="`exclude` patterns must be strings"):
        od.decay_mask(exclude=[3])


class Params(NamedTuple):
    kernel: jax.Array
    bias: jax.Array


def test_namedtuple_params():
    params = Params(jnp.zeros((2, 3)), jnp.zeros((3,)))
    assert od.resolve_mask("auto", params) == Params(True, False)
    assert od.resolve_mask(Params(False, True), params) == Params(False, True)


def test_mismatched_mask_names_the_first_missing_path():
    params = {"enc": {"kernel": jnp.zeros((2, 2)), "bias": jnp.zeros((2,))}}
    with pytest.raises(ValueError, match="'enc/bias' is a parameter but has no entry"):
        od.resolve_mask({"enc": {"kernel": True}}, params)
    with pytest.raises(ValueError, match="'enc/extra'.*not a parameter"):
        od.resolve_mask({"enc": {"kernel": True, "bias": False, "extra": True}}, params)
    with pytest.raises(ValueError, match="'enc/kernel' must be a Python bool"):
        od.resolve_mask({"enc": {"kernel": jnp.array([True]), "bias": False}}, params)
    # The same errors surface from a transform's init.
    tx = od.adamw(1e-3, mask={"enc": {"kernel": True}})
    with pytest.raises(ValueError, match="'enc/bias'"):
        tx.init(params)


def test_a_prefix_mask_applies_to_every_leaf_below_its_entries():
    """Optax's masks may be a prefix of the parameter tree; this package's rejected them
    ("'enc/bias' is a parameter but has no entry") although the migration guide says
    ``optax.adamw(..., mask=m)`` carries over."""
    params = {
        "enc": {"kernel": jnp.full((2, 3), 2.0), "bias": jnp.full((3,), 3.0)},
        "head": {"kernel": jnp.full((3, 1), 4.0), "bias": jnp.full((1,), 5.0)},
    }
    prefix = {"enc": True, "head": False}
    want = {"enc": {"kernel": True, "bias": True}, "head": {"kernel": False, "bias": False}}
    assert od.resolve_mask(prefix, params) == want
    assert od.resolve_mask(lambda p: prefix, params) == want
    # Mixed depths: one subtree by prefix, the other leaf by leaf.
    mixed = {"enc": False, "head": {"kernel": True, "bias": False}}
    assert od.resolve_mask(mixed, params)["head"] == {"kernel": True, "bias": False}
    assert od.resolve_mask(mixed, params)["enc"] == {"kernel": False, "bias": False}
    grads = jax.tree.map(lambda p: jnp.linspace(0.5, 1.5, p.size).reshape(p.shape), params)
    ours = od.adamw(1e-2, weight_decay=0.5, mask=prefix)
    ref = optax.adamw(1e-2, weight_decay=0.5, mask=prefix)
    got, _ = ours.update(grads, ours.init(params), params)
    expected, _ = ref.update(grads, ref.init(params), params)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), got, expected)
    # A prefix entry that names no node of the parameters is still an error.
    with pytest.raises(ValueError, match="entry at 'dec'.*not a parameter or a node"):
        od.resolve_mask({"enc": True, "head": False, "dec": True}, params)
    # ... and one below a parameter leaf (the mask is deeper than the parameters).
    with pytest.raises(ValueError, match="'head/bias' is a parameter but has no entry"):
        od.resolve_mask({"enc": True, "head": {"kernel": True, "bias": {"x": True}}}, params)


def test_a_prefix_mask_over_an_nnx_state():
    nnx = pytest.importorskip("flax.nnx")

    class Block(nnx.Module):
        def __init__(self, rngs):
            self.enc = nnx.Linear(2, 3, rngs=rngs)
            self.head = nnx.Linear(3, 1, rngs=rngs)

    state = nnx.state(Block(nnx.Rngs(0)), nnx.Param)
    resolved = od.resolve_mask({"enc": True, "head": False}, state)
    flags = {masks.path_string(p): v for p, v in jax.tree_util.tree_leaves_with_path(resolved)}
    assert flags == {"enc/bias": True, "enc/kernel": True, "head/bias": False, "head/kernel": False}


def test_mask_entries_over_empty_parameter_nodes_are_ignored():
    """A full-structure mask still fits where the parameters hold None or optax.MaskedNode
    (inside optax.masked and optax.multi_transform), as Optax's masks do."""
    params = {"w": jnp.ones((2, 2)), "b": jnp.ones((2,)), "frozen": jnp.ones((3, 3))}
    decay = {"w": True, "b": False, "frozen": True}
    with_none = {**params, "frozen": None}
    assert od.resolve_mask(decay, with_none) == {"w": True, "b": False, "frozen": None}
    grads = jax.tree.map(jnp.ones_like, params)
    labels = {"w": "a", "b": "a", "frozen": "z"}
    ours = optax.multi_transform(
        {"a": od.adamw(1e-2, mask=decay), "z": optax.set_to_zero()}, labels
    )
    ref = optax.multi_transform(
        {"a": optax.adamw(1e-2, weight_decay=1e-2, mask=decay), "z": optax.set_to_zero()}, labels
    )
    got, _ = ours.update(grads, ours.init(params), params)
    want, _ = ref.update(grads, ref.init(params), params)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), got, want)
    # Entries the parameters do have must still be there.
    with pytest.raises(ValueError, match="'b' is a parameter but has no entry"):
        od.resolve_mask({"w": True, "frozen": True}, with_none)


@pytest.mark.parametrize(
    "make",
    [
        lambda: od.adamw(1e-2, mask=False),
        # A plain callable inside inject_hyperparams is called as a schedule (with the count).
        lambda: optax.inject_hyperparams(od.adamw)(1e-2, mask=lambda p: jax.tree.map(bool, p)),
    ],
    ids=["bool", "inject-callable"],
)
def test_a_single_value_mask_says_what_a_mask_is(make):
    params = {"w": jnp.ones((2, 2)), "b": jnp.ones((2,))}
    with pytest.raises(ValueError, match=r"got the single value .*static_args=\('mask',\)"):
        make().init(params)
    assert od.resolve_mask(True, jnp.ones((2, 2))) is True  # one leaf, one entry: fine


def test_unknown_mask_string():
    with pytest.raises(ValueError, match="`mask` string must be 'auto'"):
        od.adamw(1e-3, mask="all")


@pytest.mark.parametrize(
    "make",
    [
        lambda m: od.adamw(0.1, weight_decay=0.5, mask=m),
        lambda m: od.lion(0.1, weight_decay=0.5, mask=m),
        lambda m: od.amsgrad(0.1, weight_decay=0.5, mask=m),
    ],
    ids=["adamw", "lion", "amsgrad"],
)
def test_masked_leaves_are_not_decayed(make):
    """With zero gradients only the decay moves parameters: exactly the masked-in ones."""
    params = linen_params()
    params = jax.tree.map(lambda x: jnp.ones_like(x), params)
    tx = make("auto")
    state = tx.init(params)
    grads = jax.tree.map(jnp.zeros_like, params)
    for _ in range(3):
        updates, state = tx.update(grads, state, params)
        params = optax.apply_updates(params, updates)
    want = flat(od.resolve_mask("auto", params))
    for path, leaf in flat(params).items():
        expected = (1 - 0.1 * 0.5) ** 3 if want[path] else 1.0
        np.testing.assert_allclose(np.asarray(leaf), expected, rtol=1e-6, err_msg=path)


def test_coupled_l2_respects_mask():
    params = {"w": jnp.ones((2, 2)), "bias": jnp.ones((2,))}
    grads = jax.tree.map(jnp.zeros_like, params)
    tx = od.add_l2_gradient(0.3)
    out, _ = tx.update(grads, tx.init(params), params)
    np.testing.assert_allclose(out["w"], 0.3)
    np.testing.assert_allclose(out["bias"], 0.0)


def test_nnx_model_with_ssm_parameters():
    """`nnx.Optimizer(model, adamw(...), wrt=nnx.Param)` decays the kernels and nothing else."""
    nnx = pytest.importorskip("flax.nnx")

    class Block(nnx.Module):
        def __init__(self, rngs):
            self.in_proj = nnx.Linear(4, 6, rngs=rngs)
            self.A_log = nnx.Param(jnp.log(jnp.arange(1.0, 4.0)))
            self.D = nnx.Param(jnp.ones((3,)))
            self.dt_bias = nnx.Param(jnp.full((3,), -2.0))
            self.norm = nnx.RMSNorm(6, rngs=rngs)
            self.embed = nnx.Embed(5, 4, rngs=rngs)

    model = Block(nnx.Rngs(0))
    before = {masks.path_string(p): np.asarray(v) for p, v in _nnx_leaves(nnx, model)}
    lr, wd, steps = 0.1, 0.2, 4
    opt = nnx.Optimizer(model, od.adamw(lr, weight_decay=wd), wrt=nnx.Param)

    @nnx.jit
    def step(model, opt):
        grads = jax.tree.map(jnp.zeros_like, nnx.state(model, nnx.Param))
        opt.update(model, grads)

    for _ in range(steps):
        step(model, opt)
    after = {masks.path_string(p): np.asarray(v) for p, v in _nnx_leaves(nnx, model)}
    assert set(after) == {
        "in_proj/kernel", "in_proj/bias", "A_log", "D", "dt_bias", "norm/scale",
        "embed/embedding",
    }  # fmt: skip
    for path, value in after.items():
        factor = (1 - lr * wd) ** steps if path == "in_proj/kernel" else 1.0
        np.testing.assert_allclose(value, before[path] * factor, rtol=1e-6, err_msg=path)


def _nnx_leaves(nnx, model):
    return jax.tree_util.tree_flatten_with_path(nnx.state(model, nnx.Param))[0]


def test_auto_mask_that_decays_nothing_is_warned_about():
    """optax.flatten hands the transform one 1-D vector, which mask="auto" never decays: the
    weight decay would silently do nothing. init says so; a tree with a decayed leaf, a zero
    weight decay or an explicit mask do not warn."""
    import warnings

    params = {"w": jnp.ones((4, 4)), "b": jnp.ones(4)}
    for make in (od.adamw, od.adam_l2, od.lion):
        with pytest.warns(UserWarning, match="mask='auto' decays none of these parameters"):
            optax.flatten(make(1e-2, weight_decay=0.5)).init(params)
    quiet = [
        lambda: od.adamw(1e-2, weight_decay=0.5).init(params),
        lambda: od.adamw(1e-2, weight_decay=0.0).init({"b": jnp.ones(4)}),
        lambda: od.adamw(1e-2, weight_decay=jnp.float32(0)).init({"b": jnp.ones(4)}),
        lambda: optax.inject_hyperparams(od.adamw)(learning_rate=1e-3, weight_decay=0.0).init(
            {"b": jnp.ones(4)}
        ),
        lambda: optax.flatten(od.adamw(1e-2, weight_decay=0.5, mask=None)).init(params),
    ]
    for init in quiet:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            init()
        assert not [w for w in seen if "decays none" in str(w.message)]


def test_auto_name_rules_look_at_the_leaf_and_the_module_holding_it():
    """Exact names (``D``, ``b``, ``beta``, ``scale``, ...) are the leaf's own name only, so a
    module named ``D`` (a GAN's discriminator) or ``b`` is decayed; a module excludes its leaves
    only by a whole word of its name (``norm``, ``embed...``, ``bias``), and only the module
    holding the leaf: ``denormalizer`` or a ``PreNorm_0`` wrapper do not."""
    z = jnp.zeros
    params = {
        "G": {"Dense_0": {"kernel": z((4, 4)), "bias": z((4,))}},
        "D": {"Dense_0": {"kernel": z((4, 4)), "bias": z((4,))}},
        "b": {"w": z((4, 4))},
        "beta_vae_encoder": {"kernel": z((4, 4))},
        "scale_net": {"kernel": z((4, 4))},
        "denormalizer": {"kernel": z((4, 4))},
        "abnormal_head": {"kernel": z((4, 4))},
        "lm_head_unembed": {"kernel": z((4, 4))},
        "PreNorm_0": {"Dense_0": {"kernel": z((4, 4))}, "LayerNorm_0": {"scale": z((4,))}},
        # Still excluded: by the leaf's own name, also behind list indices ...
        "ssm": {"D": [z((3, 2)), z((3, 2))], "A_log": z((3, 2))},
        "gain": {"scale": z((3, 4))},
        # ... and by the module holding it (Equinox / PyTorch-style names, scan-stacked).
        "embedding": {"weight": z((10, 4))},
        "embed_tokens": {"weight": z((10, 4))},
        "word_embeddings": {"weight": z((10, 4))},
        "layers": [{"norm": {"weight": z((3, 4))}, "input_layernorm": {"weight": z((3, 4))}}],
        "norm1": {"weight": z((3, 4))},
        "RMSNorm_0": {"weight": z((3, 4))},
        "relative_attention_bias": {"weight": z((32, 4))},
    }
    got = flat(od.resolve_mask("auto", params))
    assert sorted(k for k, v in got.items() if v) == [
        "D/Dense_0/kernel", "G/Dense_0/kernel", "PreNorm_0/Dense_0/kernel",
        "abnormal_head/kernel", "b/w", "beta_vae_encoder/kernel", "denormalizer/kernel",
        "lm_head_unembed/kernel", "scale_net/kernel",
    ]  # fmt: skip
    assert od.resolve_mask("auto", params) == od.resolve_mask(od.DecayMask(), params)
    assert masks.auto_no_decay_reason(("D", "Dense_0", "bias")) == "bias"
    assert masks.auto_no_decay_reason(("mixer", "D")) == "D"
    assert masks.auto_no_decay_reason(("D", "Dense_0", "kernel")) is None


def test_auto_mask_of_an_nnx_model_with_a_module_named_d():
    """nnx paths end in the variable's ``value``; the leaf's name is the one before it."""
    nnx = pytest.importorskip("flax.nnx")

    class GAN(nnx.Module):
        def __init__(self, rngs):
            self.G = nnx.Linear(2, 3, rngs=rngs)
            self.D = nnx.Linear(3, 1, rngs=rngs)
            self.b = nnx.List([nnx.Linear(3, 3, rngs=rngs)])

    model = GAN(nnx.Rngs(0))
    state = nnx.state(model, nnx.Param)
    resolved = od.resolve_mask("auto", state)
    flags = {masks.path_string(p): v for p, v in jax.tree_util.tree_leaves_with_path(resolved)}
    assert sorted(k for k, v in flags.items() if v) == ["D/kernel", "G/kernel", "b/0/kernel"]
    before = np.asarray(model.D.kernel[...])
    opt = nnx.Optimizer(model, od.adamw(0.1, weight_decay=0.5), wrt=nnx.Param)
    opt.update(model, jax.tree.map(jnp.zeros_like, nnx.state(model, nnx.Param)))
    np.testing.assert_allclose(np.asarray(model.D.kernel[...]), before * 0.95, rtol=1e-6)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"include": ("(",)}, "`include` pattern '\\(' is not a valid regex"),
        ({"exclude": ["a", 3]}, "`exclude` patterns must be strings, got 3"),
        ({"include": b"kernel"}, "`include` patterns must be a string, a sequence"),
        ({"exclude": 5}, "`exclude` patterns must be a string, a sequence"),
        ({"default": "none"}, "`default` must be 'auto' or 'all', got 'none'"),
        ({"default": None}, "`default` must be 'auto' or 'all', got None"),
    ],
)
def test_decay_mask_validates_when_constructed_directly(kwargs, match):
    with pytest.raises(ValueError, match=match):
        od.DecayMask(**kwargs)
    with pytest.raises(ValueError, match=match):
        od.decay_mask(**kwargs)


def test_decay_mask_constructed_directly_takes_a_string_as_one_pattern():
    params = {
        "enc": {"kernel": jnp.ones((2, 2)), "bias": jnp.ones(2)},
        "head": {"w": jnp.ones((2, 2))},
    }
    assert od.DecayMask(include="kernel") == od.decay_mask(include="kernel")
    assert od.DecayMask(include="kernel").include == ("kernel",)
    assert od.DecayMask(exclude=["head"]).exclude == ("head",)
    assert flat(od.resolve_mask(od.DecayMask(include="kernel"), params)) == {
        "enc/bias": False, "enc/kernel": True, "head/w": False,
    }  # fmt: skip
    assert flat(od.resolve_mask(od.DecayMask(exclude="head"), params)) == {
        "enc/bias": False, "enc/kernel": True, "head/w": False,
    }  # fmt: skip
    assert hash(od.DecayMask(include="kernel")) == hash(od.DecayMask(include=["kernel"]))


def test_mask_entries_over_empty_parameter_subtrees_are_ignored():
    """A parameter subtree without leaves (``{}``, ``()``, nested) takes any mask entry, as in
    Optax; the same entry where the parameters have no node is still an error."""
    params = {"a": jnp.ones((2, 2)), "empty": {}, "nested": {"x": {}, "y": ()}}
    mask = {"a": True, "empty": True, "nested": {"x": False, "y": True}}
    assert od.resolve_mask(mask, params) == {"a": True, "empty": {}, "nested": {"x": {}, "y": ()}}
    assert od.resolve_mask({"a": True, "empty": True, "nested": True}, params)["a"] is True
    tx, ref = (
        od.adamw(1e-3, weight_decay=0.1, mask=mask),
        optax.adamw(1e-3, weight_decay=0.1, mask=mask),
    )
    got, _ = tx.update(params, tx.init(params), params)
    want, _ = ref.update(params, ref.init(params), params)
    np.testing.assert_allclose(got["a"], want["a"], rtol=1e-6)
    with pytest.raises(ValueError, match="entry at 'empty/x'.*not a parameter or a node"):
        od.resolve_mask({"a": True, "empty": {"x": True}}, params)


def test_mask_errors_name_a_none_entry_and_list_the_mask_paths():
    params = {"enc": {"kernel": jnp.zeros((2, 2)), "bias": jnp.zeros((2,))}, "head": jnp.ones(2)}
    with pytest.raises(ValueError, match="the mask has None at 'enc', where the parameters"):
        od.resolve_mask({"enc": None, "head": True}, params)
    with pytest.raises(ValueError, match="None at 'enc/bias'"):
        od.resolve_mask({"enc": {"kernel": True, "bias": None}, "head": True}, params)
    with pytest.raises(ValueError, match=r"\(mask paths: 'enc/kernel'\)\.$"):
        od.resolve_mask({"enc": {"kernel": True}}, params)
    many = {f"k{i}": jnp.ones(2) for i in range(10)}
    with pytest.raises(ValueError, match=r"'k0', 'k1', .*'k7', \.\.\.\)\.$"):
        od.resolve_mask({f"k{i}": True for i in range(9)}, many)


def test_concrete_jax_bool_scalars_are_mask_leaves_traced_ones_are_not():
    params = {"w": jnp.ones((2, 2)), "b": jnp.ones(2)}
    got = od.resolve_mask({"w": jnp.array(True), "b": jnp.bool_(False)}, params)
    assert got == {"w": True, "b": False} and all(type(v) is bool for v in got.values())

    @jax.jit
    def traced(flag):
        with pytest.raises(ValueError, match="'w' must be a Python bool"):
            od.resolve_mask({"w": flag, "b": False}, params)
        return flag

    traced(jnp.array(True))


def test_auto_rule_reads_the_module_name_lists(monkeypatch):
    """The documented lists are what the rule uses: a name added to them is excluded."""
    components = ("encoder", "pos_table")
    assert masks.auto_decays(components, 2)
    monkeypatch.setattr(masks, "NO_DECAY_SUBSTRINGS", (*masks.NO_DECAY_SUBSTRINGS, "pos"))
    assert not masks.auto_decays(components, 2)
    assert masks.auto_no_decay_reason(components) == "pos"
    monkeypatch.setattr(masks, "NO_DECAY_NAMES", masks.NO_DECAY_NAMES | {"w"})
    assert masks.auto_no_decay_reason(("dense", "w")) == "norm"
    assert masks.auto_no_decay_reason(("LayerNorm_0", "bias")) == "norm"
    assert masks.auto_no_decay_reason(("dense", "bias")) == "bias"
