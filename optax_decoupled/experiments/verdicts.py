"""The comparison's verdicts and report text: what the numbers show, with their uncertainty.

* :func:`comparison_verdicts`: for each optimizer, its chosen weight decay against λ = 0 at
  the same learning rate; for each pair the report contrasts (:data:`PAIRS`), the difference
  of test loss. Both are paired by seed (:func:`~optax_decoupled.experiments.statistics.
  paired_difference`): the runs of one seed share the model's initialisation and the order of
  the data.
* :func:`separability`: the slope of :math:`\\log\\lambda^*(\\eta)` against :math:`\\log\\eta` over
  an lr × wd sweep, with a bootstrap interval over seeds
  (:func:`~optax_decoupled.experiments.statistics.valley_slope`).
* :func:`protocol_text`, :func:`summary_table`: the comparison's section of the report.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from optax_decoupled.experiments import statistics

#: The pairs of optimizers the comparison contrasts: (a, b, what the pair asks).
PAIRS = (
    ("adam_l2", "adamw", "coupled L2 or decoupled decay"),
    ("adamw", "adamw_schedule", "decay ηλ (PyTorch) or λη/η_peak (Loshchilov–Hutter)"),
    ("adamw", "amsgrad", "Adam's ν̂ or AMSGrad's running maximum"),
    ("adamw", "lion", "AdamW or Lion"),
)


def _cell(sweep: dict[str, Any], key: str, lr: float, wd: float) -> np.ndarray:
    """The per-seed values of ``key`` in the sweep's cell ``(lr, wd)``."""
    i = int(np.argmin(np.abs(np.log(np.asarray(sweep["learning_rate"])) - np.log(lr))))
    j = list(sweep["weight_decay"]).index(wd)
    return np.asarray(sweep[key], np.float64)[i, j]


def comparison_verdicts(doc: dict[str, Any], *, confidence: float = 0.95) -> dict[str, Any]:
    """The verdicts of a comparison (:func:`~optax_decoupled.experiments.compare.
    run_comparison`'s results): ``{"decay": {name: ...}, "pairs": [...]}``.

    ``decay[name]`` is the test loss at the chosen cell minus that at λ = 0 with the chosen
    learning rate (absent where the axis has no 0, or where λ = 0 was chosen); each pair's
    entry is the chosen cells' test-loss difference ``a − b`` (pairs whose optimizers were not
    run are left out). Every entry holds :func:`~optax_decoupled.experiments.statistics.
    paired_difference`'s fields and the test accuracies' difference as ``accuracy``.
    """
    opts = doc["optimizers"]
    decay = {}
    for name, res in opts.items():
        ev = res["evaluation"]
        hp, sweep = ev["hparams"], ev["sweep"]
        if 0.0 not in sweep["weight_decay"] or hp["weight_decay"] == 0.0:
            continue
        decay[name] = {"label": res["label"]} | _paired(
            sweep, sweep, (hp["learning_rate"], hp["weight_decay"]),
            (hp["learning_rate"], 0.0), (f"λ = {hp['weight_decay']:.3g}", "λ = 0"), confidence,
        )  # fmt: skip
    pairs = []
    for a, b, question in PAIRS:
        if a not in opts or b not in opts:
            continue
        ea, eb = opts[a]["evaluation"], opts[b]["evaluation"]
        if ea["seeds"] != eb["seeds"]:
            raise ValueError(f"{a} and {b} were run on different seeds; they cannot be paired.")
        entry = _paired(
            ea["sweep"], eb["sweep"],
            (ea["hparams"]["learning_rate"], ea["hparams"]["weight_decay"]),
            (eb["hparams"]["learning_rate"], eb["hparams"]["weight_decay"]),
            (opts[a]["label"], opts[b]["label"]), confidence,
        )  # fmt: skip
        pairs.append({"a": a, "b": b, "question": question, **entry})
    return {"decay": decay, "pairs": pairs, "metric": "test loss", "confidence": confidence}


def _paired(sweep_a, sweep_b, cell_a, cell_b, names, confidence) -> dict[str, Any]:
    loss = statistics.paired_difference(
        _cell(sweep_a, "test_loss", *cell_a), _cell(sweep_b, "test_loss", *cell_b),
        confidence=confidence, names=names,
    )  # fmt: skip
    acc = statistics.paired_difference(
        _cell(sweep_a, "test_accuracy", *cell_a), _cell(sweep_b, "test_accuracy", *cell_b),
        confidence=confidence, names=names, lower_is_better=False,
    )  # fmt: skip
    return {**loss, "accuracy": acc}


def comparison_text(verdict: dict[str, Any]) -> str:
    """The verdicts as Markdown bullet lists, one plain-language line each."""
    c = f"{verdict['confidence']:.0%}"
    lines = [
        f"**What the weight decay does**: test loss at the chosen λ minus at λ = 0 (same "
        f"learning rate), paired by seed, with its {c} t-interval:",
        "",
    ]
    lines += [f"- {v['label']}: {v['line']}" for v in verdict["decay"].values()] or [
        "- (every optimizer chose λ = 0, or its axis has no 0)"
    ]
    lines += [
        "",
        f"**Pairs**: difference of test loss between the chosen cells, paired by seed ({c} "
        "t-interval; negative: the first is better); test accuracy's difference in brackets:",
        "",
    ]
    for p in verdict["pairs"]:
        acc = p["accuracy"]
        lines.append(
            f"- {p['question']}: {p['line']} (accuracy {acc['mean']:+.4f}, {acc['verdict']})"
        )
    return "\n".join(lines)


def separability(
    sweep: dict[str, Any], *, key: str = "val_loss", seed: int = 0, confidence: float = 0.95
) -> dict[str, Any]:
    """The slope of :math:`\\log_{10}\\lambda^*` against :math:`\\log_{10}\\eta` over a sweep's
    positive weight decays, with a bootstrap interval over seeds and a verdict
    (:func:`~optax_decoupled.experiments.statistics.valley_slope`; λ = 0 has no logarithm and
    is left out). ``None`` for a sweep with fewer than two learning rates."""
    lrs = np.asarray(sweep["learning_rate"], np.float64)
    wds = np.asarray(sweep["weight_decay"], np.float64)
    if lrs.size < 2:
        return None
    keep = wds > 0
    values = np.asarray(sweep[key], np.float64)[:, keep, :]  # (lr, wd, seed)
    return statistics.valley_slope(
        lrs, wds[keep], np.moveaxis(values, 2, 0), seed=seed, confidence=confidence
    )


def protocol_text(doc: dict[str, Any]) -> str:
    """The selection protocol as run, for the report."""
    c = doc["config"]
    rows = c.get("row_length", 1)
    data = (
        f"sequential digits read {rows} pixel(s) per step ({64 // rows} steps), trained on "
        + (f"the first {c['train_size']} training images" if c.get("train_size") else
           "the whole training split")
    )  # fmt: skip
    swept = [n for n in c["optimizers"] if n in c.get("lr_sweep", c["optimizers"])]
    return (
        f"Model: Mamba-2-style SSM, d_model {c['d_model']}, {c['n_layers']} layers; data: "
        f"{data}; {c['steps']} steps, batch {c['batch_size']}, warmup {c['warmup_steps']} + "
        f"cosine, global-norm clipping {c['clip_norm']}. Protocol: each optimizer's peak "
        f"learning rate and weight decay are chosen from its grid × seeds {c['eval_seeds']} "
        "(one compiled program per optimizer) by the lowest final **validation** loss "
        "averaged over seeds; the chosen cell's runs are then scored once on the **test** "
        "split, which played no part in the choice (mean ± std over seeds). Every "
        "weight-decay axis includes λ = 0. "
        f"Learning rates {', '.join(f'{v:.3g}' for v in c['lrs'])} for {', '.join(swept)}; "
        "the others are tuned over λ at the middle one. Lion's grid is "
        f"AdamW's learning rates × {c['lion_lr_factor']} and weight decays × "
        f"{c['lion_wd_factor']} (Chen et al. 2023). Weight-decay grids differ per convention "
        "since one unit means a different decay per step. Optimisation speed: selective copying "
        f"(L = {c['copy_seq_len']}, {c['copy_tokens']} tokens), first evaluation step (every "
        f"{c['copy_eval_every']}) with per-token validation accuracy ≥ {c['copy_target']}, "
        f"budget {c['copy_steps']} steps, chosen weight decay, learning rate × "
        f"{c['copy_lr_factors']} (best shown)."
    )


def _pm(d: dict[str, float], fmt: str = ".3f") -> str:
    return f"{d['mean']:{fmt}} ± {d['std']:{fmt}}"


def _median_effective_decay(res: dict[str, Any]) -> float:
    return res["evaluation"]["diagnostics"]["effective_decay"]["quantiles"]["0.5"]


def summary_table(doc: dict[str, Any]) -> str:
    """A Markdown table of the comparison, the verdicts below it."""
    lines = [
        "| optimizer | chosen η | chosen λ | test loss | test accuracy | train−test acc. gap "
        "| λ = 0: test loss | λ = 0: train−test acc. gap | copying: steps to target (per seed) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for res in doc["optimizers"].values():
        ev, cp = res["evaluation"], res["copying"]
        zero = ev.get("at_zero")
        hits = ", ".join("—" if h is None else str(h) for h in cp["steps_to_target"])
        lines.append(
            f"| {res['label']} | {ev['hparams']['learning_rate']:.3g} | "
            f"{ev['hparams']['weight_decay']:.3g} | {_pm(ev['test_loss'])} | "
            f"{_pm(ev['test_accuracy'])} | {_pm(ev['gap_accuracy'])} | "
            f"{_pm(zero['test_loss']) if zero else '—'} | "
            f"{_pm(zero['gap_accuracy']) if zero else '—'} | {hits} "
            f"(η = {cp['best_learning_rate']:.3g}) |"
        )
    lines.append("")
    lines.append(
        "— : the target was not reached within the budget. Effective decay per step (median over "
        "decayed elements, at the peak learning rate, end-of-training ν̂): "
        + "; ".join(
            f"{r['label']} {_median_effective_decay(r):.2e}" for r in doc["optimizers"].values()
        )
        + "."
    )
    if "verdicts" in doc:
        lines += ["", comparison_text(doc["verdicts"])]
    return "\n".join(lines)
