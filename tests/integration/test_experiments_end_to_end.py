"""The experiments end to end at smoke size: the report (the main job) with its resume, the
Reddi command with its results file and figures, the comparison's vmapped grid against its
runs one by one, and the memory report's measurements (compiled SSM training steps) and
quality comparison. (tests/test_train.py checks a vmapped grid against a plain loop.)
"""

import json

import jax
import numpy as np

from optax_decoupled import cli
from optax_decoupled.experiments import (
    compare,
    plots,
    reddi_simulation,
    report,
    state_memory,
    state_precision,
    tasks,
)
from optax_decoupled.experiments import train as train_lib


def test_report_smoke_schema_and_resume(tmp_path):
    """The main job at smoke size: every optimizer ran, files have their schema, and a second
    invocation resumes (skips finished parts) instead of recomputing."""
    path = report.run_report(tmp_path, scale="smoke", parts=("compare", "grid"), progress=False)
    text = path.read_text()
    assert "## Coupled L2 vs AdamW" in text and "## Learning rate × weight decay" in text
    env = json.loads((tmp_path / "environment.json").read_text())
    assert {"jax", "optax", "optax_decoupled", "device_kind"} <= set(env)

    doc = json.loads((tmp_path / "compare" / "results.json").read_text())
    cfg = compare.CompareConfig.preset("smoke")
    assert list(doc["optimizers"]) == list(cfg.optimizers)
    for name, res in doc["optimizers"].items():
        ev = res["evaluation"]
        assert ev["runs"] == len(res["grid"]["learning_rate"]) * len(
            res["grid"]["weight_decay"]
        ) * len(cfg.eval_seeds)
        assert len(ev["test_accuracy"]["values"]) == len(cfg.eval_seeds)
        assert 0.0 <= ev["test_accuracy"]["mean"] <= 1.0
        curve = np.asarray(ev["train_loss_curve"])
        assert curve.shape == (cfg.steps,) and np.all(np.isfinite(curve))
        assert len(set(curve.round(6))) > 1, f"{name} did not train"
        diag = ev["diagnostics"]
        assert diag["effective_decay"]["n"] > 0
        assert sum(diag["effective_decay"]["log10_histogram"]) == diag["effective_decay"]["n"]
        assert {"below_1e-12", "above_1"} <= set(diag["effective_decay"])
        assert "norm/decayed" in diag["group_norms"]
        ratios = np.asarray(list(diag["update_ratios"].values()))
        assert np.all(np.isfinite(ratios)) and np.all(ratios > 0), diag["update_ratios"]
        assert res["copying"]["steps_budget"] == cfg.copy_steps
        # The learning rates as trained, unrounded (the best one was parsed back from a
        # 3-digit display key before), and the best among them.
        cp_lrs = [v["learning_rate"] for v in res["copying"]["per_learning_rate"].values()]
        assert res["copying"]["best_learning_rate"] in cp_lrs
        assert sorted(cp_lrs) == sorted(
            ev["hparams"]["learning_rate"] * f for f in cfg.copy_lr_factors
        ), (cp_lrs, ev["hparams"])
        assert len(res["copying"]["steps_to_target"]) == len(cfg.eval_seeds)
    for fig in doc["figures"]:
        assert (tmp_path / "compare" / fig).stat().st_size > 1000

    # The grid part analyses the comparison's sweeps (no training of its own): the swept
    # optimizers, their positive weight decays, the same numbers.
    gdoc = json.loads((tmp_path / "grid" / "results.json").read_text())
    assert gdoc["source"] == "compare" and list(gdoc["optimizers"]) == list(cfg.lr_sweep)
    for name in cfg.lr_sweep:
        res, sweep = gdoc["optimizers"][name], doc["optimizers"][name]["evaluation"]["sweep"]
        shape = (len(cfg.lrs), cfg.n_wd, len(cfg.eval_seeds))
        assert np.asarray(res["val_loss"]).shape == shape
        np.testing.assert_array_equal(np.asarray(sweep["val_loss"])[:, 1:], res["val_loss"])
        assert res["analysis"]["best"]["learning_rate"] in cfg.lrs
        assert res["separability"]["verdict"] in ("separable", "coupled", "inconclusive")
    assert set(doc["verdicts"]["decay"]) <= set(cfg.optimizers)
    assert [(p["a"], p["b"]) for p in doc["verdicts"]["pairs"]] == [
        ("adam_l2", "adamw"),
        ("adamw", "lion"),
    ]

    marker = tmp_path / "compare" / "complete.json"
    before = marker.stat().st_mtime_ns
    logs = []
    report.run_report(
        tmp_path, scale="smoke", parts=("compare", "grid"), progress=False, log=logs.append
    )
    assert marker.stat().st_mtime_ns == before
    assert sum("already done, skipped" in line for line in logs) == 2
    # Rendered from results.json now, from the runs' own dicts before: the same settings
    # lines (tuples printed as "(1, 2)" in one and "[1, 2]" in the other before).
    settings = lambda t: [ln for ln in t.splitlines() if "seeds" in ln]  # noqa: E731
    assert settings(text) and settings((tmp_path / "report.md").read_text()) == settings(text)

    # One part asked for (twice): it runs once, and the report keeps the other finished part.
    logs.clear()
    path = report.run_report(
        tmp_path, scale="smoke", parts=("grid", "grid"), progress=False, log=logs.append
    )
    assert sum("already done, skipped" in line for line in logs) == 1
    assert any("compare: finished by an earlier run, included" in line for line in logs)
    text = path.read_text()
    assert text.index("## Coupled L2 vs AdamW") < text.index("## Learning rate × weight decay")
    assert "| compare |" in text and "| grid |" in text and "| reddi |" not in text


def test_reddi_cli_writes_results_and_figures(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("OPTAX_DECOUPLED_SMOKE", raising=False)
    out = tmp_path / "out"
    argv = ["--steps", "400", "--seeds", "1", "--phase-grid", "3", "--phase-steps", "200"]
    argv += ["--eps-steps", "200", "--optimizers", "adam,amsgrad_paper"]
    argv += ["--out", str(out), "--no-progress", "--no-fast-loops"]
    assert cli.main(["reddi", *argv]) == 0
    printed = capsys.readouterr().out
    assert "| theorem1 | sqrt | adam |" in printed and "results.json" in printed
    assert "| theorem1 | sqrt | sgd |" not in printed
    doc = json.loads((out / "results.json").read_text())
    assert doc["schema"] == "optax_decoupled.reddi/1"
    assert set(doc["versions"]) >= {"jax", "optax", "optax_decoupled", "python"}
    # where the simulations ran: the CPU device by default, also on a GPU host
    assert doc["device"] and doc["platform"] == reddi_simulation.simulation_device().platform
    assert set(doc["comparisons"]) == {
        "theorem1",
        "figure1_online",
        "theorem3",
        "figure1_stochastic",
    }
    comp = doc["comparisons"]["theorem1"]
    assert comp["steps"] == 400 and len(comp["runs"]) == 2 * 2  # 2 optimizers × 2 schedules
    run = comp["runs"][0]
    assert {"optimizer", "x_final", "avg_regret", "ends_at", "settled_at_minus1"} <= set(run)
    assert len(comp["x"]) == len(comp["runs"]) and len(comp["x"][0]) == len(comp["record_t"])
    assert "expected_gap" in doc["comparisons"]["theorem3"]["runs"][0]
    assert np.shape(doc["phase_diagrams"]["theorem1"]["x_final"]) == (3, 3)
    assert doc["phase_diagrams"]["figure1_online"]["b2_scale"] == "log"
    assert doc["single_run"]["steps"] == 400
    assert sorted(doc["figures"]) == sorted(
        [f"reddi_{k}_{s}.png" for k in ("x", "regret") for s in ("sqrt", "constant")]
        + ["reddi_phase.png", "reddi_eps.png"]
    )
    for name in doc["figures"]:
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # Figures can be redrawn from the saved JSON alone.
    path = plots.save(plots.reddi_phase_figure(doc), tmp_path / "again" / "phase.png")
    assert open(path, "rb").read(4) == b"\x89PNG"


def test_quality_comparison_smoke():
    rows = state_precision.quality_comparison(state_precision.QualityConfig.preset("smoke"))
    # Every tensor quantized: the default int8 storage keeps the small model's tensors in
    # float32 (under 4096 elements), and its row measured float32 under an int8 label.
    assert [r["state_dtype"] for r in rows] == ["float32", "int8 (B=256, all tensors)"]
    assert rows[0]["gap_vs_float32"] == 0.0 and rows[1]["gap_vs_float32"] != 0.0
    assert all(np.isfinite(r["val_loss_mean"]) for r in rows)


def test_vmapped_grid_equals_runs_one_by_one():
    """A 2 x 2 lr x wd grid trained as one program equals the four runs done separately."""
    task = tasks.sequential_digits(batch_size=8)
    cfg = compare.CompareConfig.preset("smoke")
    spec = compare.default_specs((1e-3, 1e-2), 2)["adamw"]
    make_tx = compare.make_tx_factory(spec, 4, 1, 1.0)
    hp, seeds = train_lib.product_grid(
        {"learning_rate": spec.lrs, "weight_decay": spec.wds}, seeds=[0]
    )
    tcfg = train_lib.TrainConfig(steps=4, eval_every=4, progress=False, final_splits=("val",))
    model = cfg.model_config(task)
    together = train_lib.train_grid(task, model, make_tx, hp, seeds, tcfg)
    for i, run in enumerate(together.runs):
        alone = train_lib.train(
            task, model, make_tx, seed=0, hparams={n: v[i] for n, v in hp.items()}, config=tcfg
        )
        np.testing.assert_allclose(run.train_loss, alone.train_loss, rtol=2e-5)
        for a, b in zip(jax.tree.leaves(run.params), jax.tree.leaves(alone.params), strict=True):
            np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-6)


def test_l2_vs_adamw_same_state_same_memory():
    rows = state_memory.l2_vs_adamw_memory((2,), d_model=16, n_layers=1)
    l2, w = rows
    assert (l2["optimizer"], w["optimizer"]) == ("adam_l2", "adamw")
    assert l2["state_bytes"] == w["state_bytes"]
    assert l2["state_shapes"] == w["state_shapes"]
    assert l2["arguments"] == w["arguments"]
    # Same buffers up to the few scalars/elementwise temporaries of each chain.
    assert abs(l2["peak"] - w["peak"]) <= 0.05 * w["peak"]
