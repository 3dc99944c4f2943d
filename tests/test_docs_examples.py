"""The documentation's code runs and its claims hold.

* ``docs/examples/sharded_step.py`` (included in ``docs/devices.md``) on 8 simulated CPU
  devices; the device count is fixed when JAX starts, hence a subprocess.
* Every fenced ````` ```python ````` block of the guides, concatenated per page and run in a
  fresh interpreter (blocks assert the numbers the text states). Code that is shown but not
  run (PyTorch, placeholders) uses ````` ```{code-block} python ````` instead.
"""

import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
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
