"""Numbers and tables as the reports print them."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import numpy as np

import optax_decoupled as od


def number(value: Any, spec: str) -> str:
    """``format(value, spec)``, except that a value that rounds to zero prints without a
    minus sign: ``number(-0.001, "+.2f")`` is ``"+0.00"``, not ``"-0.00"`` (a slope or a
    gap too small to show has no direction). What Python 3.11's ``z`` option does, for
    every supported Python."""
    text = format(value, spec)
    digits = re.sub(r"[^0-9]", "", re.split(r"[eE]", text)[0])  # the mantissa's digits
    if text.startswith("-") and digits and not digits.strip("0"):
        return ("+" if "+" in spec else "") + text[1:]
    return text


def markdown_table(rows: Sequence[dict[str, Any]], columns: Sequence[str] | None = None,
                   formats: dict[str, str] | None = None) -> str:  # fmt: skip
    """A Markdown table of ``rows`` (dicts); ``formats`` maps a column to a format spec or to
    ``"bytes"`` (:func:`optax_decoupled.contrib.format_bytes`)."""
    if not rows:
        return ""
    columns = list(columns or rows[0])
    formats = formats or {}

    def cell(col, v):
        fmt = formats.get(col)
        if fmt == "bytes":
            return od.contrib.format_bytes(v)
        if fmt and isinstance(v, int | float | np.number):
            return number(v, fmt)
        return str(v)

    out = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    out += ["| " + " | ".join(cell(c, r.get(c, "")) for c in columns) + " |" for r in rows]
    return "\n".join(out)
