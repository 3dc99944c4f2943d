"""Experiments built on the core package's public API; one module per role.

* The SSM test bed: :mod:`.ssm` (the model), :mod:`.tasks` (data), :mod:`.training_step`
  (model state, loss, one pure step), :mod:`.schedules` (``make_tx`` factories),
  :mod:`.programs` (K configurations compiled together), :mod:`.checkpoints`,
  :mod:`.train_results`, and :mod:`.train` (the grid loop, :func:`.train.train_grid`).
* Reddi et al.'s counterexamples: :mod:`.reddi_problems`, :mod:`.reddi_simulation`,
  :mod:`.reddi_sweeps`, and :mod:`.reddi` (the whole experiment and its ``results.json``).
* The SSM experiments: :mod:`.compare` (tuned comparison), :mod:`.grid` (lr × wd heatmaps).
* Memory: :mod:`.state_memory`, :mod:`.state_precision`, :mod:`.memory_report`.
* Shared: :mod:`.report` (every part at one scale, ``report.md``), :mod:`.plots`,
  :mod:`.formatting`, :mod:`.environment`, :mod:`.xla_setup`.

These modules need the ``experiments`` extra (flax, orbax-checkpoint, scikit-learn, tqdm,
matplotlib). Import the submodules directly, e.g. ``from optax_decoupled.experiments import ssm``.
"""
