"""XLA:CPU settings for the experiments, applied through ``XLA_FLAGS`` before JAX starts.

XLA reads its flags once, when the first backend initialises, so these functions must run
before any JAX computation; afterwards they do nothing and say so. They touch only the CPU
backend: on a GPU or TPU host the flags change nothing the experiments run on.

* :data:`FAST_LOOPS_FLAG` lets XLA:CPU compile a whole ``while`` loop (a batch of Reddi runs)
  into one kernel; its default limit, 1 kB of loop state, covers only a few runs per batch.
* :func:`cpu_devices_flag` exposes the host's cores as that many CPU devices, so a grid of
  configurations can be split over them (``TrainConfig.shard_configs``): XLA:CPU runs one
  program's element-wise kernels on one core, and separate devices run concurrently.

The CLI, the report and the notebooks call :func:`configure_cpu`; library code never does.

With several CPU devices, keep programs that need values from more than one of them (indexing
an array split over them, reducing it) out of your own code: XLA:CPU runs them with
in-process collectives, which can deadlock when several wait on the same computation (XLA
then aborts after 40 s, "Termination timeout for `all reduce ...`"). Bring such arrays to the
host first (``np.asarray``); :func:`~optax_decoupled.experiments.train.train_grid` hands its
results back on one device for this reason (``programs.off_cpu_mesh``).
"""

from __future__ import annotations

import os

import jax

#: Lets XLA:CPU compile a whole while loop (one batch of runs) into one kernel.
FAST_LOOPS_FLAG = "--xla_backend_extra_options=xla_cpu_small_while_loop_byte_threshold=100000000"

_DEVICE_COUNT_OPTION = "xla_force_host_platform_device_count"


def cpu_devices_flag(count: int) -> str:
    """The ``XLA_FLAGS`` entry that exposes ``count`` CPU devices."""
    return f"--{_DEVICE_COUNT_OPTION}={int(count)}"


def backends_started() -> bool:
    """Whether a JAX backend is initialised (then new ``XLA_FLAGS`` have no effect).

    Asked through public configuration: JAX refuses a new ``jax_num_cpu_devices`` once a
    backend runs (``RuntimeError``); before that the option is set to another value and back,
    which changes nothing.
    """
    current = jax.config.jax_num_cpu_devices
    try:
        jax.config.update("jax_num_cpu_devices", current + 1 if current >= 0 else 1)
    except RuntimeError:
        return True
    jax.config.update("jax_num_cpu_devices", current)
    return False


def add_xla_flags(*flags: str) -> list[str]:
    """Appends ``flags`` to ``XLA_FLAGS`` unless a backend already started.

    A flag whose option (the text before ``=``) is already in ``XLA_FLAGS`` is left out, so a
    user's own setting wins. Returns the flags added (empty if none could be or had to be).
    """
    if backends_started():
        return []
    current = os.environ.get("XLA_FLAGS", "")
    added = [f for f in flags if f.split("=", 1)[0].lstrip("-") not in current]
    if added:
        os.environ["XLA_FLAGS"] = " ".join([current, *added]).strip()
    return added


def configure_cpu(*, fast_loops: bool = True, devices: int | None = 0) -> list[str]:
    """Sets the experiments' XLA:CPU flags; call it before any JAX computation.

    Args:
      fast_loops: add :data:`FAST_LOOPS_FLAG` (results equal to float rounding, loops faster).
      devices: CPU devices to expose; ``0`` (default) means one per core available to this
        process (``os.sched_getaffinity``), ``None`` leaves the device count alone.

    Returns:
      The flags added (empty once JAX has started or if ``XLA_FLAGS`` already sets them).
    """
    flags = [FAST_LOOPS_FLAG] if fast_loops else []
    if devices is not None:
        if devices < 0:
            raise ValueError(f"devices must be >= 0 or None, got {devices}.")
        count = devices or _available_cores()
        if count > 1:
            flags.append(cpu_devices_flag(count))
    return add_xla_flags(*flags)


def _available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1
