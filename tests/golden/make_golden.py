"""Record PyTorch optimizer trajectories as golden files for ``tests/test_torch_golden.py``.

The tests only need NumPy to read the files; torch is needed to regenerate them. Keep torch
out of the project's environment and use a separate one:

    python3 -m venv /opt/torchenv
    /opt/torchenv/bin/pip install torch==2.13.0 numpy
    /opt/torchenv/bin/python tests/golden/make_golden.py        # from the repository root

Files written (next to this script), one per case and dtype:

    torch_adam_l2_{float32,float64}.npz         torch.optim.Adam(weight_decay=0.1)
    torch_adamw_{float32,float64}.npz           torch.optim.AdamW(weight_decay=0.1)
    torch_adamw_amsgrad_{float32,float64}.npz   torch.optim.AdamW(weight_decay=0.1, amsgrad=True)

Each ``.npz`` holds
    ``meta``            a JSON string: torch / numpy / python versions, optimizer class and exact
                        keyword arguments, the learning-rate schedule and its parameters, seed,
                        number of steps, dtype, and the loss;
    ``lr``              (num_steps,) float64, the learning rate set before step k (k 0-based);
    ``param.<path>``    (num_steps + 1, *shape): the parameters before step 0 and after each step;
    ``grad.<path>``     (num_steps, *shape): the gradient torch used at step k (at param[k]).
``<path>`` is a '/'-joined pytree path ("dense/kernel", "dense/bias", "conv/kernel",
"temperature"); the parameter shapes are (3, 4), (5,), (2, 3, 2) and ().

Gradients come from a small deterministic loss evaluated by torch at the current parameters
(so the trajectory feeds back into the gradients); tests replay the recorded gradients, so they
do not need to evaluate the loss themselves:

    L(theta) = sum_leaves [ 0.5 * sum(a * (theta - c)^2) + 0.3 * sum(sin(3 theta)) ]
               + 0.05 * (sum of all entries of all leaves)^2

with ``a ~ U(0.5, 2)`` and ``c ~ N(0, 1)`` per entry, and initial params ``~ N(0, 1)``, all drawn
in float64 from ``torch.Generator().manual_seed(SEED)`` (float32 cases use the float64 draws
rounded to float32). Before step k the learning rate is set by hand, ``group["lr"] = lr(k)``,
with a linear warmup + cosine decay (the same as ``optax.warmup_cosine_decay_schedule``).
"""

from __future__ import annotations

import json
import math
import pathlib
import platform
import sys

import numpy as np
import torch

SEED = 20240601
NUM_STEPS = 60
SHAPES = {
    "dense/kernel": (3, 4),
    "dense/bias": (5,),
    "conv/kernel": (2, 3, 2),
    "temperature": (),
}
SCHEDULE = dict(init_value=1e-3, peak_value=2e-2, warmup_steps=10, decay_steps=60, end_value=1e-3)
COMMON = dict(betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, foreach=False, maximize=False)
CASES = {
    "adam_l2": (torch.optim.Adam, dict(COMMON, amsgrad=False)),
    "adamw": (torch.optim.AdamW, dict(COMMON, amsgrad=False)),
    "adamw_amsgrad": (torch.optim.AdamW, dict(COMMON, amsgrad=True)),
}
LOSS = (
    "sum_leaves[0.5*sum(a*(theta-c)**2) + 0.3*sum(sin(3*theta))] + 0.05*(sum_all theta)**2, "
    "a~U(0.5,2), c~N(0,1), theta0~N(0,1) (float64 draws, in this order per leaf: theta0, a, c)"
)


def warmup_cosine(k: int) -> float:
    s = SCHEDULE
    if k < s["warmup_steps"]:
        frac = k / s["warmup_steps"]
        return s["init_value"] + (s["peak_value"] - s["init_value"]) * frac
    span = s["decay_steps"] - s["warmup_steps"]
    j = min(k - s["warmup_steps"], span)
    cos = 0.5 * (1.0 + math.cos(math.pi * j / span))
    return s["end_value"] + (s["peak_value"] - s["end_value"]) * cos


def draw_problem() -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(SEED)
    problem = {}
    for path, shape in SHAPES.items():
        theta0 = torch.randn(shape, generator=gen, dtype=torch.float64)
        a = 0.5 + 1.5 * torch.rand(shape, generator=gen, dtype=torch.float64)
        c = torch.randn(shape, generator=gen, dtype=torch.float64)
        problem[path] = (theta0, a, c)
    return problem


def loss_fn(params: dict[str, torch.Tensor], consts: dict[str, tuple]) -> torch.Tensor:
    total = 0.0
    for path, p in params.items():
        a, c = consts[path]
        total = total + 0.5 * (a * (p - c) ** 2).sum() + 0.3 * torch.sin(3.0 * p).sum()
    everything = sum(p.sum() for p in params.values())
    return total + 0.05 * everything**2


def record(name: str, dtype: torch.dtype) -> dict[str, np.ndarray]:
    opt_cls, kwargs = CASES[name]
    problem = draw_problem()
    params = {
        path: torch.nn.Parameter(theta0.to(dtype).clone())
        for path, (theta0, _, _) in problem.items()
    }
    consts = {path: (a.to(dtype), c.to(dtype)) for path, (_, a, c) in problem.items()}
    opt = opt_cls(list(params.values()), lr=warmup_cosine(0), **kwargs)

    traj = {path: [p.detach().numpy().copy()] for path, p in params.items()}
    grads = {path: [] for path in params}
    lrs = []
    for k in range(NUM_STEPS):
        lr = warmup_cosine(k)
        for group in opt.param_groups:
            group["lr"] = lr
        lrs.append(lr)
        opt.zero_grad()
        loss_fn(params, consts).backward()
        for path, p in params.items():
            grads[path].append(p.grad.detach().numpy().copy())
        opt.step()
        for path, p in params.items():
            traj[path].append(p.detach().numpy().copy())

    dtype_name = str(dtype).removeprefix("torch.")
    meta = {
        "case": name,
        "optimizer": f"torch.optim.{opt_cls.__name__}",
        "optimizer_kwargs": {k: list(v) if isinstance(v, tuple) else v for k, v in kwargs.items()},
        "schedule": dict(
            kind="linear warmup + cosine decay (optax.warmup_cosine_decay_schedule)", **SCHEDULE
        ),
        "lr_setting": "group['lr'] = lr(k) before opt.step() of step k (k 0-based)",
        "num_steps": NUM_STEPS,
        "dtype": dtype_name,
        "seed": SEED,
        "shapes": {path: list(shape) for path, shape in SHAPES.items()},
        "loss": LOSS,
        "torch_version": torch.__version__,
        "numpy_version": np.__version__,
        "python_version": sys.version.split()[0],
        "platform": platform.platform(),
        "generated_by": "tests/golden/make_golden.py",
    }
    out = {"meta": np.array(json.dumps(meta, sort_keys=True)), "lr": np.array(lrs, np.float64)}
    for path in params:
        out[f"param.{path}"] = np.stack(traj[path])
        out[f"grad.{path}"] = np.stack(grads[path])
    return out


def main() -> None:
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    here = pathlib.Path(__file__).resolve().parent
    results = {}
    for name in CASES:
        for dtype in (torch.float32, torch.float64):
            data = record(name, dtype)
            dtype_name = str(dtype).removeprefix("torch.")
            results[(name, dtype_name)] = data
            path = here / f"torch_{name}_{dtype_name}.npz"
            np.savez_compressed(path, **data)
            print(f"wrote {path.name} ({path.stat().st_size} bytes)")
    # Sanity: the cases must differ from each other (otherwise the tests could not tell them apart).
    for dtype_name in ("float32", "float64"):
        ref = results[("adamw", dtype_name)]
        for other in ("adam_l2", "adamw_amsgrad"):
            diff = max(
                np.max(np.abs(results[(other, dtype_name)][f"param.{p}"] - ref[f"param.{p}"]))
                for p in SHAPES
            )
            print(f"{dtype_name}: max |{other} - adamw| over the trajectory = {diff:.3e}")
            assert diff > 1e-3, (other, dtype_name, diff)


if __name__ == "__main__":
    main()
