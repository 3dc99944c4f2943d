"""Which parameters get weight decay: the ``mask`` argument and its ``"auto"`` rules."""

from __future__ import annotations

import dataclasses
import functools
import re
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import numpy as np
import optax

MaskArg = Any  # "auto" | None | pytree of bools | Callable[[params], pytree] | DecayMask

#: Leaf names (exact, case-sensitive) that ``"auto"`` never decays: Mamba's SSM parameters.
SSM_NO_DECAY_NAMES = frozenset({"A_log", "D", "dt_bias"})
#: Leaf names (exact, case-insensitive) that ``"auto"`` never decays.
NO_DECAY_NAMES = frozenset({"b", "scale", "offset", "gamma", "beta"})
#: Substrings of a leaf name (case-insensitive) that ``"auto"`` never decays.
NO_DECAY_SUBSTRINGS = ("bias", "norm", "embed")

# The diagnostic group of a name in NO_DECAY_NAMES (others: "norm") or NO_DECAY_SUBSTRINGS.
_NAME_GROUPS = {"b": "bias"}
_SUBSTRING_GROUPS = {"bias": "bias", "norm": "norm", "embed": "embedding"}

_VARIABLE_VALUE_ATTRS = ("value", "raw_value")
# The words of a module name: "RMSNorm_0" -> RMS, Norm, 0; "embed_tokens" -> embed, tokens.
_WORDS = re.compile(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+|[0-9]+")


def _key_name(key: Any) -> str:
    if isinstance(key, jax.tree_util.DictKey):
        return str(key.key)
    if isinstance(key, jax.tree_util.GetAttrKey):
        return key.name
    if isinstance(key, jax.tree_util.SequenceKey):
        return str(key.idx)
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def path_components(path: tuple[Any, ...]) -> tuple[str, ...]:
    """The string components of a JAX key path (a flax.nnx variable's ``value`` dropped)."""
    names = [_key_name(k) for k in path]
    if (
        path
        and isinstance(path[-1], jax.tree_util.GetAttrKey)
        and names[-1] in _VARIABLE_VALUE_ATTRS
    ):
        names = names[:-1]
    return tuple(names)


def path_string(path: tuple[Any, ...]) -> str:
    """The ``/``-joined key path used by mask rules, e.g. ``"encoder/dense/kernel"``."""
    return "/".join(path_components(path))


def leaf_and_module_names(components: tuple[str, ...]) -> tuple[str, str]:
    """The leaf's own name and its module's (``""`` where there is none): the last two
    components that are names, not list indices (``layers/0/kernel`` -> ``kernel``,
    ``layers``; ``norm/scale/1`` -> ``scale``, ``norm``)."""
    names = [c for c in components if not c.isdigit()]
    return (names[-1] if names else "", names[-2] if len(names) > 1 else "")


#: Module-name words (lower case) that name a normalisation layer besides those ending in
#: ``norm``: GPT-2's ``ln_1``/``ln_f``, ``bn1``.
NORM_MODULE_WORDS = frozenset({"ln", "bn"})
#: Module-name words (lower case) that name an embedding table besides those starting with
#: ``embed``: GPT-2's token and position tables ``wte``, ``wpe``.
EMBEDDING_MODULE_WORDS = frozenset({"wte", "wpe"})


def _shape(shape: Any) -> tuple[int, ...] | None:
    """A shape tuple, or ``None`` where only the number of dimensions is known."""
    if isinstance(shape, tuple):
        return shape
    return None if isinstance(shape, int | np.integer) else tuple(int(d) for d in shape)


def effective_ndim(shape: Any) -> int:
    """The number of dimensions once leading axes of size 1 are dropped (an ``int`` is taken
    as the ndim itself): a learned token of shape ``(1, 1, d)`` is a vector, a ``(d, 1)``
    kernel stays a matrix."""
    dims = _shape(shape)
    if dims is None:
        return int(shape)
    while dims and dims[0] == 1:
        dims = dims[1:]
    return len(dims)


def _is_lora_factor(leaf: str, module: str) -> bool:
    """A factor of a low-rank adapter: the leaf or its module names LoRA (gemma's
    ``lora/{a, b}``, NNX's ``lora_a``/``lora_b``, PEFT's ``lora_A``)."""
    return "lora" in leaf.lower() or "lora" in module.lower()


def _leaf_name_rules(leaf: str, lora: bool) -> tuple[tuple[str, str], ...]:
    """``(group, rule)`` pairs that the leaf's own name triggers."""
    return _leaf_name_rules_for(leaf, lora, NO_DECAY_NAMES, NO_DECAY_SUBSTRINGS)


@functools.lru_cache(maxsize=8192)
def _leaf_name_rules_for(leaf, lora, no_decay_names, no_decay_substrings):
    lowered = leaf.lower()
    found = []
    if lowered in no_decay_names and not (lora and lowered in ("a", "b")):
        group = _NAME_GROUPS.get(lowered, "norm")
        found.append((group, f"leaf name '{leaf}' ({group})"))
    for sub in no_decay_substrings:
        if sub in lowered:
            group = _SUBSTRING_GROUPS.get(sub, sub)
            found.append((group, f"leaf name '{leaf}' contains '{sub}'"))
    return tuple(found)


def _module_name_rules(module: str, table_like: bool) -> tuple[tuple[str, str], ...]:
    """``(group, rule)`` pairs that the module's name triggers (its words, see
    :func:`resolve_mask`); ``table_like``: whether the leaf could be an embedding table."""
    return _module_name_rules_for(module, table_like, NORM_MODULE_WORDS, EMBEDDING_MODULE_WORDS)


@functools.lru_cache(maxsize=8192)
def _module_name_rules_for(module, table_like, norm_words, embedding_words):
    found = []
    for word in (w.lower() for w in _WORDS.findall(module)):
        if word.endswith(("norm", "normalization", "normalisation")) or word in norm_words:
            found.append(("norm", f"module '{module}' is a normalisation layer"))
        elif word in ("bias", "biases"):
            found.append(("bias", f"module '{module}' is a bias"))
        elif (word.startswith("embed") or word in embedding_words) and table_like:
            found.append(("embedding", f"module '{module}' is an embedding"))
    return tuple(found)


def _auto_name_rule(components: tuple[str, ...], shape: Any) -> tuple[str, str] | None:
    """``(group, rule)`` of the ``"auto"`` name rule that excludes a leaf, or ``None``."""
    leaf, module = leaf_and_module_names(components)
    if leaf in SSM_NO_DECAY_NAMES:
        return leaf, f"SSM parameter '{leaf}'"
    # A kernel (Flax's dense and conv weight) or a convolution (ndim > 2) is never an
    # embedding table, whatever its module is called (ALBERT's embedding_hidden_mapping_in,
    # a ViT's patch embedding).
    table_like = leaf.lower() != "kernel" and (shape is None or effective_ndim(shape) <= 2)
    found: dict[str, str] = {}
    for group, rule in _leaf_name_rules(leaf, _is_lora_factor(leaf, module)):
        found.setdefault(group, rule)
    for group, rule in _module_name_rules(module, table_like):
        found.setdefault(group, rule)
    for group in ("norm", "bias", "embedding"):
        if group in found:
            return group, found[group]
    if found:
        group = min(found)
        return group, found[group]
    return None


def auto_no_decay_reason(components: tuple[str, ...], shape: Any = None) -> str | None:
    """Why the ``"auto"`` name rules exclude a leaf: its SSM name (``"A_log"``, ``"D"``,
    ``"dt_bias"``), ``"norm"``, ``"bias"`` or ``"embedding"``; ``None`` if no name rule
    applies (the ndim rule decides). The leaf's name is matched against
    :data:`SSM_NO_DECAY_NAMES`, :data:`NO_DECAY_NAMES` and :data:`NO_DECAY_SUBSTRINGS`, its
    module's words as :func:`resolve_mask` says; a normalisation layer's bias counts as
    ``"norm"``. ``shape`` (or its ndim) lets kernels and convolutions inside modules named
    like embeddings count as weights."""
    rule = _auto_name_rule(components, shape)
    return None if rule is None else rule[0]


def auto_rule(components: tuple[str, ...], shape: Any) -> tuple[bool, str]:
    """``(decayed, the rule that decided)`` under ``"auto"`` for one leaf (``shape``: its
    shape, or its ndim)."""
    rule = _auto_name_rule(components, shape)
    if rule is not None:
        return False, rule[1]
    ndim = effective_ndim(shape)
    dims = _shape(shape)
    squeezed = "" if dims is None or ndim == len(dims) else " (leading 1s dropped)"
    if ndim >= 2:
        return True, f"ndim {ndim} >= 2{squeezed}"
    return False, f"ndim {ndim} < 2{squeezed}"


def auto_decays(components: tuple[str, ...], shape: Any) -> bool:
    """The ``"auto"`` rule for one leaf (``shape``: its shape, or its ndim): name rules
    first (the leaf's own name and its module's, see :func:`resolve_mask`), then ``ndim >= 2``
    counted without leading axes of size 1."""
    return auto_rule(components, shape)[0]


def _patterns(name: str, value: Any) -> tuple[str, ...]:
    """``include``/``exclude`` as a tuple of valid regular expressions (one string: one
    pattern; ``None``: none)."""
    if value is None:
        return ()
    if isinstance(value, str):
        value = (value,)
    else:
        try:
            if isinstance(value, bytes | bytearray):
                raise TypeError
            value = tuple(value)
        except TypeError:
            raise ValueError(
                f"`{name}` patterns must be a string, a sequence of strings or None, got {value!r}."
            ) from None
    for p in value:
        if not isinstance(p, str):
            raise ValueError(f"`{name}` patterns must be strings, got {p!r}.")
        try:
            re.compile(p)
        except re.error as e:
            raise ValueError(f"`{name}` pattern {p!r} is not a valid regex: {e}.") from e
    return value


@dataclasses.dataclass(frozen=True)
class DecayMask:
    """Rules by key path; build it with :func:`decay_mask` (constructing it directly takes the
    same arguments and validates them the same way).

    A leaf is decayed iff no ``exclude`` pattern matches its path and either an ``include``
    pattern matches it or (no ``include`` patterns given) the ``default`` rule says so.
    Deliberately not callable, so ``optax.inject_hyperparams`` never mistakes it for a schedule.

    Raises:
      ValueError: if ``include`` or ``exclude`` is not a string, a sequence of strings or
        ``None``, a pattern is not a valid regular expression, or ``default`` is unknown.
    """

    include: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()
    default: str = "auto"

    def __post_init__(self) -> None:
        # Frozen: normalise the fields in place (a string is one pattern, not its characters).
        object.__setattr__(self, "include", _patterns("include", self.include))
        object.__setattr__(self, "exclude", _patterns("exclude", self.exclude))
        if not isinstance(self.default, str) or self.default not in ("auto", "all"):
            raise ValueError(f"`default` must be 'auto' or 'all', got {self.default!r}.")

    def decays(self, components: tuple[str, ...], shape: Any) -> bool:
        return self.rule(components, shape)[0]

    def rule(self, components: tuple[str, ...], shape: Any) -> tuple[bool, str]:
        """``(decayed, the rule that decided)`` for one leaf."""
        path = "/".join(components)
        for p in self.exclude:
            if re.search(p, path):
                return False, f"exclude pattern {p!r}"
        if self.include:
            for p in self.include:
                if re.search(p, path):
                    return True, f"include pattern {p!r}"
            return False, "no include pattern matches"
        if self.default == "auto":
            return auto_rule(components, shape)
        return True, "default='all'"


def decay_mask(
    include: str | tuple[str, ...] | list[str] | None = None,
    exclude: str | tuple[str, ...] | list[str] | None = None,
    *,
    default: str = "auto",
) -> DecayMask:
    """Weight-decay rules over ``/``-joined key paths (regular expressions, ``re.search``).

    Examples::

      decay_mask(exclude=r"(^|/)head/")            # "auto", but never decay the head
      decay_mask(include=r"kernel$")               # decay exactly the leaves named kernel
      decay_mask(exclude=r"bias$", default="all")  # decay all but biases, any ndim

    Args:
      include: pattern(s); if given, only matching leaves are decayed.
      exclude: pattern(s); matching leaves are never decayed (exclude wins over include).
      default: rule for leaves when ``include`` is empty: ``"auto"`` (see module docs) or
        ``"all"``.

    Raises:
      ValueError: if a pattern is not a valid regular expression or ``default`` is unknown.

    Examples:
      >>> import jax.numpy as jnp
      >>> import optax_decoupled as od
      >>> params = {"dense": {"kernel": jnp.ones((3, 3)), "bias": jnp.ones(3)},
      ...           "A_log": jnp.ones((4, 2))}
      >>> od.resolve_mask(od.decay_mask(include=r"kernel|A_log"), params)
      {'A_log': True, 'dense': {'bias': False, 'kernel': True}}
      >>> tx = od.adamw(1e-3, mask=od.decay_mask(exclude=r"^dense/"))
    """
    return DecayMask(include, exclude, default)


def _is_bool_leaf(x: Any) -> bool:
    """A Python or NumPy bool, or a concrete (not traced) scalar bool array."""
    if isinstance(x, bool | np.bool_):
        return True
    if isinstance(x, jax.core.Tracer) or not isinstance(x, np.ndarray | jax.Array):
        return False
    return x.shape == () and x.dtype == np.bool_


def _from_rule(rule: Callable[[tuple[str, ...], Any], bool], params: Any) -> Any:
    leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
    flags = [bool(rule(path_components(p), np.shape(leaf))) for p, leaf in leaves]
    return jax.tree_util.tree_unflatten(treedef, flags)


def _is_empty_node(x: Any) -> bool:
    """A parameter-tree node without leaves, where a mask may still hold an entry: ``None``,
    ``optax.MaskedNode`` (what ``optax.masked`` and ``optax.multi_transform`` put in place of
    the leaves another transform owns), an empty container (``{}``, ``()``) or a subtree of
    those."""
    return not jax.tree_util.tree_leaves(x)


def _empty_node_paths(params: Any) -> list[tuple[str, ...]]:
    """The key paths of the parameters' nodes without leaves, nested ones included."""
    paths: list[tuple[str, ...]] = []

    def walk(prefix: tuple[str, ...], node: Any) -> None:
        paths.append(prefix)
        children, _ = jax.tree_util.tree_flatten_with_path(node, is_leaf=lambda x: x is not node)
        for path, child in children:
            walk(prefix + path_components(path), child)

    for path, node in jax.tree_util.tree_flatten_with_path(params, is_leaf=_is_empty_node)[0]:
        if _is_empty_node(node):
            walk(path_components(path), node)
    return paths


def _is_none_entry(x: Any) -> bool:
    return x is None or isinstance(x, optax.MaskedNode)


def _show(components: tuple[str, ...]) -> str:
    return f"'{'/'.join(components)}'" if components else "the root"


def _match_tree(mask_tree: Any, params: Any, argument: str) -> Any:
    """:func:`_match_entries` as a pytree of bools shaped like ``params``."""
    flags, _, treedef = _match_entries(mask_tree, params, argument)
    return jax.tree_util.tree_unflatten(treedef, flags)


def _match_entries(mask_tree: Any, params: Any, argument: str) -> tuple[list, list, Any]:
    """``(flags, entries, treedef)``: each parameter leaf's flag and the key path of the mask
    entry it came from (``None`` where the mask has the parameters' own structure).

    Re-expresses a user mask pytree in the parameters' structure, matching by key path.

    As in Optax, the mask may be a *prefix* of the parameter tree: an entry whose key path is
    a parameter's or one of its ancestors' applies to every leaf below it (``{"enc": True,
    "head": False}`` for ``{"enc": {...}, "head": {...}}``). Entries where the parameters have
    no leaves (``None``, ``optax.MaskedNode``, ``{}``) are ignored, as Optax ignores them."""
    flags = jax.tree.leaves(mask_tree)
    treedef = jax.tree.structure(params)
    if jax.tree.structure(mask_tree) == treedef and all(_is_bool_leaf(f) for f in flags):
        # The parameters' own structure, one bool per leaf: nothing to match.
        return [bool(f) for f in flags], [None] * len(flags), treedef
    p_leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
    m_leaves, m_treedef = jax.tree_util.tree_flatten_with_path(mask_tree)
    if m_treedef.num_nodes == m_treedef.num_leaves == 1 and treedef.num_nodes > 1 and p_leaves:
        raise ValueError(
            f"`{argument}` must be 'auto', None, a decay_mask(...), a pytree of bools with "
            f"the parameters' structure (or a prefix of it) or a callable returning one; got "
            f"the single value {m_leaves[0][1]!r}. (Inside optax.inject_hyperparams a plain "
            "callable is taken for a schedule and called with the step count: pass "
            "static_args=('mask',) or use decay_mask(...).)"
        )
    by_path: dict[tuple[str, ...], bool] = {}
    for path, leaf in m_leaves:
        components = path_components(path)
        if not _is_bool_leaf(leaf):
            raise ValueError(
                f"`{argument}` leaf at '{'/'.join(components)}' must be a Python bool, got "
                f"{leaf!r} (masks are static: they choose which leaves are decayed at trace "
                "time)."
            )
        by_path[components] = bool(leaf)
    # None (or optax.MaskedNode) in the mask is a node without entries, not a leaf: named if
    # it stands where the parameters have leaves.
    nones = [
        path_components(path)
        for path, node in jax.tree_util.tree_flatten_with_path(mask_tree, is_leaf=_is_none_entry)[0]
        if _is_none_entry(node)
    ]
    flags, entries, used = [], [], set()
    for path, _ in p_leaves:
        components = path_components(path)
        # The entry at the parameter's own path or its nearest ancestor's (a pytree mask
        # cannot hold both: a leaf has no children).
        entry = next(
            (components[:n] for n in range(len(components), -1, -1) if components[:n] in by_path),
            None,
        )
        if entry is None:
            none = next((n for n in nones if components[: len(n)] == n), None)
            if none is not None:
                raise ValueError(
                    f"`{argument}` does not match the parameters: the mask has None at "
                    f"{_show(none)}, where the parameters have leaves ('{'/'.join(components)}'"
                    "); give a bool there (True: decay the whole subtree) or one per leaf."
                )
            shown = [repr(k) for k in sorted("/".join(k) for k in by_path)]
            if len(shown) > 8:
                shown[8:] = ["..."]
            raise ValueError(
                f"`{argument}` does not match the parameters: '{'/'.join(components)}' is a "
                "parameter but has no entry in the mask, neither at its path nor at an "
                f"ancestor's (mask paths: {', '.join(shown) or 'none'})."
            )
        used.add(entry)
        flags.append(by_path[entry])
        entries.append(entry)
    empty_paths = _empty_node_paths(params)
    for path, _ in m_leaves:
        key = path_components(path)
        if key in used or any(e[: len(key)] == key for e in empty_paths):
            continue
        raise ValueError(
            f"`{argument}` does not match the parameters: the mask has an entry at "
            f"'{'/'.join(key)}', which is not a parameter or a node of the parameter tree."
        )
    return flags, entries, treedef


def is_params_placeholder(params: Any) -> bool:
    """Whether ``params`` is the stand-in that ``optax.tree_utils.tree_map_params`` (used by
    :func:`optax_decoupled.contrib.state_shardings`) passes to ``init`` in place of the whole
    parameter tree: one object with no leaves, against which a mask pytree cannot be checked.
    An ``init`` whose state does not depend on the mask skips the check for it."""
    cls = type(params)
    return cls.__name__ == "_ParamsPlaceholder" and cls.__module__.startswith("optax.")


def resolve_mask(mask: MaskArg, params: Any, *, argument: str = "mask") -> Any:
    """Resolves any accepted ``mask`` form into a pytree of bools shaped like ``params``.

    A *mask* is resolved against the parameter pytree into a pytree of Python bools of the same
    structure (``True`` = decay this leaf). Accepted forms, everywhere a ``mask`` argument appears:

    * ``"auto"`` (the default): decay weight matrices only. A leaf is **not** decayed if its own
      name (the last name in its ``/``-joined key path, list indices such as the ``0`` of
      ``layers/0/kernel`` skipped)

      - names a bias (contains ``bias``, or is ``b``),
      - names a normalisation parameter (contains ``norm``, or is ``scale``, ``offset``, ``gamma``
        or ``beta``),
      - names an embedding (contains ``embed``),
      - is one of the selective-SSM parameters ``A_log``, ``D``, ``dt_bias`` (what ``mamba_ssm``
        marks ``_no_weight_decay``),

      or if the module holding it (the name before the leaf's) is a bias, normalisation layer or
      embedding by one of the words of its name (split at ``_``, ``-``, ``.``, digits and
      camelCase): a word is ``bias``; ends in ``norm`` or ``normalization`` (``LayerNorm_0``,
      ``final_norm``, ``norm1``, ``input_layernorm``) or is ``ln`` or ``bn`` (GPT-2's
      ``ln_1``, ``ln_f``); starts with ``embed`` (``embed_tokens``, ``word_embeddings``) or
      is ``wte`` or ``wpe`` (GPT-2's tables): Equinox's ``embedding/weight``, ``ln_1/weight``.
      A module named like an embedding excludes only what can be a table: a leaf named
      ``kernel`` (Flax's dense and conv weights) or of more than two dimensions (a
      convolution) is a weight there (ALBERT's ``embedding_hidden_mapping_in/kernel``, a ViT's
      ``patch_embedding/kernel``). Other modules' names do not matter, so a module named ``D``
      or ``b``, or a ``denormalizer``, is decayed as any other; a wrapper such as
      ``PreNorm_0/Dense_0/kernel`` is decayed too. The factors of a low-rank adapter (the leaf
      or its module names ``lora``: gemma's ``lora/a``, ``lora/b``) are weights, whatever
      their one-letter names.

      Otherwise a leaf is decayed iff it has at least two dimensions once leading axes of size
      1 are dropped (a ``(1, 1, d)`` class token is a vector). Name rules win over the ndim
      rule, so a 2-D ``A_log`` or a scan-stacked bias or norm scale of shape
      ``(layers, features)`` is still excluded.
    * ``None``: decay every leaf (what ``torch.optim`` does within a parameter group, and what
      ``optax.adamw(mask=None)`` does).
    * a pytree of bools with the parameters' structure (dicts, ``flax.nnx.State``, NamedTuples),
      or a prefix of it as in Optax: ``{"encoder": True, "head": False}`` decays every leaf
      under ``encoder`` and none under ``head``.
    * a callable ``params -> pytree of bools``. Inside ``optax.inject_hyperparams`` a plain callable
      is taken for a schedule: pass ``static_args=("mask",)`` there, or use :func:`decay_mask`,
      whose result is not callable.
    * :func:`decay_mask` rules by key path.

    Key paths are the ``/``-joined keys of :func:`jax.tree_util.tree_flatten_with_path`, e.g.
    ``"layers/0/mixer/in_proj/kernel"``; the trailing ``value`` of a ``flax.nnx`` variable is
    dropped.

    Raises:
      ValueError: naming the first mismatching key path if a mask pytree (or a callable's
        result) does not have the parameters' structure, or a leaf is not a bool.

    Examples:
      >>> import jax.numpy as jnp
      >>> import optax_decoupled as od
      >>> params = {"encoder": {"kernel": jnp.ones((3, 3)), "bias": jnp.ones(3)},
      ...           "norm": {"scale": jnp.ones(3)}, "A_log": jnp.ones((4, 2))}
      >>> od.resolve_mask("auto", params)
      {'A_log': False, 'encoder': {'bias': False, 'kernel': True}, 'norm': {'scale': False}}
    """
    if mask is None:
        return _from_rule(lambda c, n: True, params)
    if isinstance(mask, str):
        if mask != "auto":
            raise ValueError(f"`{argument}` string must be 'auto', got {mask!r}.")
        return _from_rule(auto_decays, params)
    if isinstance(mask, DecayMask):
        return _from_rule(mask.decays, params)
    if callable(mask):
        return _match_tree(mask(params), params, argument)
    return _match_tree(mask, params, argument)


class MaskDecision(NamedTuple):
    """One leaf of :func:`explain_mask`: its key path, shape, whether it is decayed and the
    rule that decided."""

    path: str
    shape: tuple[int, ...]
    decayed: bool
    rule: str


class MaskExplanation(tuple):
    """:func:`explain_mask`'s result: a tuple of :class:`MaskDecision`, one per leaf in
    ``jax.tree`` order, that prints as a table."""

    def __str__(self) -> str:
        rows = [("path", "shape", "decay", "rule")]
        rows += [(d.path, str(d.shape), "yes" if d.decayed else "no", d.rule) for d in self]
        widths = [max(len(r[i]) for r in rows) for i in range(3)]
        lines = ["  ".join(r[i].ljust(widths[i]) for i in range(3)) + "  " + r[3] for r in rows]
        decayed = sum(d.decayed for d in self)
        lines.append(f"{decayed} of {len(self)} leaves decayed")
        return "\n".join(lines)

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:  # IPython / Jupyter
        printer.text(str(self))


def explain_mask(params: Any, mask: MaskArg = "auto") -> MaskExplanation:
    """Each leaf's key path, shape, whether ``mask`` decays it and the rule that decided:
    what to check before a long run.

    Every form :func:`resolve_mask` accepts works; an invalid mask raises as there.

    Examples:
      >>> import jax.numpy as jnp
      >>> import optax_decoupled as od
      >>> params = {"embed": {"embedding": jnp.ones((10, 4))},
      ...           "ln_f": {"weight": jnp.ones((2, 4))},
      ...           "cls": jnp.ones((1, 1, 4)),
      ...           "head": {"kernel": jnp.ones((4, 3)), "bias": jnp.ones(3)}}
      >>> print(od.explain_mask(params))
      path             shape      decay  rule
      cls              (1, 1, 4)  no     ndim 1 < 2 (leading 1s dropped)
      embed/embedding  (10, 4)    no     leaf name 'embedding' contains 'embed'
      head/bias        (3,)       no     leaf name 'bias' contains 'bias'
      head/kernel      (4, 3)     yes    ndim 2 >= 2
      ln_f/weight      (2, 4)     no     module 'ln_f' is a normalisation layer
      1 of 5 leaves decayed
      >>> od.explain_mask(params, None)[0].rule
      'mask=None: every leaf'
    """
    leaves, _ = jax.tree_util.tree_flatten_with_path(params)
    comps = [path_components(p) for p, _ in leaves]
    shapes = [tuple(int(d) for d in np.shape(leaf)) for _, leaf in leaves]
    if mask is None:
        decisions = [(True, "mask=None: every leaf")] * len(leaves)
    elif isinstance(mask, str):
        check_mask_arg(mask)
        decisions = [auto_rule(c, s) for c, s in zip(comps, shapes, strict=True)]
    elif isinstance(mask, DecayMask):
        decisions = [mask.rule(c, s) for c, s in zip(comps, shapes, strict=True)]
    else:
        tree = mask(params) if callable(mask) else mask
        flags, entries, _ = _match_entries(tree, params, "mask")
        where = "the callable's mask" if callable(mask) else "the mask"
        decisions = [
            (f, f"{where}, entry at {_show(c if e is None else e)}")
            for f, e, c in zip(flags, entries, comps, strict=True)
        ]
    return MaskExplanation(
        MaskDecision("/".join(c), s, bool(d), r)
        for c, s, (d, r) in zip(comps, shapes, decisions, strict=True)
    )


def warn_if_auto_decays_nothing(mask: MaskArg, decays: Any, weight_decay: Any, who: str) -> None:
    """A :class:`UserWarning` when ``mask="auto"`` decays none of the parameters although the
    weight decay is not zero: e.g. under ``optax.flatten``, which hands the transform one
    1-D vector, or for a tree of biases and scalars. Silent otherwise, and when the weight
    decay is a concrete zero (a number or a concrete array, as ``inject_hyperparams`` passes
    it to ``init``); a traced one counts as not zero."""
    if not (isinstance(mask, str) and mask == "auto"):
        return
    leaves = jax.tree.leaves(decays)
    if not leaves or any(leaves):
        return
    if not isinstance(weight_decay, jax.core.Tracer) and not callable(weight_decay):
        try:
            if np.all(np.asarray(weight_decay) == 0):
                return
        except (TypeError, ValueError):  # not a number: validated elsewhere
            pass
    warnings.warn(
        f"{who}: mask='auto' decays none of these parameters (it decays leaves with "
        "ndim >= 2 whose names are not biases, norms or SSM parameters), so the weight decay "
        "does nothing. Under optax.flatten the transform sees one 1-D vector: decay before "
        "flattening, or use optax_decoupled.packed. Pass mask=None to decay every leaf, or "
        "your own mask.",
        UserWarning,
        stacklevel=4,
    )


def check_mask_arg(mask: MaskArg, argument: str = "mask") -> None:
    """Early validation of a ``mask`` argument's form (structure is checked at ``init``)."""
    if isinstance(mask, str) and mask != "auto":
        raise ValueError(f"`{argument}` string must be 'auto', got {mask!r}.")
