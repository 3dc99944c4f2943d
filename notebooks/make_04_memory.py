"""Writes ``notebooks/04_memory.ipynb`` (outputs cleared). Run from the repository root:

    .venv/bin/python notebooks/make_04_memory.py

The notebook only calls :mod:`optax_decoupled.experiments.memory_report`; with
``OPTAX_DECOUPLED_SMOKE=1`` it runs at a size that ``pytest --nbmake`` finishes in seconds.
"""

from __future__ import annotations

from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

CELLS = [
    new_markdown_cell(
        """# Optimizer-state memory: fp32, bf16 and 8-bit block-wise state

What an optimizer keeps between steps, measured rather than assumed:

1. bytes per parameter of SGD+momentum, Lion, AdamW and AMSGrad with float32, bfloat16 and
   8-bit block-wise state (Dettmers et al., *8-bit Optimizers via Block-wise Quantization*,
   ICLR 2022), next to the theoretical values;
2. the claim *"L2 regularisation makes Adam's variance tensor explode in memory, AdamW fixes
   it"*, tested on the SSM's compiled training step;
3. the memory of a 7B-parameter model, computed by the same functions;
4. whether 8-bit and bf16 state change the result: final validation loss on the SSM
   sequential-digits task.

Every number below is computed by `optax_decoupled.memory` /
`optax_decoupled.experiments.memory_report`; nothing is typed in. Set
`OPTAX_DECOUPLED_SMOKE=1` for a seconds-long run at toy sizes (what CI does)."""
    ),
    new_code_cell(
        """import os

from IPython.display import Markdown, display

from optax_decoupled.experiments import memory_report as R

SMOKE = os.environ.get("OPTAX_DECOUPLED_SMOKE") == "1"
SIZES = "state_bytes arguments outputs temporaries aliased peak weights gradients"
BYTES = {c: "bytes" for c in (SIZES + " optimizer_state total").split()}
print("smoke run" if SMOKE else "full run")"""
    ),
    new_markdown_cell(
        """## 1. Bytes per parameter

*Theory* counts the moments of a large tensor: 1 (SGD momentum, Lion), 2 (AdamW) or 3
(AMSGrad: μ, ν, ν_max) times 4 bytes (float32), 2 (bfloat16) or $1 + 4/B$ (8-bit: one code
plus a float32 scale per block of $B = 256$). *Measured* is
`memory.state_bytes(tx.init(params)).total / num_params`, step counters included. On the
large-matrix model every moment is quantized; the SSM's tensors are small, and those under
4096 elements keep float32 moments (as bitsandbytes does), so its 8-bit state is about
twice the theory."""
    ),
    new_code_cell(
        """models = {"large matrices": R.abstract(R.large_tensor_shapes())}
if not SMOKE:
    models["SSM digits"] = R.ssm_digits_setup()[2]
rows = R.bytes_per_param_table(models)
cols = ["optimizer", "state_dtype", "theory"] + [f"measured:{m}" for m in models]
display(Markdown(R.markdown_table(rows, cols, {c: ".4f" for c in cols[2:]})))"""
    ),
    new_markdown_cell(
        """## 2. Does coupled L2 make Adam's state bigger?

Both `adam_l2` and `adamw` keep μ and ν with the parameters' shape, so the state has the same
size by construction; L2 changes the *values* in ν (the penalty's gradient enters it), not
its size. We check it on the compiled SSM training step (forward, backward, update, apply;
parameters and state donated), from XLA's buffer assignment: *arguments*, *outputs*,
*temporaries* (activations, gradients), *aliased* (outputs written in place of donated
arguments) and *peak* = arguments + outputs − aliased + temporaries."""
    ),
    new_code_cell(
        """if SMOKE:
    mem = R.l2_vs_adamw_memory((4,), d_model=16, n_layers=1)
else:
    mem = R.l2_vs_adamw_memory((4, 512))
cols = "optimizer batch_size state_bytes arguments outputs temporaries aliased peak".split()
display(Markdown(R.markdown_table(mem, cols, BYTES)))
adamw = {r["batch_size"]: r for r in mem if r["optimizer"] == "adamw"}
for r in mem:
    if r["optimizer"] == "adam_l2":
        w = adamw[r["batch_size"]]
        same = r["state_shapes"] == w["state_shapes"]
        ratio = r["peak"] / w["peak"]
        print(f"batch {r['batch_size']}: same state shapes {same}, peak L2/AdamW {ratio:.4f}")"""
    ),
    new_markdown_cell(
        """## 3. A 7B-parameter model

A Llama-2-7B-shaped parameter tree (6.74e9 parameters, as `jax.ShapeDtypeStruct`s: nothing is
allocated) through `memory.training_memory`: weights, gradients in the weights' dtype, and
the optimizer state of `tx.init` traced with `jax.eval_shape`. Norm scales (small) keep
float32 moments under 8-bit storage, as in training."""
    ),
    new_code_cell(
        """if SMOKE:
    rows7b = R.memory_7b(optimizers=("adamw",), weights_dtypes=("bfloat16",))
else:
    rows7b = R.memory_7b()
cols = "weights_dtype optimizer state_dtype weights gradients optimizer_state total".split()
display(Markdown(R.markdown_table(rows7b, cols, BYTES)))
print(f"{rows7b[0]['num_params']:,} parameters")"""
    ),
    new_markdown_cell(
        """## 4. Does the state's precision change the result?

AdamW and Lion on sequential digits (the SSM of the comparison, `quick` size), three seeds,
the same schedule and hyperparameters; only the moments' storage differs. *int8* quantizes
tensors of at least 4096 elements (most of this small model stays float32); *int8 (all
tensors)* quantizes every moment, the harsher test. The gap is the relative difference of
the mean final validation loss to float32's."""
    ),
    new_code_cell(
        """config = R.QualityConfig.preset("smoke" if SMOKE else "quick")
quality = R.quality_comparison(config)
cols = "optimizer state_dtype val_loss_mean val_accuracy_mean gap_vs_float32 max_seed_gap"
fmt = {"val_loss_mean": ".4f", "val_accuracy_mean": ".4f"}
fmt.update(gap_vs_float32="+.2%", max_seed_gap=".2%")
display(Markdown(R.markdown_table(quality, cols.split(), fmt)))"""
    ),
]


def main() -> None:
    nb = new_notebook(cells=CELLS)
    nb.metadata["kernelspec"] = {"display_name": "Python 3", "language": "python",
                                 "name": "python3"}  # fmt: skip
    nb.metadata["language_info"] = {"name": "python"}
    path = Path(__file__).with_name("04_memory.ipynb")
    nbformat.validate(nb)
    nbformat.write(nb, path)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
