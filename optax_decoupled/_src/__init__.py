"""Implementation modules; the public API is ``optax_decoupled`` and its submodules."""
