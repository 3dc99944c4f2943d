"""Sphinx configuration of the optax-decoupled documentation site.

Build (warnings are errors, as in CI)::

    make docs                   # sphinx-build -W --keep-going -b html docs build/docs/html
    make notebooks              # re-run the notebooks at default size, storing their outputs
    make docs NB_EXECUTE=cache  # run the notebooks inside the build instead (cached)

Markdown pages are MyST (``myst-nb`` also renders ``notebooks/*.ipynb`` through the
``docs/notebooks`` symlink); the API reference is ``autodoc`` + ``napoleon`` over the
docstrings of ``optax_decoupled``, ``optax_decoupled.diagnostics`` and
``optax_decoupled.contrib``, whose math MathJax renders in the browser. Nothing here needs
network access at build time.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

from docutils import nodes
from sphinx.util.docutils import SphinxDirective

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # document the working tree, installed or not
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import optax_decoupled  # noqa: E402

project = "optax-decoupled"
author = "optax-decoupled developers"
copyright = "optax-decoupled developers, Apache-2.0"
release = optax_decoupled.__version__
version = release

extensions = [
    "myst_nb",  # MyST Markdown + notebooks (includes myst_parser)
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.mathjax",
    "sphinx.ext.viewcode",
]

root_doc = "index"
exclude_patterns = ["_build", "examples", "**/.ipynb_checkpoints", "Thumbs.db", ".DS_Store"]

# --- MyST / notebooks -------------------------------------------------------------------------
myst_enable_extensions = ["dollarmath", "amsmath", "colon_fence", "deflist"]
myst_heading_anchors = 3
# Notebooks are committed with the outputs of a default-size run (`make notebooks`); the site
# shows those. `make docs NB_EXECUTE=cache` (or force) runs them again inside the build.
nb_execution_mode = "off"
nb_execution_timeout = 1800
nb_execution_raise_on_error = True
nb_execution_show_tb = True
nb_merge_streams = True

# --- API reference ----------------------------------------------------------------------------
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_preserve_defaults = True
autodoc_type_aliases = {
    "optax.ScalarOrSchedule": "optax.ScalarOrSchedule",
    "optax.GradientTransformation": "optax.GradientTransformation",
    "optax.Updates": "optax.Updates",
    "masks_lib.MaskArg": "MaskArg",
    "storage_lib.StateDtype": "StateDtype",
    "MaskArg": "MaskArg",
    "StateDtype": "StateDtype",
}
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_ivar = True  # "Attributes:" as fields, not duplicates of NamedTuple fields
python_use_unqualified_type_names = False

# --- HTML -------------------------------------------------------------------------------------
html_theme = "furo"
html_title = f"optax-decoupled {release}"
html_static_path: list[str] = []
html_show_sourcelink = True


# --- the CLI table, generated from optax_decoupled.cli.SUBCOMMANDS ----------------------------
class SubcommandsDirective(SphinxDirective):
    """``{optax-decoupled-subcommands}``: a table of the CLI's subcommands and descriptions."""

    has_content = False

    def run(self):
        from optax_decoupled.cli import SUBCOMMANDS

        table = nodes.table()
        group = nodes.tgroup(cols=2)
        table += group
        group += nodes.colspec(colwidth=20)
        group += nodes.colspec(colwidth=80)
        head, body = nodes.thead(), nodes.tbody()
        group += head
        group += body

        def row(*cells, literal=False):
            r = nodes.row()
            for i, text in enumerate(cells):
                entry = nodes.entry()
                para = nodes.paragraph()
                para += nodes.literal(text, text) if (literal and i == 0) else nodes.Text(text)
                entry += para
                r += entry
            return r

        head += row("subcommand", "what it does")
        for name, _module, description in SUBCOMMANDS:
            body += row(f"optax-decoupled {name}", description, literal=True)
        return [table]


def _skip_namedtuple_fields(app, what, name, obj, skip, options):
    """NamedTuple fields document themselves as "Alias for field number N": leave them out."""
    doc = getattr(obj, "__doc__", None) or ""
    if what == "class" and doc.startswith("Alias for field number"):
        return True
    return None


# --- pages that may not exist yet ------------------------------------------------------------
# index.md lists the notebooks as a toctree glob pattern (`notebooks/*`), so that a new notebook
# shows up in the navigation as soon as its file exists. Sphinx warns about a pattern that
# matches nothing, and its warning cannot be suppressed (Sphinx 9 logs it without a warning
# type), so such lines are dropped from the source before parsing.
_GLOB_LINE = re.compile(r"^([A-Za-z0-9_./-]*\*)[ \t]*$", re.MULTILINE)


def _drop_empty_globs(app, docname, source):
    if docname != root_doc:
        return
    srcdir = Path(app.srcdir)

    def keep(match):
        pattern = match.group(1)
        found = any(srcdir.glob(pattern + ".md")) or any(srcdir.glob(pattern + ".ipynb"))
        return match.group(0) if found else ""

    source[0] = _GLOB_LINE.sub(keep, source[0])


def _reread_index(app, env, added, changed, removed):
    """Re-read index.md on every build, so that its globs see pages added since the last one."""
    return [root_doc]


def setup(app):
    app.add_directive("optax-decoupled-subcommands", SubcommandsDirective)
    app.connect("autodoc-skip-member", _skip_namedtuple_fields)
    app.connect("source-read", _drop_empty_globs)
    app.connect("env-get-outdated", _reread_index)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
