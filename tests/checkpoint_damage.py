"""Shared by the checkpoint tests (``test_reliability.py`` and the trainer's resume test in
``integration/test_experiments_training.py``): a checkpoint's files, and damage to them."""

import os
import pathlib


def file_bytes(directory: pathlib.Path) -> dict[str, bytes]:
    """Every file under ``directory``, by relative path."""
    return {
        str(p.relative_to(directory)): p.read_bytes() for p in directory.rglob("*") if p.is_file()
    }


def corrupt(step_dir: pathlib.Path) -> None:
    """Overwrites every file of a saved step's state (there must be some)."""
    damaged = 0
    for dirpath, _, files in os.walk(step_dir / "state"):
        for name in files:
            with open(os.path.join(dirpath, name), "wb") as f:
                f.write(b"not a checkpoint")
            damaged += 1
    assert damaged > 0
