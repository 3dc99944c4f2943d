"""The integration tier runs in pytest-xdist workers, which take the tests in collection order:
the longest ones go first, so that none of them starts last and runs alone at the end."""

#: Node-id prefixes of the longest tests, longest first (a few minutes each on 2 CPU cores).
LONGEST_FIRST = (
    "tests/integration/test_multi_device.py::test_grid_over_devices_and_chunks",
    "tests/integration/optax_suite/",
    "tests/integration/test_multi_device.py::test_every_state_leaf_has_its_parameters_sharding",
    "tests/integration/test_experiments_end_to_end.py::test_report_smoke_schema_and_resume",
    "notebooks/02_ssm_comparison.ipynb",
    "tests/integration/test_wheel.py",
    "notebooks/04_memory.ipynb",
    "tests/integration/test_experiments_end_to_end.py::test_quality_comparison_smoke",
    "notebooks/03_lr_wd_grid.ipynb",
)


def _rank(item) -> int:
    for i, prefix in enumerate(LONGEST_FIRST):
        if item.nodeid.startswith(prefix):
            return i
    return len(LONGEST_FIRST)


def pytest_collection_modifyitems(items):
    items.sort(key=_rank)  # stable: the others keep their order
