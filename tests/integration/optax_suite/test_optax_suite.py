"""Optax's own tests, run against optax-decoupled.

The test downloads the source distribution of the installed Optax version from the package
index (``pip download --no-binary :all:``), extracts the test files listed in :data:`SUITE`
(they run against the installed ``optax`` package; no Optax code is kept in this repository)
and runs them in a pytest subprocess with the plugin :mod:`swap`, which replaces Optax's Adam,
AdamW, AMSGrad and Lion (aliases and ``scale_by_*`` transforms) with optax-decoupled's.

It passes when exactly the tests listed in ``expected_differences.toml`` fail or are skipped
for an argument optax-decoupled lacks: a failure not listed fails it, and so does a listed
test that now passes (edit the file). Skips that Optax's tests make themselves are reported
only. Set ``OPTAX_DECOUPLED_OFFLINE=1`` to skip it where there is no package index;
``OPTAX_SUITE_WORKERS`` sets the subprocess's pytest-xdist workers (default: up to 2, one per
core; 0 runs it in one process).
"""

from __future__ import annotations

import collections
import importlib.util
import json
import os
import pathlib
import re
import subprocess
import sys
import tarfile
import xml.etree.ElementTree as ET

import optax
import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli", reason="reading expected_differences.toml needs tomli")

HERE = pathlib.Path(__file__).resolve().parent
EXPECTED = HERE / "expected_differences.toml"
#: Must match ``swap.PREFIX`` (kept here so that this module does not import the plugin,
#: which swaps Optax's functions in the process that imports it).
PREFIX = "optax-decoupled:"

#: Optax's test files that reach the swapped functions: those of the sdist that mention adam,
#: adamw, amsgrad, lion or scale_by_adam/lion, and contrib/_muon_test.py (muon builds
#: optax.adamw). A ``file::Class::test`` entry runs that test alone (the rest of its file does
#: not reach optax-decoupled). transforms/_accumulation_test.py's mixed-precision test takes
#: about a minute per case; alias_test.py and contrib/_common_test.py are the longest files.
SUITE = (
    "optax/_src/alias_test.py",
    "optax/_src/transform_test.py",
    "optax/_src/float64_test.py",
    "optax/_src/combine_test.py",
    "optax/_src/sharding_test.py",
    "optax/_src/linesearch_test.py::ZoomLinesearchTest::test_value_and_grad_from_state",
    "optax/schedules/_inject_test.py",
    "optax/tree_utils/_state_utils_test.py",
    "optax/transforms/_accumulation_test.py",
    "optax/transforms/_combining_test.py",
    "optax/contrib/_common_test.py",
    "optax/contrib/_complex_valued_test.py",
    "optax/contrib/_galore_test.py",
    "optax/contrib/_muon_test.py",
    "optax/contrib/_sam_test.py",
    "optax/contrib/_schedule_free_test.py",
)

#: Reason classes of expected_differences.toml (its section names): deliberate differences.
CLASSES = (
    "integer-params",  # integer parameters are refused on purpose
    "early-validation",  # invalid arguments raise when the transform is built
    "other",  # anything else: the entry says what
)
#: Classes of arguments optax-decoupled lacks, whose tests the plugin skips: none. A skip for
#: a missing feature is reported as unlisted.
MISSING_FEATURES: tuple[str, ...] = ()

#: A failure message's substring -> the class suggested for a test not yet listed (the
#: first match; a suggestion only: read the failure before listing it).
SUGGESTIONS = (
    ("has dtype int", "integer-params"),
    ("has dtype uint", "integer-params"),
    ("has dtype bool", "integer-params"),
    ("must be one of", "early-validation"),
)

#: How the report names each outcome of :func:`_outcomes`.
OUTCOMES = {
    "passed": "passed",
    "failed": "failed",
    "ours": "skipped for a missing feature",
    "skipped": "skipped by Optax",
}
DOWNLOAD_TIMEOUT_S = 300
SUITE_TIMEOUT_S = 3600


def _workers() -> int:
    if os.environ.get("OPTAX_SUITE_WORKERS"):
        return int(os.environ["OPTAX_SUITE_WORKERS"])
    if importlib.util.find_spec("xdist") is None:
        return 0
    n = min(2, len(os.sched_getaffinity(0)))
    return n if n > 1 else 0


def _download_sdist(dest: pathlib.Path) -> pathlib.Path:
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
        "--disable-pip-version-check", f"optax=={optax.__version__}", "-d", str(dest),
    ]  # fmt: skip
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=DOWNLOAD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pytest.skip(
            f"downloading optax=={optax.__version__}'s sdist took over {DOWNLOAD_TIMEOUT_S}s"
        )
    archives = sorted(dest.glob("optax-*.tar.gz"))
    if proc.returncode != 0 or not archives:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        pytest.skip(
            f"cannot download optax=={optax.__version__}'s sdist (no package index?): "
            + " | ".join(tail)
        )
    return archives[0]


def _extract(archive: pathlib.Path, dest: pathlib.Path) -> None:
    """The files of :data:`SUITE` from ``archive`` under ``dest`` (``dest/optax/...``)."""
    wanted = {entry.split("::")[0] for entry in SUITE}
    with tarfile.open(archive) as tar:
        for member in tar.getmembers():
            parts = pathlib.PurePosixPath(member.name).parts
            rel = "/".join(parts[1:])  # drop the optax-<version>/ prefix
            if rel in wanted and member.isfile():
                target = dest / rel
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(tar.extractfile(member).read())
                wanted.discard(rel)
    assert not wanted, f"optax {optax.__version__}'s sdist lacks {sorted(wanted)}: update SUITE"


def _test_id(case: ET.Element) -> str:
    """The pytest id of a junit (xunit1) test case: ``file::Class::test``."""
    file, classname, name = case.get("file"), case.get("classname", ""), case.get("name")
    if not file:  # a collection error
        return f"{classname}::{name}" if classname else name
    module = file.removesuffix(".py").replace("/", ".")
    inner = classname.removeprefix(module).lstrip(".")
    return "::".join(p for p in (file, inner.replace(".", "::"), name) if p)


def _outcomes(junit: pathlib.Path) -> dict[str, tuple[str, str]]:
    """Test id -> (outcome, message); outcome is passed, failed (a failure or error, of the
    test or of a subtest), ours (skipped by the plugin: an argument optax-decoupled lacks) or
    skipped (by Optax's test); message joins the distinct starts of the test's
    failures' messages (or its skip reason), whitespace collapsed and cut to 160 characters."""
    out = {}
    for case in ET.parse(junit).iter("testcase"):
        failed = [c for c in case if c.tag in ("failure", "error")]
        skipped = [c for c in case if c.tag == "skipped"]
        if failed:
            outcome, notes = "failed", failed
        elif skipped:
            ours = skipped[0].get("message", "").startswith(PREFIX)
            outcome, notes = ("ours" if ours else "skipped"), skipped[:1]
        else:
            outcome, notes = "passed", []
        firsts = [" ".join((n.get("message") or "").split())[:160] for n in notes]
        out[_test_id(case)] = (outcome, " | ".join(dict.fromkeys(firsts)))
    return out


def _swap_records(out: pathlib.Path) -> dict:
    merged = {"calls": collections.Counter(), "reached": {}, "params": {}, "deselected": set()}
    for path in sorted(out.glob("swap-*.json")):
        record = json.loads(path.read_text())
        merged["calls"].update(record["calls"])
        merged["reached"].update(record["reached"])
        merged["params"].update(record["params"])
        merged["deselected"].update(record["deselected"])
        merged["swapped"] = record["swapped"]
    return merged


def _expected() -> dict[str, tuple[str, str]]:
    """Test id -> (class, reason) from expected_differences.toml."""
    data = tomllib.loads(EXPECTED.read_text())
    unknown = sorted(set(data) - set(CLASSES))
    assert not unknown, f"{EXPECTED.name}: unknown classes {unknown}; use one of {CLASSES}"
    out = {}
    for cls, entries in data.items():
        for test_id, reason in entries.items():
            assert test_id not in out, f"{EXPECTED.name}: {test_id} listed twice"
            out[test_id] = (cls, reason)
    return out


def _suggest(message: str) -> str:
    return next((cls for key, cls in SUGGESTIONS if key in message), "other")


def _toml_lines(entries: dict[str, tuple[str, str]]) -> list[str]:
    """``entries`` (test id -> (class, reason)) as sections of expected_differences.toml."""
    lines = []
    for cls in CLASSES:
        ids = sorted(t for t, (c, _) in entries.items() if c == cls)
        if ids:
            lines.append(f"[{cls}]")
            lines.extend(f"{json.dumps(t)} = {json.dumps(entries[t][1])}" for t in ids)
    return lines


def _describe(test_id: str, records: dict, detail: str = "") -> str:
    params = records["params"].get(test_id)
    return f"  {test_id}" + (f" {params}" if params else "") + (f": {detail}" if detail else "")


def compare(out: pathlib.Path, suite: pathlib.Path) -> tuple[list[str], list[str]]:
    """The report and the problems of a run whose junit.xml and swap-*.json are in ``out`` and
    whose test files are under ``suite``, against expected_differences.toml."""
    expected = _expected()
    results = _outcomes(out / "junit.xml")
    records = _swap_records(out)
    by_outcome = collections.defaultdict(set)
    for test_id, (outcome, _) in results.items():
        by_outcome[outcome].add(test_id)
    reached = set(records["reached"]) & set(results)
    per_file = collections.Counter(t.split("::")[0] for t in results)
    per_file_reached = collections.Counter(t.split("::")[0] for t in reached)
    calls = records["calls"]

    lines = [
        f"Optax {optax.__version__}'s tests against optax-decoupled: {len(results)} run, "
        + ", ".join(f"{label} {len(by_outcome[k])}" for k, label in OUTCOMES.items())
        + f"; {len(records['deselected'])} deselected (their optimizer does not reach it)",
        f"reaching optax-decoupled: {len(reached)}, "
        + ", ".join(f"{label} {len(by_outcome[k] & reached)}" for k, label in OUTCOMES.items()),
        "adapter calls: " + ", ".join(f"{n} {calls[n]}" for n in sorted(records["swapped"])),
        "files (tests run / reaching optax-decoupled):",
        *(f"  {f}: {n} / {per_file_reached[f]}" for f, n in sorted(per_file.items())),
        f"details (junit.xml, pytest.log, swap-*.json): {out}",
    ]

    problems = []
    # A swapped name that no test file of the suite mentions may go uncalled.
    sources = [p.read_text() for p in suite.rglob("*_test.py")]
    mentioned = {n for n in records["swapped"] if any(re.search(rf"\b{n}\b", s) for s in sources)}
    unswapped = sorted(n for n in mentioned if calls[n] == 0)
    if sum(calls.values()) == 0 or unswapped:
        problems.append(f"swapped functions never called: {unswapped or 'all'}")
    if set(records["swapped"]) - mentioned:
        lines.append(f"not mentioned by the suite: {sorted(set(records['swapped']) - mentioned)}")
    differing = by_outcome["failed"] | by_outcome["ours"]
    unlisted = {t: (_suggest(results[t][1]), results[t][1]) for t in differing - set(expected)}
    if unlisted:
        problems.append(
            f"{len(unlisted)} tests differ but are not in {EXPECTED.name}; the lines to add "
            "(suggested classes: read each failure first; reasons are the failure messages):"
        )
        problems.extend(_toml_lines(unlisted))
        described = [_describe(t, records) for t in sorted(unlisted) if t in records["params"]]
        problems.extend(["their parameters:", *described] if described else [])
    for test_id, (cls, reason) in sorted(expected.items()):
        outcome = results.get(test_id, ("not run", ""))[0]
        if outcome == "skipped":
            lines.append(f"listed but skipped by Optax: {test_id} ({cls}: {reason})")
        elif outcome in ("passed", "not run"):
            problems.append(f"listed as {cls} but {outcome} (remove it): {test_id}")
        elif cls != "other" and (outcome == "ours") != (cls in MISSING_FEATURES):
            problems.append(
                f"listed as {cls} but {outcome} (reclassify it): "
                + _describe(test_id, records, results[test_id][1]).strip()
            )
    return lines, problems


@pytest.mark.slow
def test_optax_suite_against_optax_decoupled(tmp_path):
    if os.environ.get("OPTAX_DECOUPLED_OFFLINE") == "1":
        pytest.skip("OPTAX_DECOUPLED_OFFLINE=1: Optax's sdist is not downloaded")
    _expected()  # a malformed file fails before the download
    archive = _download_sdist(tmp_path / "sdist")
    suite = tmp_path / "suite"
    suite.mkdir()
    _extract(archive, suite)
    (suite / "pytest.ini").write_text("[pytest]\n")
    out = tmp_path / "out"
    out.mkdir()
    junit = out / "junit.xml"

    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), env.get("PYTHONPATH")]))
    env["OPTAX_SUITE_OUT"] = str(out)
    # sharding_test.py asks for 8 host devices, which holds only before JAX starts.
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=8"
    env.pop("PYTEST_XDIST_WORKER", None)
    workers = _workers()
    cmd = [
        sys.executable, "-m", "pytest", "-c", "pytest.ini", "--rootdir", str(suite),
        "-p", "swap", "-p", "no:cacheprovider", "-q", "-rA",
        f"--junitxml={junit}", "-o", "junit_family=xunit1",
        *(["-n", str(workers)] if workers else []), *SUITE,
    ]  # fmt: skip
    proc = subprocess.run(
        cmd, cwd=suite, env=env, capture_output=True, text=True, timeout=SUITE_TIMEOUT_S
    )
    log = proc.stdout + proc.stderr
    (out / "pytest.log").write_text(log)
    assert proc.returncode in (0, 1) and junit.exists(), (
        f"pytest exited with {proc.returncode}:\n{log[-5000:]}"
    )

    lines, problems = compare(out, suite)
    report = "\n".join(lines)
    print(report)
    assert not problems, report + "\n" + "\n".join(problems)
