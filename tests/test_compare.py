"""The comparison, the lr × wd grid and the report, at smoke size; analysis by hand."""

import argparse
import dataclasses
import json

import numpy as np
import pytest

from optax_decoupled import cli
from optax_decoupled.experiments import compare, grid, plots, report
from optax_decoupled.experiments import train as train_lib


def test_analyse_axis_aligned_basin():
    lrs = np.array([1e-4, 1e-3, 1e-2, 1e-1])
    wds = np.array([1e-3, 1e-2, 1e-1, 1.0])
    # the best weight decay is 1e-1 whatever the learning rate: slope 0
    loss = 1.0 + (np.log10(wds)[None, :] + 1) ** 2 + 0.1 * (np.log10(lrs)[:, None] + 2) ** 2
    a = grid.analyse(loss, lrs, wds, tolerance=0.5)
    assert a["best_wd_per_lr"] == [0.1] * 4
    assert a["log_slope"] == pytest.approx(0.0, abs=1e-12)
    assert a["best"] == {"learning_rate": 1e-2, "weight_decay": 0.1, "val_loss": 1.0}


def test_analyse_diagonal_valley():
    lrs = np.array([1e-4, 1e-3, 1e-2, 1e-1])
    wds = np.array([1e-3, 1e-2, 1e-1, 1.0])
    # only the product lr * wd matters, optimum at lr * wd = 1e-4: slope -1, correlation -1
    x = np.log10(lrs)[:, None] + np.log10(wds)[None, :]
    loss = 1.0 + (x + 4) ** 2
    a = grid.analyse(loss, lrs, wds, tolerance=0.01)
    assert a["log_slope"] == pytest.approx(-1.0)
    assert a["near_optimal_corr"] == pytest.approx(-1.0)
    assert a["near_optimal_cells"] == 4  # the anti-diagonal lr * wd = 1e-4


def test_analyse_ignores_diverged_cells():
    loss = np.array([[1.0, np.nan], [np.inf, 0.5]])
    a = grid.analyse(loss, [1e-3, 1e-2], [0.1, 1.0])
    assert a["best"]["val_loss"] == 0.5
    assert a["best_wd_per_lr"] == [0.1, 1.0]


def test_a_learning_rate_whose_runs_all_diverged_has_no_best_weight_decay():
    """Not the grid's first weight decay (what argmin over a row of infinities gives): no
    value, left out of the slope, printed as a dash and drawn as a gap."""
    lrs, wds = [1e-3, 1e-2, 1e-1], [0.01, 0.1, 1.0]
    loss = np.array([[1.0, 0.9, 1.2], [0.8, 0.7, 0.75], [np.nan, np.inf, np.nan]])
    a = grid.analyse(loss, lrs, wds)
    assert a["best_wd_per_lr"] == [0.1, 0.1, None]
    assert a["log_slope"] == pytest.approx(0.0, abs=1e-12)
    doc = {"optimizers": {"adamw": {"label": "AdamW", "runs": 9, "analysis": a}}}
    assert grid.summary_table(doc).splitlines()[2].endswith("| 0.1, 0.1, — |")
    cells = loss[..., None].tolist()  # one seed
    res = {"label": "AdamW", "learning_rates": lrs, "weight_decays": wds, "analysis": a,
           "val_loss": cells, "test_accuracy": cells}  # fmt: skip
    fig = plots.grid_figure({"optimizers": {"adamw": res}})
    line = fig.axes[0].lines[0]
    np.testing.assert_array_equal(line.get_xdata(), [0.1, 0.1, np.nan])


def test_the_heatmap_blanks_a_cell_where_one_seed_diverged():
    """As the analysis counts it: not the mean of the seeds that did not diverge."""
    lrs, wds = [1e-3, 1e-2], [0.1, 1.0]
    val = np.array([[[1.0, 1.2], [0.9, np.nan]], [[0.8, 0.8], [0.7, 0.9]]])  # (lr, wd, seed)
    a = grid.analyse(val.mean(axis=2), lrs, wds)
    res = {"label": "AdamW", "learning_rates": lrs, "weight_decays": wds, "analysis": a,
           "val_loss": val.tolist(), "test_accuracy": val.tolist()}  # fmt: skip
    mesh = plots.grid_figure({"optimizers": {"adamw": res}}).axes[0].collections[0]
    shown = np.ma.filled(mesh.get_array().astype(float), np.nan).reshape(2, 2)
    np.testing.assert_array_equal(shown, [[1.1, np.nan], [0.8, 0.8]])


def test_specs_centre_lion_and_scale_decay_by_convention():
    specs = compare.default_specs((1e-3, 1e-2), 3)
    assert specs["lion"].lrs == pytest.approx((2e-4, 2e-3))
    assert specs["lion"].wds == pytest.approx(tuple(5 * w for w in specs["adamw"].wds))
    assert specs["adamw_schedule"].convention == "schedule"
    assert specs["adam_l2"].coupled and not specs["adamw"].coupled
    assert specs["amsgrad"].amsgrad == "pytorch"
    with pytest.raises(ValueError, match="unknown optimizers"):
        compare.CompareConfig(optimizers=("sgd",)).specs()


def test_a_finished_run_at_another_scale_is_not_replaced_silently(tmp_path, capsys):
    """A results directory holding a finished run at another scale is refused unless forced,
    not overwritten; the CLI says so in one line, as for an output path it cannot
    create."""
    part = tmp_path / "grid"
    part.mkdir()
    (part / "results.json").write_text("{}")
    (part / "complete.json").write_text(json.dumps({"scale": "quick", "wall_time_s": 1.0}))
    with pytest.raises(report.OutputConflict, match="finished 'quick' run of 'grid'"):
        report.run_part("grid", "smoke", part, progress=False)
    assert json.loads((part / "complete.json").read_text())["scale"] == "quick"
    argv = ["report", "--scale", "smoke", "--parts", "grid", "--out", str(tmp_path)]
    assert cli.main(argv) == 2
    assert "pass --force" in capsys.readouterr().err
    # The part's own subcommand neither (its default --out is the report's folder for it).
    assert cli.main(["grid", "--scale", "smoke", "--out", str(part)]) == 2
    assert "pass --force" in capsys.readouterr().err
    assert json.loads((part / "complete.json").read_text())["scale"] == "quick"
    not_a_directory = tmp_path / "a_file"
    not_a_directory.write_text("")
    assert cli.main(["reddi", "--smoke", "--out", str(not_a_directory / "sub")]) == 2
    assert "optax-decoupled reddi: error:" in capsys.readouterr().err


def test_output_conflicts_are_found_before_any_part_runs(tmp_path, monkeypatch, capsys):
    """``report --parts reddi grid`` ran reddi (minutes of compare at quick scale) before it
    found grid's conflict; a marker of another part was not noticed (``grid --out
    results/compare`` would replace compare's results) and a corrupt one was a traceback."""
    calls = []

    def runner(scale, directory, progress, **options):
        calls.append(directory.name)
        return {"value": directory.name}

    fake = {p: (runner, lambda doc, p: f"## part {p}\n") for p in report.PARTS}
    monkeypatch.setattr(report, "RUNNERS", fake)

    def finished(name, marker):
        (tmp_path / name).mkdir()
        (tmp_path / name / "results.json").write_text("{}")
        (tmp_path / name / "complete.json").write_text(marker)

    finished("grid", json.dumps({"part": "grid", "scale": "quick", "wall_time_s": 1.0}))
    with pytest.raises(report.OutputConflict, match="finished 'quick' run of 'grid'"):
        report.run_report(tmp_path, scale="smoke", parts=("reddi", "grid"), progress=False)
    assert calls == [] and not (tmp_path / "reddi").exists()
    # A directory holding another part's finished run, at the same scale.
    finished("compare", json.dumps({"part": "grid", "scale": "smoke", "wall_time_s": 1.0}))
    with pytest.raises(report.OutputConflict, match="finished run of 'grid', not of 'compare'"):
        report.run_part("compare", "smoke", tmp_path / "compare", progress=False)
    # A corrupt marker: a one-line error from the CLI, not a JSONDecodeError traceback.
    finished("memory", "{not json")
    argv = ["report", "--scale", "smoke", "--parts", "memory", "--out", str(tmp_path)]
    assert cli.main(argv) == 2
    assert "cannot be read as a completion marker" in capsys.readouterr().err
    assert calls == []
    report.run_part("memory", "smoke", tmp_path / "memory", force=True, progress=False)
    assert calls == ["memory"]


def test_report_includes_the_parts_finished_earlier(tmp_path, monkeypatch):
    """``report.md`` has a section for every part finished at the scale in the directory, in
    the usual order, those of earlier invocations marked in the wall-time table; a part
    finished at another scale is left out, and one whose results cannot be read is named in
    the log instead of failing the report. (Stand-in parts: no training.)"""

    def runner(scale, directory, progress, **options):
        return {"value": directory.name}

    fake = {p: (runner, lambda doc, p: f"## part {p}: {doc['value']}\n") for p in report.PARTS}
    monkeypatch.setattr(report, "RUNNERS", fake)
    report.run_report(tmp_path, scale="smoke", parts=("reddi", "compare"), progress=False)
    (tmp_path / "grid").mkdir()
    (tmp_path / "grid" / "results.json").write_text(json.dumps({"value": "grid"}))
    (tmp_path / "grid" / "complete.json").write_text(
        json.dumps({"scale": "quick", "wall_time_s": 1.0})
    )
    (tmp_path / "memory").mkdir()
    (tmp_path / "memory" / "results.json").write_text("{")
    (tmp_path / "memory" / "complete.json").write_text(
        json.dumps({"scale": "smoke", "wall_time_s": 1.0})
    )
    logs = []
    path = report.run_report(
        tmp_path, scale="smoke", parts=("compare",), progress=False, log=logs.append
    )
    text = path.read_text()
    assert text.index("## part reddi: reddi") < text.index("## part compare: compare")
    assert "## part grid" not in text and "## part memory" not in text
    assert "| reddi |" in text and "(from an earlier run)" in text.split("| reddi |")[1][:40]
    assert any("reddi: finished by an earlier run, included" in line for line in logs)
    assert any("memory: an earlier run's results could not be included" in line for line in logs)


def test_config_chunk_reaches_every_grid(tmp_path, monkeypatch):
    """``--config-chunk`` (``run_part(..., config_chunk=)``) is what every grid of the
    comparison (selection and copying) and of the lr × wd part trains with. The trainer is
    stopped at its first call: what matters is the ``TrainConfig`` it gets."""

    class Stop(Exception):
        pass

    seen = []

    def recording(*args, **kwargs):
        seen.append(args[5].config_chunk)  # the TrainConfig
        raise Stop

    monkeypatch.setattr(train_lib, "train_grid", recording)
    for part, chunk in (("compare", 2), ("grid", None), ("grid", 1)):
        with pytest.raises(Stop):
            report.run_part(part, "smoke", tmp_path / part, progress=False, config_chunk=chunk)
        assert seen.pop() == chunk
    cfg = dataclasses.replace(compare.CompareConfig.preset("smoke"), config_chunk=3)
    best = {"learning_rate": 1e-3, "weight_decay": 0.0}
    with pytest.raises(Stop):
        compare.copy_speed(cfg.specs()["adamw"], best, cfg, progress=False)
    assert seen.pop() == 3


@pytest.mark.parametrize("text, value", [("auto", "auto"), ("none", None), ("1", 1), ("45", 45)])
def test_config_chunk_option(text, value):
    assert cli.config_chunk_arg(text) == value
    args = cli.add_report_arguments(argparse.ArgumentParser()).parse_args(["--config-chunk", text])
    assert args.config_chunk == value


@pytest.mark.parametrize("text", ["0", "-2", "2.5", "all", ""])
def test_config_chunk_option_rejects(text, capsys):
    with pytest.raises(SystemExit):
        cli.add_report_arguments(argparse.ArgumentParser()).parse_args(["--config-chunk", text])
    assert "--config-chunk" in capsys.readouterr().err


def test_part_subcommands(tmp_path, monkeypatch, capsys):
    """``optax-decoupled compare|grid|memory``: run the part afresh into ``--out`` (the
    report's folder by default), replace a finished run at the same scale, refuse one at
    another scale unless ``--force``, and run the smoke scale under OPTAX_DECOUPLED_SMOKE as
    the report does. (Stand-in parts: no training.)"""
    ran = []

    def runner(scale, directory, progress, **options):
        ran.append(scale)
        return {"value": len(ran), "optimizers": {}}  # what grid's summary table reads

    fake = {p: (runner, lambda doc, p: "") for p in report.PARTS}
    monkeypatch.setattr(report, "RUNNERS", fake)
    monkeypatch.delenv("OPTAX_DECOUPLED_SMOKE", raising=False)
    out = tmp_path / "grid"
    for part in ("compare", "grid", "memory"):
        assert cli.build_parser(part).parse_args([part]).out == f"results/{part}"

    def main(*argv):
        return cli.main(["grid", "--out", str(out), "--no-progress", *argv])

    def written():
        return json.loads((out / "results.json").read_text())

    assert main("--scale", "quick") == 0
    assert written()["value"] == 1 and written()["scale"] == "quick"
    assert main("--scale", "quick") == 0  # the same scale: replaced, not skipped
    assert written()["value"] == 2
    assert main("--scale", "smoke") == 2  # another scale: refused, nothing run
    assert "pass --force" in capsys.readouterr().err and len(ran) == 2
    assert written()["scale"] == "quick"
    assert main("--scale", "smoke", "--force") == 0
    assert written()["scale"] == "smoke"
    monkeypatch.setenv("OPTAX_DECOUPLED_SMOKE", "1")
    assert main("--scale", "quick", "--force") == 0
    assert ran[-1] == "smoke" and "ignoring --scale quick" in capsys.readouterr().err


def _swept(label, lrs, wds, test_loss, chosen):
    """A comparison entry with a sweep whose test losses are given, ``(lr, wd, seed)``."""
    test_loss = np.asarray(test_loss, float)
    sweep = {"learning_rate": list(lrs), "weight_decay": list(wds), "seeds": [1, 2, 3],
             "test_loss": test_loss.tolist(), "test_accuracy": (1 - test_loss).tolist(),
             "val_loss": test_loss.tolist()}  # fmt: skip
    ev = {"hparams": {"learning_rate": chosen[0], "weight_decay": chosen[1]}, "seeds": [1, 2, 3],
          "sweep": sweep}  # fmt: skip
    return {"label": label, "evaluation": ev}


def test_verdicts_pair_the_chosen_cells_by_seed():
    """Known differences: AdamW's chosen λ is better than λ = 0 by exactly 0.1 on every seed
    (an interval of zero width below 0); Adam + L2 and AdamW differ by seed-dependent amounts
    whose mean is 0 (not distinguishable)."""
    from optax_decoupled.experiments import verdicts

    lrs, wds = [1e-3, 1e-2], [0.0, 0.1, 1.0]
    base = np.array([0.5, 0.6, 0.7])  # per seed
    adamw = np.broadcast_to(base, (2, 3, 3)).copy()
    adamw[1, 2] = base - 0.1  # chosen: lr 1e-2, λ 1
    coupled = np.broadcast_to(base, (2, 3, 3)).copy()
    coupled[0, 1] = base - 0.1 + np.array([-0.05, 0.0, 0.05])
    doc = {"optimizers": {
        "adam_l2": _swept("L2", lrs, wds, coupled, (1e-3, 0.1)),
        "adamw": _swept("W", lrs, wds, adamw, (1e-2, 1.0)),
    }}  # fmt: skip
    v = verdicts.comparison_verdicts(doc)
    w = v["decay"]["adamw"]
    assert w["mean"] == pytest.approx(-0.1) and w["verdict"] == "λ = 1 better"
    assert w["accuracy"]["mean"] == pytest.approx(0.1)
    (pair,) = v["pairs"]
    assert (pair["a"], pair["b"]) == ("adam_l2", "adamw")
    assert pair["mean"] == pytest.approx(0.0, abs=1e-12)
    assert pair["verdict"] == "not distinguishable" and pair["low"] < 0 < pair["high"]
    text = verdicts.comparison_text(v)
    assert "- W: λ = 1 − λ = 0: -0.1000" in text and "coupled L2 or decoupled decay" in text
    doc["optimizers"]["adamw"]["evaluation"]["seeds"] = [4, 5, 6]
    with pytest.raises(ValueError, match="different seeds"):
        verdicts.comparison_verdicts(doc)


def test_the_grid_part_reads_the_comparisons_sweeps():
    """The positive weight decays of the optimizers swept over several learning rates, with
    the separability of a landscape whose best λ moves as 1/η (slope −1, coupled)."""
    lrs, wds = [1e-3, 1e-2, 1e-1], [0.0, 1e-3, 1e-2, 1e-1, 1.0, 10.0]
    log_lr, log_wd = np.log10(lrs)[:, None], np.log10(np.maximum(wds, 1e-9))[None, :]
    loss = 1 + 0.1 * (log_wd - (-3 - log_lr)) ** 2  # λ* = 1e-3 / η
    seeds = loss[..., None] + 1e-3 * np.random.default_rng(0).standard_normal((3, 6, 3))
    doc = {"config": {}, "optimizers": {
        "adamw": _swept("W", lrs, wds, seeds, (1e-2, 1e-2)),
        "lion": _swept("L", [1e-3], wds, seeds[:1], (1e-3, 1e-2)),
    }}  # fmt: skip
    g = grid.from_comparison(doc)
    assert list(g["optimizers"]) == ["adamw"]  # Lion has one learning rate: no grid
    res = g["optimizers"]["adamw"]
    assert res["weight_decays"] == wds[1:]
    np.testing.assert_array_equal(res["val_loss"], seeds[:, 1:])
    sep = res["separability"]
    assert sep["verdict"] == "coupled" and sep["slope"] == pytest.approx(-1.0, abs=0.05)
    assert "coupled: slope -1.0" in grid.summary_table(g)


def test_the_report_grid_reuses_the_comparisons_sweeps(tmp_path, monkeypatch):
    """The report's grid part analyses ``<out>/compare`` when it finished at the same scale
    (no training), and trains its own sweeps when it did not or has none (an older schema)."""
    trained = []
    monkeypatch.setattr(grid, "run_grid", lambda cfg, progress: trained.append(cfg) or
                        {"optimizers": {}, "source": "trained"})  # fmt: skip
    monkeypatch.setattr(plots, "grid_figures", lambda doc, out: [])
    lrs, wds = [1e-3, 1e-2], [0.0, 0.1, 1.0]
    comp = {"config": {}, "optimizers": {"adamw": _swept("W", lrs, wds, np.ones((2, 3, 3)),
                                                          (1e-3, 0.1))}}  # fmt: skip
    (tmp_path / "compare").mkdir()
    (tmp_path / "compare" / "results.json").write_text(json.dumps(comp))
    (tmp_path / "compare" / "complete.json").write_text(
        json.dumps({"part": "compare", "scale": "smoke", "wall_time_s": 1.0})
    )
    doc = report._run_grid("smoke", tmp_path / "grid", progress=False)
    assert doc["source"] == "compare" and list(doc["optimizers"]) == ["adamw"] and not trained
    report._run_grid("quick", tmp_path / "grid", progress=False)  # another scale: trains
    del comp["optimizers"]["adamw"]["evaluation"]["sweep"]
    (tmp_path / "compare" / "results.json").write_text(json.dumps(comp))
    report._run_grid("smoke", tmp_path / "grid", progress=False)  # no sweeps: trains
    assert [c.steps for c in trained] == [
        compare.CompareConfig.preset("quick").steps,
        compare.CompareConfig.preset("smoke").steps,
    ]
