"""Record bitsandbytes' dynamic quantization maps (and some block-wise codes) as golden data.

``tests/test_quantization.py`` checks :func:`optax_decoupled.quantization.dynamic_map`, which
builds the maps from the papers' description, against the values recorded here; the tests only
need NumPy. Regenerating needs bitsandbytes, kept out of the project's environment in a venv of
its own (install the CPU torch wheel first, or pip pulls a CUDA build of several GB):

    python3 -m venv /opt/bnbenv
    /opt/bnbenv/bin/pip install torch==2.13.0   # CPU wheel
    /opt/bnbenv/bin/pip install bitsandbytes
    /opt/bnbenv/bin/python tests/golden/make_dynamic_maps.py     # from the repository root

Recorded with bitsandbytes 0.50.2, torch 2.13.0+cpu (see ``meta`` in the file).

Writes ``tests/golden/bnb_dynamic_maps.npz`` with

    ``meta``                     JSON: bitsandbytes / torch / numpy / python versions, calls.
    ``signed``, ``unsigned``     (256,) float32: ``create_dynamic_map(signed=True/False)``
                                 (defaults ``max_exponent_bits=7, total_bits=8``), sorted.
    ``inputs``                   (N,) float32: a fixed sample (normal, log-uniform magnitudes
                                 over 1e-9..1e3, zeros, one large outlier per block of 2048).
    ``codes.<map>.<B>``          (N,) uint8: ``quantize_blockwise(inputs, code=map,
                                 blocksize=B)`` codes for map in {signed, unsigned} (the
                                 unsigned map gets ``|inputs|``) and B in {256, 2048}.
    ``absmax.<map>.<B>``         (N / B,) float32: the blocks' absmax from the same call.

bitsandbytes' CPU kernel does not always pick the nearest map value (it walks a binary search
over the map), so the tests compare *errors*, not codes: ours must never be farther from the
input than bitsandbytes'.
"""

from __future__ import annotations

import json
import os
import platform

import numpy as np

SEED = 20220101
N = 8192


def sample_inputs(seed: int = SEED, n: int = N) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(n)
    quarter = n // 4
    mags = 10.0 ** rng.uniform(-9, 3, quarter)
    x[:quarter] = mags * rng.choice([-1.0, 1.0], quarter)
    x[quarter : quarter + 64] = 0.0
    x[2048 + 7 :: 2048] *= 1e4  # an outlier in each block of 2048
    return x.astype(np.float32)


def main() -> None:
    import bitsandbytes
    import bitsandbytes.functional as F
    import torch

    out: dict[str, np.ndarray] = {}
    maps = {
        "signed": F.create_dynamic_map(signed=True),
        "unsigned": F.create_dynamic_map(signed=False),
    }
    for name, m in maps.items():
        out[name] = m.cpu().numpy().astype(np.float32)
    x = sample_inputs()
    out["inputs"] = x
    for name, m in maps.items():
        data = np.abs(x) if name == "unsigned" else x
        for block in (256, 2048):
            codes, state = F.quantize_blockwise(torch.from_numpy(data), code=m, blocksize=block)
            out[f"codes.{name}.{block}"] = codes.cpu().numpy().astype(np.uint8)
            out[f"absmax.{name}.{block}"] = state.absmax.cpu().numpy().astype(np.float32)
    meta = {
        "bitsandbytes": bitsandbytes.__version__,
        "torch": torch.__version__,
        "numpy": np.__version__,
        "python": platform.python_version(),
        "maps": "bitsandbytes.functional.create_dynamic_map(signed=True|False)",
        "codes": "bitsandbytes.functional.quantize_blockwise(x, code=map, blocksize=B)",
        "seed": SEED,
    }
    out["meta"] = np.asarray(json.dumps(meta))
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bnb_dynamic_maps.npz")
    np.savez_compressed(path, **out)
    print(f"wrote {path}: {sorted(out)}")


if __name__ == "__main__":
    main()
