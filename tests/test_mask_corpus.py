"""``mask="auto"`` against parameter trees recorded from real models.

``tests/golden/mask_corpus/*.json`` hold the key paths and shapes of Hugging Face Flax,
Equinox, Flax NNX and linen (``nn.scan``), big_vision, gemma (LoRA) and mamba2-jax models and
what each source's own training code decays (``tests/golden/mask_corpus/record.py`` records
them from the real libraries). Every leaf where ``"auto"`` disagrees with its source must be a
deliberate difference listed in :data:`DELIBERATE` (and documented in the masks guide).
"""

import json
import pathlib

import jax
import numpy as np
import pytest

import optax_decoupled as od
from optax_decoupled._src import masks

CORPUS = sorted((pathlib.Path(__file__).parent / "golden" / "mask_corpus").glob("*.json"))


def _is_embedding_table(path: str, shape) -> bool:
    leaf = path.split("/")[-1]
    return "embed" in leaf.lower() and len(shape) == 2


#: The differences ``"auto"`` makes on purpose: (name, predicate on (source, path, shape)).
DELIBERATE = {
    # T5's relative position buckets are an attention bias, kept like biases.
    "T5 relative attention bias": lambda source, path, shape: "relative_attention_bias" in path,
    # The HF Flax examples and OpenCLIP decay token, position and type embedding tables;
    # "auto" never decays embeddings (shrinking rare tokens' rows toward zero).
    "embedding tables": lambda source, path, shape: _is_embedding_table(path, shape),
    # HF's Whisper example lists its LayerNorm names by hand and misses these; they are norms.
    "Whisper cross-attention norm": lambda source, path, shape: (
        source == "hf_whisper" and "encoder_attn_layer_norm" in path
    ),
}


def _leaves():
    for path in CORPUS:
        doc = json.loads(path.read_text())
        for leaf in doc["leaves"]:
            if not leaf.get("frozen"):
                yield doc["source"], leaf["path"], tuple(leaf["shape"]), leaf["source_decays"]


def test_the_corpus_is_there():
    sources = {json.loads(p.read_text())["source"] for p in CORPUS}
    assert len(sources) >= 15
    assert {"hf_bert", "eqx_gpt_stacked", "gemma_lora", "big_vision_vit", "mamba2_jax"} <= sources


def test_auto_agrees_with_every_source_but_for_deliberate_differences():
    unexplained, explained = [], {name: 0 for name in DELIBERATE}
    for source, path, shape, source_decays in _leaves():
        if masks.auto_decays(tuple(path.split("/")), shape) == source_decays:
            continue
        why = [n for n, matches in DELIBERATE.items() if matches(source, path, shape)]
        if why:
            explained[why[0]] += 1
        else:
            unexplained.append((source, path, shape, source_decays))
    assert not unexplained, "\n".join(map(str, unexplained))
    assert all(explained.values()), explained  # each listed difference still occurs


@pytest.mark.parametrize(
    "source, path",
    [
        # Equinox norms stacked by filter_vmap are 2-D; GPT-2's "ln_1" names a norm.
        ("eqx_gpt_stacked", "blocks/ln_1/weight"),
        # gemma's LoRA factors: b (up to 4-D) is a weight like a, not a bias.
        ("gemma_lora", "layer_0/attn/kv_einsum/_LoRAEinsum_0/lora/b"),
        ("gemma_lora", "layer_0/attn/kv_einsum/_LoRAEinsum_0/lora/a"),
        # Dense and conv kernels inside modules named like embeddings are weights.
        ("hf_albert", "albert/encoder/embedding_hidden_mapping_in/kernel"),
        ("hf_electra", "electra/embeddings_project/kernel"),
        ("hf_clip", "vision_model/embeddings/patch_embedding/kernel"),
        ("big_vision_vit", "embedding/kernel"),
        # GPT-2's wte/wpe tables in Equinox, and a (1, 1, d) class token.
        ("eqx_gpt", "wte/weight"),
        ("big_vision_vit", "cls"),
    ],
)
def test_the_fixed_classes_follow_their_source(source, path):
    (leaf,) = [(shape, decays) for s, p, shape, decays in _leaves() if s == source and p == path]
    shape, source_decays = leaf
    assert masks.auto_decays(tuple(path.split("/")), shape) == source_decays


def test_lora_factors_of_one_adapter_are_treated_alike():
    params = {"lora": {"a": np.zeros((8, 4)), "b": np.zeros((4, 2, 8))}}
    assert od.resolve_mask("auto", params) == {"lora": {"a": True, "b": True}}
    assert od.resolve_mask("auto", {"dense": {"b": np.zeros(4)}}) == {"dense": {"b": False}}


def test_explain_mask_names_the_rule_for_every_leaf():
    params = {
        "blocks": {
            "ln_1": {"weight": np.zeros((2, 16))},
            "attn": {"weight": np.zeros((2, 16, 16))},
        },
        "wte": {"weight": np.zeros((64, 16))},
    }
    rows = {d.path: d for d in od.explain_mask(params)}
    assert rows["blocks/ln_1/weight"].rule == "module 'ln_1' is a normalisation layer"
    assert not rows["blocks/ln_1/weight"].decayed and rows["blocks/attn/weight"].decayed
    assert rows["wte/weight"].rule == "module 'wte' is an embedding"
    assert rows["blocks/attn/weight"].shape == (2, 16, 16)
    # Each form of mask agrees with resolve_mask.
    for mask in ("auto", None, od.decay_mask(exclude="wte"), {"blocks": True, "wte": False}):
        flags = [d.decayed for d in od.explain_mask(params, mask)]
        assert flags == jax.tree.leaves(od.resolve_mask(mask, params))
    assert "2 of 3 leaves decayed" in str(od.explain_mask(params, {"blocks": True, "wte": False}))
    with pytest.raises(ValueError, match="mask"):
        od.explain_mask(params, {"blocks": True})
