"""Experiments built on the core package: Flax NNX selective SSM, tasks, trainer and sweeps.

These modules need the ``experiments`` extra (flax, orbax-checkpoint, scikit-learn, tqdm,
matplotlib). Import the submodules directly, e.g. ``from optax_decoupled.experiments import ssm``.
"""
