"""The committed notebooks carry the outputs of a run at their default size (``make
notebooks``), which the documentation site renders: every code cell executed in order, no
errors, the figures present, and the run not a smoke-size one. (``make test-integration`` also
executes each notebook at smoke size with nbmake; that run does not write back.)"""

import json
import pathlib

import pytest

NOTEBOOKS = sorted((pathlib.Path(__file__).parents[2] / "notebooks").glob("*.ipynb"))

# A line each notebook prints in its first code cell at default size (never at smoke size).
DEFAULT_SIZE_MARKERS = {
    "01_reddi_counterexample": "quick size",
    "02_ssm_comparison": "quick",
    "03_lr_wd_grid": "quick",
    "04_memory": "quick run",
    "05_implicit_bias": "quick size",
}
# Figures (PNG outputs) each notebook shows at least.
MIN_FIGURES = {
    "01_reddi_counterexample": 5,
    "02_ssm_comparison": 4,
    "03_lr_wd_grid": 2,
    "04_memory": 0,
    "05_implicit_bias": 3,
}


def _text(output) -> str:
    if output.get("output_type") == "stream":
        return "".join(output.get("text", ""))
    data = output.get("data", {})
    return "".join(data.get("text/plain", "")) + "".join(data.get("text/markdown", ""))


def test_every_notebook_is_listed():
    assert {p.stem for p in NOTEBOOKS} == set(DEFAULT_SIZE_MARKERS)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_stored_outputs_are_from_a_clean_default_size_run(path):
    nb = json.loads(path.read_text())
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    counts = [c.get("execution_count") for c in code]
    assert counts == list(range(1, len(code) + 1)), f"not run top to bottom: {counts}"
    outputs = [o for c in code for o in c.get("outputs", [])]
    errors = [o for o in outputs if o.get("output_type") == "error"]
    assert not errors, errors[0].get("ename")
    first = "".join(_text(o) for o in code[0].get("outputs", []))
    assert DEFAULT_SIZE_MARKERS[path.stem] in first and "smoke" not in first, first
    figures = sum("image/png" in o.get("data", {}) for o in outputs)
    assert figures >= MIN_FIGURES[path.stem], figures
    assert all(c.get("outputs") for c in code[1:]), "a code cell has no output"
