"""Numbers as the reports print them."""

from __future__ import annotations

import re
from typing import Any


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
