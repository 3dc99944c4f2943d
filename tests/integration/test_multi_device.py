"""Programs on several simulated CPU devices.

The device count is fixed when JAX starts, so each check runs in a process of its own with
``--xla_force_host_platform_device_count``: the scripts of ``tests/programs/`` and one below.
"""

import json
import os
import pathlib
import subprocess
import sys
import textwrap

import numpy as np
import pytest

PROGRAMS = pathlib.Path(__file__).resolve().parents[1] / "programs"


def run_program(name, *args, timeout=600):
    """``tests/programs/<name>`` in a process of its own; its last output line, as JSON."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(
        [sys.executable, str(PROGRAMS / name), *args],
        capture_output=True, text=True, timeout=timeout, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


STATE_DTYPES = ["None", "bfloat16", "int8"]


def test_every_state_leaf_has_its_parameters_sharding():
    results = run_program("sharding_check.py", *STATE_DTYPES)
    # (explicit, auto) meshes x aliases x dtypes, int8 included on both kinds of mesh,
    # parameters on one device next to sharded ones, and decay masks given as pytrees
    assert len(results) == 2 * 4 * len(STATE_DTYPES) + 2
    failures = {case: problems for case, problems in results.items() if problems}
    assert not failures, failures


def test_state_and_updates_follow_parameters_off_the_default_device():
    results = run_program("placement_check.py")
    assert set(results) == {"jit_init_placement", "eager_int8_off_the_default_device"}
    failures = {check: problems for check, problems in results.items() if problems}
    assert not failures, failures


# ---------------------------------------------------------------------------------------------
# 8-bit state sharded along the leading axis: whole blocks per device
# ---------------------------------------------------------------------------------------------

SHARDING_SCRIPT = textwrap.dedent(
    """
    import jax, jax.numpy as jnp, numpy as np, optax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import optax_decoupled as od
    from optax_decoupled._src import quantization as Q

    assert jax.device_count() == 8
    mesh = Mesh(np.array(jax.devices()), ("data",))
    row = NamedSharding(mesh, P("data"))
    # 64 x 512: each of the 8 shards holds 8 rows = 4096 elements = 16 whole blocks of 256.
    params = {"w": jax.random.normal(jax.random.key(0), (64, 512)), "b": jnp.ones((512,))}
    grads = jax.tree.map(lambda x: 0.1 * x + 0.01, params)
    tx = od.adamw(1e-2, weight_decay=0.1, state_dtype="int8")

    def step(p, s, g, tx=tx):
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    # The reference: the same steps on one device.
    ref_p, ref_s = params, tx.init(params)
    for _ in range(3):
        ref_p, ref_s = jax.jit(step)(ref_p, ref_s, grads)

    shard = {"w": row, "b": NamedSharding(mesh, P())}
    sp = jax.device_put(params, shard)
    sg = jax.device_put(grads, shard)
    # Lay the state out like the parameter: the codes (128, 256) and absmax (128,) of "w"
    # split along their leading axis, everything else replicated.
    state = tx.init(params)
    is_q = lambda x: isinstance(x, Q.QuantizedArray)
    def place(x):
        if is_q(x):
            return jax.tree.map(lambda a: jax.device_put(a, row), x)
        return jax.device_put(x, NamedSharding(mesh, P()))
    ss = jax.tree.map(place, state, is_leaf=is_q)
    assert ss[0].mu["w"].codes.shape == (128, 256)
    # sharding.jit_init lays it out the same way.
    from optax_decoupled._src import sharding
    js = sharding.jit_init(tx, sp)
    assert js[0].nu["w"].codes.sharding.spec == P("data", None), js[0].nu["w"].codes.sharding
    assert js[0].nu["w"].absmax.sharding.spec == P("data")
    assert js[0].nu["b"].sharding.spec == P()
    for _ in range(3):
        sp, ss = jax.jit(step)(sp, ss, sg)
    assert sp["w"].sharding.spec[0] == "data"
    codes = ss[0].mu["w"].codes
    assert codes.sharding.spec[0] == "data", codes.sharding
    # Each device holds the codes of its own rows: shard i has blocks [16 i, 16 i + 16).
    starts = sorted(s.index[0].start for s in codes.addressable_shards)
    assert starts == list(range(0, 128, 16)), starts
    np.testing.assert_allclose(np.asarray(sp["w"]), np.asarray(ref_p["w"]), rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(np.asarray(codes), np.asarray(ref_s[0].mu["w"].codes))
    hlo = jax.jit(step).lower(sp, ss, sg).compile().as_text()
    assert "all-gather" not in hlo and "all-to-all" not in hlo

    # The same on a mesh with Explicit axes (jax.make_mesh's default), the state made by
    # eager init and by jit_init, which both split codes and scales like the rows.
    emesh = jax.make_mesh((8,), ("data",))
    eshard = {"w": NamedSharding(emesh, P("data")), "b": NamedSharding(emesh, P())}
    sp, sg = jax.device_put(params, eshard), jax.device_put(grads, eshard)
    for ss in (tx.init(sp), sharding.jit_init(tx, sp)):
        for q in (ss[0].mu["w"], ss[0].nu["w"]):
            assert q.codes.sharding.spec == P("data", None), q.codes.sharding
            assert q.absmax.sharding.spec == P("data"), q.absmax.sharding
    p = sp
    for _ in range(3):
        p, ss = jax.jit(step)(p, ss, sg)
    codes = ss[0].mu["w"].codes
    assert codes.sharding.spec == P("data", None), codes.sharding
    starts = sorted(s.index[0].start for s in codes.addressable_shards)
    assert starts == list(range(0, 128, 16)), starts
    np.testing.assert_allclose(np.asarray(p["w"]), np.asarray(ref_p["w"]), rtol=1e-6, atol=1e-7)
    for name in ("mu", "nu"):
        q, ref = getattr(ss[0], name)["w"], getattr(ref_s[0], name)["w"]
        np.testing.assert_array_equal(np.asarray(q.codes), np.asarray(ref.codes))
        np.testing.assert_array_equal(np.asarray(q.absmax), np.asarray(ref.absmax))
    hlo = jax.jit(step).lower(sp, ss, sg).compile().as_text()
    assert "all-gather" not in hlo and "all-to-all" not in hlo
    print("SHARDING_OK")
    """
)


def test_leading_axis_sharding_maps_to_whole_blocks():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8")
    env["JAX_PLATFORMS"] = "cpu"
    result = subprocess.run(
        [sys.executable, "-c", SHARDING_SCRIPT], env=env, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert "SHARDING_OK" in result.stdout, result.stdout + result.stderr


# ---------------------------------------------------------------------------------------------
# The experiments' trainer: data parallel + FSDP on a 2x4 mesh, grids over 4 devices
# ---------------------------------------------------------------------------------------------

#: The largest relative loss difference over 5 steps is about 1.2e-7 and parameters differ by
#: about 1.8e-7 (float32 rounding of reductions split across devices); the tolerances leave a
#: factor of about 50.
DP_FSDP_LOSS_RTOL = 1e-5
DP_FSDP_PARAM_ATOL = 1e-5


def test_dp_fsdp_training_matches_one_device():
    out = run_program("ssm_dp_fsdp.py", "adamw", "5")
    assert out["problems"] == []
    assert out["n_fsdp_sharded"] == out["n_params"] > 0
    assert len(out["losses_8"]) == 5
    np.testing.assert_allclose(out["losses_8"], out["losses_1"], rtol=DP_FSDP_LOSS_RTOL)
    assert out["max_abs_param_diff"] <= DP_FSDP_PARAM_ATOL
    assert out["losses_1"][-1] < out["losses_1"][0]  # it trains


def test_grid_over_devices_and_chunks():
    """On 4 CPU devices (own process): the K axis split over the devices with shard_map, and
    lax.map chunks of any size, give the one-device vmap's results to float rounding; a sharded
    run resumed from its checkpoint equals the uninterrupted one bit for bit and stays sharded;
    8-bit state with skip_nonfinite trains sharded as on one device. The results come back on
    one device, and no program compiled for any of it runs a collective (XLA:CPU's can
    deadlock)."""
    out = run_program("grid_over_devices.py")
    assert out["devices"] == out["mesh_size"] == 4
    assert set(out["variants"]) == {
        "sharded, chunk auto",
        "sharded, chunk 1",
        "one device, chunk 3",
    }
    first_config = out["variants"]["one device, chunk 3"]["first_config"]
    for name, v in out["variants"].items():
        assert v["devices"] == (1 if name.startswith("one device") else 4), name
        assert v["param_devices"] == 1, name  # handed back on one device
        assert v["first_config"] == pytest.approx(first_config, rel=1e-5), name
        assert v["loss_diff"] < 1e-5 and v["param_diff"] < 1e-5 and v["val_loss_diff"] < 1e-5, v
    padded = out["padded"]  # K = 5 padded to 8 on 4 devices; the padding is dropped
    assert padded["runs"] == padded["param_rows"] == 5
    assert padded["param_diff"] < 1e-5 and padded["loss_diff"] < 1e-5, padded
    assert out["resume_start"] == 3 and out["resume_bit_identical"]
    assert out["resumed_devices"] == 4 and out["resumed_param_devices"] == 1
    # 8-bit state with skip_nonfinite (apply_if_finite's lax.cond) inside the shard_map.
    int8 = out["int8_skip"]
    assert int8.get("devices") == 4 and int8.get("param_devices") == 1, int8
    # Not 1e-5 as above: the two programs fuse differently, and a rounding difference that
    # flips one 8-bit code moves a moment by a step of the map, which later steps carry
    # (after 6 steps of lr <= 3e-2, the parameters having moved by up to ~0.2): up to about
    # 7e-4 depending on the CPU. A mixed-up or wrongly sharded run would differ as much as
    # another run does (about 2.7).
    assert int8["param_diff"] < 2e-3, int8
    assert int8["other_run_diff"] > 20 * int8["param_diff"], int8
    # Not vacuous: the dump holds the programs, the sharded step's among them.
    assert out["compiled_modules"] > 50 and out["step_modules"] >= 4, out
    assert out["collective_modules"] == [], out["collective_modules"]
