"""Shared by the composition tests of the float and the low-precision paths
(``test_composition.py``, ``test_storage.py``): the computation an Optax wrapper should equal,
written out."""

from collections.abc import Callable, Iterator

import jax
import optax


def multi_steps_vs_averaged_gradients(
    multi: optax.GradientTransformation,
    inner: optax.GradientTransformation,
    params,
    grads_at: Callable,
    *,
    every_k: int,
    rounds: int = 2,
    update_multi: Callable | None = None,
    update_inner: Callable | None = None,
) -> Iterator[tuple]:
    """After each of ``rounds`` rounds, yields ``(params after every_k micro-steps of
    optax.MultiSteps, params after one step of inner on their mean gradient)``.

    The micro-gradients ``grads_at(round * every_k + j, p)`` are taken at the parameters of the
    written-out run, ``p``, so both runs see the same gradients.
    """
    update_multi = update_multi or multi.update
    update_inner = update_inner or inner.update
    pm, sm = params, multi.init(params)
    pi, si = params, inner.init(params)
    for big in range(rounds):
        micro = [grads_at(big * every_k + j, pi) for j in range(every_k)]
        for g in micro:
            u, sm = update_multi(g, sm, pm)
            pm = optax.apply_updates(pm, u)
        mean = jax.tree.map(lambda *gs: sum(gs) / every_k, *micro)
        u, si = update_inner(mean, si, pi)
        pi = optax.apply_updates(pi, u)
        yield pm, pi
