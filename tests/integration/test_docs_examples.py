"""The documentation's code runs and its claims hold.

* ``docs/examples/sharded_step.py`` (included in ``docs/devices.md``) on 8 simulated CPU
  devices; the device count is fixed when JAX starts, hence a subprocess.
* Every fenced ````` ```python ````` block of the guides, concatenated per page and run in a
  fresh interpreter (blocks assert the numbers the text states). Code that is shown but not
  run (PyTorch, placeholders) uses ````` ```{code-block} python ````` instead.
* The README's Flax NNX snippet, called on data, and its runnable version
  ``examples/nnx_train_step.py``: both train.
"""

import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
FENCE = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.DOTALL | re.MULTILINE)


def python_blocks(page: pathlib.Path) -> list[str]:
    return FENCE.findall(page.read_text(encoding="utf-8"))


#: The pages of the site with runnable code (devices.md includes the example file instead).
PAGES = [p for p in sorted([DOCS / "index.md", *DOCS.glob("guides/*.md")]) if python_blocks(p)]


def run_python(args, *, env_extra=None, timeout=300):
    env = {**os.environ, "JAX_PLATFORMS": "cpu", **(env_extra or {})}
    proc = subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, timeout=timeout, env=env,
        cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc.stdout


def test_sharded_step_example_on_8_devices():
    out = run_python(
        [str(DOCS / "examples" / "sharded_step.py")],
        env_extra={"XLA_FLAGS": "--xla_force_host_platform_device_count=8"},
    )
    assert out.startswith("8 devices"), out


def test_the_guides_have_code():
    assert len(PAGES) >= 7, PAGES


def test_devices_page_includes_the_example():
    text = (DOCS / "devices.md").read_text(encoding="utf-8")
    assert "examples/sharded_step.py" in text


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(DOCS)))
def test_page_code_runs(page, tmp_path):
    script = tmp_path / "snippets.py"
    script.write_text("\n\n".join(python_blocks(page)), encoding="utf-8")
    run_python([str(script)])


def test_readme_example_file_trains():
    """`examples/nnx_train_step.py` (`make example`, the runnable version of the README's
    snippet) trains: the loss falls."""
    out = run_python([str(ROOT / "examples" / "nnx_train_step.py")])
    first, last = map(float, re.findall(r"step \d+ ([0-9.]+)", out))
    assert last < 0.6 * first, out


def test_readme_snippet_trains(tmp_path):
    """The README's Flax NNX snippet as printed (donated train step included) runs and
    trains when called."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    (snippet,) = [b for b in FENCE.findall(readme) if "nnx.Optimizer" in b]
    script = tmp_path / "readme_snippet.py"
    script.write_text(
        snippet
        + "\nx = jax.random.normal(jax.random.key(1), (256, 8))"
        + "\ny = jnp.sin(x.sum(axis=1, keepdims=True))"
        + "\nlosses = [float(train_step(model, optimizer, x, y)) for _ in range(100)]"
        + "\nassert losses[-1] < 0.8 * losses[0], losses[::10]"
        + "\nprint('ok')\n"
    )
    assert run_python([str(script)]).strip().endswith("ok")
