"""Where ``mask="auto"`` disagrees with each corpus file's ``source_decays``.

Runs with the project's own environment (no other library needed)::

    .venv/bin/python tests/golden/mask_corpus/compare.py [--all]

Prints one line per disagreeing leaf: source, path, shape, source_decays, auto, and the
reason ``"auto"`` gives (``auto_no_decay_reason``, or ``ndim`` when the ndim rule decided).
Leaves marked ``frozen`` (not trained by the source at all) are skipped unless ``--all``.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(HERE))))

from optax_decoupled._src.masks import auto_decays, auto_no_decay_reason  # noqa: E402


def load(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def disagreements(
    doc: dict, include_frozen: bool = False
) -> list[tuple[str, list[int], bool, bool, str]]:
    rows = []
    for leaf in doc["leaves"]:
        if leaf.get("frozen") and not include_frozen:
            continue
        comps = tuple(leaf["path"].split("/"))
        auto = auto_decays(comps, tuple(leaf["shape"]))
        if auto != leaf["source_decays"]:
            reason = auto_no_decay_reason(comps, tuple(leaf["shape"])) or (
                "ndim<2" if len(leaf["shape"]) < 2 else "ndim>=2"
            )
            rows.append((leaf["path"], leaf["shape"], leaf["source_decays"], auto, reason))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--all", action="store_true", help="also compare frozen leaves")
    args = ap.parse_args()
    total = 0
    for path in sorted(glob.glob(os.path.join(HERE, "*.json"))):
        doc = load(path)
        rows = disagreements(doc, args.all)
        n = sum(1 for leaf in doc["leaves"] if args.all or not leaf.get("frozen"))
        print(f"== {doc['source']}: {len(rows)} of {n} leaves disagree")
        for p, shape, src, auto, reason in rows:
            print(f"   {p:60s} {str(shape):16s} source={src!s:5s} auto={auto!s:5s} ({reason})")
        total += len(rows)
    print(f"total disagreements: {total}")


if __name__ == "__main__":
    main()
