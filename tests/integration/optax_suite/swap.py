"""A pytest plugin (``-p swap``) that runs Optax's own tests with optax-decoupled swapped in.

Loading it replaces ``optax.adam``, ``optax.adamw``, ``optax.amsgrad``, ``optax.lion``,
``optax.scale_by_adam``, ``optax.scale_by_amsgrad`` and ``optax.scale_by_lion`` in every loaded
``optax`` module (``optax``, ``optax._src.alias``, ``optax._src.transform``, ...) with adapters
that keep Optax's signatures and build the optax-decoupled equivalent:

==========================  =============================================================
``optax.adam``              ``od.adam(...)``
``optax.adamw``             ``od.adamw(..., weight_decay=λ, mask=mask)`` (``None``: decay all)
``optax.amsgrad``           ``od.amsgrad(..., variant="optax", weight_decay=0.0, mask=None)``
                            (both bias corrections off: ``variant="paper"``)
``optax.lion``              ``od.lion(..., weight_decay=λ, mask=mask)``
``optax.scale_by_adam``     ``od.scale_by_adam(b1, b2, eps, eps_root)``
``optax.scale_by_amsgrad``  ``od.scale_by_adam(..., amsgrad="optax")`` (or ``"paper"``)
``optax.scale_by_lion``     ``od.scale_by_lion(b1, b2)``
==========================  =============================================================

Any other Optax argument (``mu_dtype``, ``nesterov``, Lion's ``mode``, ...) that differs from
Optax's default goes to the optax-decoupled function under the same name where its signature
has it; otherwise the adapter's transformation raises ``NotImplementedError("optax-decoupled:
<argument> not supported ...")`` from ``init`` and ``update`` (not when it is built, so that a
test module that builds every optimizer at import still collects). A test that raises it is
reported as skipped with that message.

The plugin also

* deselects absl-parameterized cases whose ``*opt_name`` parameters all name optimizers whose
  construction calls no adapter (a probe builds each named optimizer once), so that Optax's
  loops over all its optimizers run only for the ones that reach optax-decoupled;
* records adapter calls: per swapped name (built), and per test id (built or initialised or
  updated during that test); at exit (``pytest_unconfigure``) each process writes them with
  the absl parameters of each test to ``$OPTAX_SUITE_OUT/swap-<worker>.json``.
"""

from __future__ import annotations

import collections
import functools
import importlib
import inspect
import json
import os
import pathlib
import re
import sys
from typing import Any

import optax
import pytest
from optax._src import alias as optax_alias
from optax._src import transform as optax_transform

import optax_decoupled as od

#: Every message of a refused argument starts with this (the outer test reads skips by it).
PREFIX = "optax-decoupled:"
#: The swapped names (each is an attribute of ``optax``).
SWAPPED = (
    "adam",
    "adamw",
    "amsgrad",
    "lion",
    "scale_by_adam",
    "scale_by_amsgrad",
    "scale_by_lion",
)
#: AMSGrad's bias corrections (of mu, of nu) in Optax -> optax-decoupled's convention.
_AMSGRAD_VARIANTS = {(True, True): "optax", (False, False): "paper"}
#: ``opt_name='adam'``, ``adv_opt_name='adam'``, ... in an absl parameter list.
_OPT_NAME = re.compile(r"\b\w*opt_name='(\w+)'")

_CALLS: collections.Counter[str] = collections.Counter()  # adapter calls per swapped name
_REACHED: dict[str, set[str]] = collections.defaultdict(set)  # test id -> swapped names
_PARAMS: dict[str, str] = {}  # test id -> absl parameter repr
_DESELECTED: list[str] = []
_state: dict[str, Any] = {"test": None, "probe": None}


class NotSupported(NotImplementedError):
    """An Optax argument that optax-decoupled does not implement (its message starts with
    :data:`PREFIX`)."""


def _record(name: str) -> None:
    if _state["probe"] is not None:
        _state["probe"].add(name)
    elif _state["test"] is not None:
        _REACHED[_state["test"]].add(name)


def _is_default(value: Any, default: Any) -> bool:
    if value is default:
        return True
    plain = (bool, int, float, str)
    return type(value) is type(default) and isinstance(value, plain) and value == default


def _rest(optax_name: str, args: dict[str, Any], defaults: dict[str, Any], od_fn) -> dict[str, Any]:
    """Keyword arguments for ``od_fn`` from the Optax arguments not mapped explicitly: those at
    Optax's default are dropped, the others passed by name where ``od_fn`` takes that name;
    any other raises :class:`NotSupported`."""
    accepted = inspect.signature(od_fn).parameters
    out = {}
    for key, value in args.items():
        if _is_default(value, defaults[key]):
            continue
        if key not in accepted:
            raise NotSupported(
                f"{PREFIX} {key}={value!r} not supported "
                f"(optax.{optax_name} -> optax_decoupled.{od_fn.__name__})"
            )
        out[key] = value
    return out


def _amsgrad_variant(args: dict[str, Any]) -> str:
    """Optax's bias-correction flags as an optax-decoupled AMSGrad convention (``"optax"``
    where they have none: they stay in ``args`` for :func:`_rest`)."""
    flags = (args.get("bias_correction_mu", True), args.get("bias_correction_nu", True))
    if flags in _AMSGRAD_VARIANTS:
        args.pop("bias_correction_mu", None)
        args.pop("bias_correction_nu", None)
        return _AMSGRAD_VARIANTS[flags]
    return "optax"


def _pop(args: dict[str, Any], *names: str) -> list[Any]:
    return [args.pop(n) for n in names]


def _build_adam(args, defaults):
    lr, b1, b2, eps, eps_root = _pop(args, "learning_rate", "b1", "b2", "eps", "eps_root")
    rest = _rest("adam", args, defaults, od.adam)
    return od.adam(lr, b1, b2, eps, eps_root=eps_root, **rest)


def _build_adamw(args, defaults):
    lr, b1, b2, eps, eps_root, wd, mask = _pop(
        args, "learning_rate", "b1", "b2", "eps", "eps_root", "weight_decay", "mask"
    )
    rest = _rest("adamw", args, defaults, od.adamw)
    return od.adamw(lr, b1, b2, eps, eps_root=eps_root, weight_decay=wd, mask=mask, **rest)


def _build_amsgrad(args, defaults):
    lr, b1, b2, eps, eps_root = _pop(args, "learning_rate", "b1", "b2", "eps", "eps_root")
    variant = _amsgrad_variant(args)
    rest = _rest("amsgrad", args, defaults, od.amsgrad)
    return od.amsgrad(
        lr, b1, b2, eps, variant=variant, weight_decay=0.0, mask=None, eps_root=eps_root, **rest
    )


def _build_lion(args, defaults):
    lr, b1, b2, wd, mask = _pop(args, "learning_rate", "b1", "b2", "weight_decay", "mask")
    rest = _rest("lion", args, defaults, od.lion)
    return od.lion(lr, b1, b2, weight_decay=wd, mask=mask, **rest)


def _build_scale_by_adam(args, defaults):
    b1, b2, eps, eps_root = _pop(args, "b1", "b2", "eps", "eps_root")
    rest = _rest("scale_by_adam", args, defaults, od.scale_by_adam)
    return od.scale_by_adam(b1, b2, eps, eps_root, **rest)


def _build_scale_by_amsgrad(args, defaults):
    b1, b2, eps, eps_root = _pop(args, "b1", "b2", "eps", "eps_root")
    variant = _amsgrad_variant(args)
    rest = _rest("scale_by_amsgrad", args, defaults, od.scale_by_adam)
    return od.scale_by_adam(b1, b2, eps, eps_root, amsgrad=variant, **rest)


def _build_scale_by_lion(args, defaults):
    b1, b2 = _pop(args, "b1", "b2")
    if args.get("mode", "hard") == "hard":  # Optax reads smooth_beta in "smooth" mode only
        args.pop("mode", None)
        args.pop("smooth_beta", None)
    rest = _rest("scale_by_lion", args, defaults, od.scale_by_lion)
    return od.scale_by_lion(b1, b2, **rest)


_BUILDERS = {
    "adam": _build_adam,
    "adamw": _build_adamw,
    "amsgrad": _build_amsgrad,
    "lion": _build_lion,
    "scale_by_adam": _build_scale_by_adam,
    "scale_by_amsgrad": _build_scale_by_amsgrad,
    "scale_by_lion": _build_scale_by_lion,
}


def _refusing(name: str, message: str) -> optax.GradientTransformationExtraArgs:
    """A transformation whose ``init`` and ``update`` raise :class:`NotSupported`."""

    def init(params):
        _record(name)
        raise NotSupported(message)

    def update(updates, state, params=None, **extra):
        _record(name)
        raise NotSupported(message)

    return optax.GradientTransformationExtraArgs(init, update)


def _tracked(name: str, tx: optax.GradientTransformation) -> optax.GradientTransformation:
    """``tx`` (same type) recording each ``init``/``update`` call for the running test."""

    def init(params):
        _record(name)
        return tx.init(params)

    def update(updates, state, params=None, **extra):
        _record(name)
        return tx.update(updates, state, params, **extra)

    return type(tx)(init, update)


def _adapter(name: str, original):
    """``original``'s signature (``inject_hyperparams`` reads it), optax-decoupled's code."""
    signature = inspect.signature(original)
    defaults = {k: p.default for k, p in signature.parameters.items()}
    build = _BUILDERS[name]

    @functools.wraps(original)
    def adapter(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        if _state["probe"] is None:
            _CALLS[name] += 1
        _record(name)
        try:
            tx = build(dict(bound.arguments), defaults)
        except NotSupported as e:
            return _refusing(name, str(e))
        return _tracked(name, tx)

    adapter.__optax_decoupled_adapter__ = name
    return adapter


def _install() -> dict[str, Any]:
    """Replaces each original, wherever a loaded ``optax`` module holds it, with its adapter;
    returns the originals."""
    importlib.import_module("optax.contrib")  # its modules too hold references
    originals = {name: getattr(optax, name) for name in SWAPPED}
    adapters = {id(fn): _adapter(name, fn) for name, fn in originals.items()}
    for modname, module in list(sys.modules.items()):
        if module is None or not (modname == "optax" or modname.startswith("optax.")):
            continue
        for attr, value in list(vars(module).items()):
            if id(value) in adapters:  # the originals stay alive, so ids are theirs
                setattr(module, attr, adapters[id(value)])
    for module in (optax, optax_alias, optax_transform):
        for name in SWAPPED:
            value = getattr(module, name, None)
            if value is not None and not hasattr(value, "__optax_decoupled_adapter__"):
                raise RuntimeError(f"{module.__name__}.{name} was not swapped")
    return originals


_ORIGINALS = _install()


@functools.cache
def _reaches(opt_name: str) -> bool:
    """Whether building Optax's optimizer ``opt_name`` (with ``learning_rate=1.0`` where it
    needs one) calls an adapter; ``True`` where that cannot be told (unknown name, or the
    construction fails), so that such tests run."""
    factory = getattr(optax, opt_name, None) or getattr(optax.contrib, opt_name, None)
    if not callable(factory):
        return True
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return True
    lr = params.get("learning_rate")
    kwargs = {"learning_rate": 1.0} if lr is not None and lr.default is lr.empty else {}
    _state["probe"] = hits = set()
    try:
        factory(**kwargs)
    except Exception:  # any failure: keep the tests
        return True
    finally:
        _state["probe"] = None
    return bool(hits)


def pytest_collection_modifyitems(config, items):
    keep, drop = [], []
    for item in items:
        params = getattr(getattr(item, "obj", None), "__x_params_repr__", None)
        if params:
            _PARAMS[item.nodeid] = re.sub(r" at 0x[0-9a-f]+", "", params)
        names = _OPT_NAME.findall(params or "")
        if names and not any(_reaches(n) for n in names):
            drop.append(item)
        else:
            keep.append(item)
    if drop:
        _DESELECTED.extend(i.nodeid for i in drop)
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _state["test"] = item.nodeid
    try:
        return (yield)
    finally:
        _state["test"] = None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """A test (or subtest) that raised this plugin's ``NotImplementedError`` is skipped."""
    report = yield
    exc = call.excinfo
    if (
        exc is not None
        and exc.errisinstance(NotImplementedError)
        and str(exc.value).startswith(PREFIX)
    ):
        report.outcome = "skipped"
        report.longrepr = (str(item.path), item.location[1] or 0, f"Skipped: {exc.value}")
    return report


def pytest_unconfigure(config):
    out = os.environ.get("OPTAX_SUITE_OUT")
    if not out:
        return
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    record = {
        "calls": dict(_CALLS),
        "reached": {k: sorted(v) for k, v in _REACHED.items()},
        "params": _PARAMS,
        "deselected": _DESELECTED,
        "swapped": {n: f"{fn.__module__}.{fn.__qualname__}" for n, fn in _ORIGINALS.items()},
    }
    path = pathlib.Path(out) / f"swap-{worker}.json"
    path.write_text(json.dumps(record, indent=1, sort_keys=True))
