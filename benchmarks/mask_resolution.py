"""Time to resolve a weight-decay mask over a tree of many leaves, for every mask form.

A parameter tree of ``--modules`` modules of 100 leaves each (half matrices, half vectors);
each mask form is resolved ``--repeats`` times and the best time printed, with the time per
leaf, so that growth with the tree's size shows as a constant per-leaf cost::

    python benchmarks/mask_resolution.py --modules 100 1000   # 10^4 and 10^5 leaves
"""

from __future__ import annotations

import argparse
import json
import pathlib
import time

import jax
import numpy as np

import optax_decoupled as od


def tree(modules: int) -> dict:
    return {
        f"layer_{i}": {f"p{j}": np.zeros((2, 2) if j % 2 else (2,), np.float32) for j in range(100)}
        for i in range(modules)
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modules", type=int, nargs="+", default=[100, 1000])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="benchmarks/results/mask_resolution.json")
    args = parser.parse_args(argv)
    results = []
    print(f"{'leaves':>8s}  {'mask':28s}  {'seconds':>8s}  {'µs/leaf':>8s}")
    for modules in args.modules:
        params = tree(modules)
        pytree = jax.tree.map(lambda x: x.ndim == 2, params)
        forms = {
            '"auto"': "auto",
            "pytree of bools": pytree,
            "prefix pytree": {k: i % 2 == 0 for i, k in enumerate(params)},
            "callable": lambda p, m=pytree: m,
            "decay_mask(exclude=...)": od.decay_mask(exclude=r"p1$"),
            "None": None,
        }
        n = modules * 100
        for name, mask in forms.items():
            best = float("inf")
            for _ in range(args.repeats):
                start = time.perf_counter()
                od.resolve_mask(mask, params)
                best = min(best, time.perf_counter() - start)
            results.append({"leaves": n, "mask": name, "seconds": best})
            print(f"{n:8d}  {name:28s}  {best:8.3f}  {best / n * 1e6:8.2f}")
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
