"""Records the weight-decay mask corpus: real parameter trees of other projects, as JSON.

Each ``*.json`` file beside this script holds one parameter tree (key paths, shapes) and what
the tree's *own* training code decays (``source_decays``), so that the unit tests can check
``mask="auto"`` against real trees without installing those libraries. No weights are
downloaded: every tree is built from a config object under ``jax.eval_shape`` (Flax linen,
Hugging Face Flax models), ``eqx.filter_eval_shape`` (Equinox) or ``nnx.eval_shape`` (Flax
NNX), so only paths, shapes and dtypes exist.

Environment used to record the committed files (Python 3.11; jax/flax pinned to the versions
the main package's venv had, so that ``optax_decoupled._src.masks.path_string`` is imported
from this repository rather than copied)::

    python3 -m venv /tmp/corpus-venv
    /tmp/corpus-venv/bin/pip install 'jax==0.10.2' 'flax==0.12.8' 'optax==0.2.8' \
        'chex==0.1.92' 'equinox==0.13.8' 'transformers==4.49.0'
    # Gemma's LoRA wrapper (gm.nn.LoRA) and a JAX Mamba2. gemma 3.3.0 needs kauldron 1.3.0
    # (1.4 dropped kd.ckpts.AbstractPartialLoader), and kauldron imports clu, tensorflow,
    # tensorflow_datasets, grain, mediapy, pandas and tensorboard at import time; its type
    # checker needs typeguard 4.4.x (4.6 changed a private signature).
    /tmp/corpus-venv/bin/pip install --no-deps 'gemma==3.3.0' 'kauldron==1.3.0' \
        'clu==0.0.12' 'mamba2-jax==1.1.2'
    /tmp/corpus-venv/bin/pip install einops jaxtyping 'etils[edc,enp,epath,epy,etree]' \
        treescope immutabledict ml_collections lark 'typeguard==4.4.2' tabulate sentencepiece \
        'tensorflow==2.21.0' 'tensorflow-datasets==4.9.10' 'grain==0.2.18' tensorboard \
        mediapy pandas
    /tmp/corpus-venv/bin/python tests/golden/mask_corpus/record.py

Run it from anywhere (it finds the repository from its own path); it rewrites
every ``*.json`` here. ``--only NAME`` records one source.

JSON schema of one file::

    {"source": "hf_bert", "library": "transformers 4.49.0 (FlaxBertForPreTraining)",
     "convention_source": "<where the source's own no-decay rule comes from>",
     "notes": "...",                       # optional
     "leaves": [{"path": "a/b/kernel", "shape": [..], "source_decays": true}, ...]}

A leaf may carry ``"frozen": true``: the source's training does not update it at all (the
base weights under Gemma LoRA), so no decay convention applies to it.

Paths are exactly ``optax_decoupled._src.masks.path_string`` of
``jax.tree_util.tree_flatten_with_path`` (imported from this repository below).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections.abc import Callable
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
sys.path.insert(0, REPO)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from optax_decoupled._src.masks import path_components, path_string  # noqa: E402

jax.config.update("jax_platforms", "cpu")


def flat_leaves(tree: Any) -> list[tuple[Any, tuple[str, ...], str, tuple[int, ...]]]:
    """(raw key path, components, path string, shape) of every leaf, in tree order."""
    out = []
    for kp, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        out.append(
            (kp, path_components(kp), path_string(kp), tuple(int(d) for d in np.shape(leaf)))
        )
    return out


def version(dist: str) -> str:
    from importlib.metadata import version as v

    return f"{dist} {v(dist)}"


def write(
    name: str, library: str, convention_source: str, leaves: list[dict], notes: str = ""
) -> None:
    doc: dict[str, Any] = {
        "source": name,
        "library": library,
        "convention_source": convention_source,
    }
    if notes:
        doc["notes"] = notes
    doc["leaves"] = leaves
    path = os.path.join(HERE, f"{name}.json")
    with open(path, "w") as f:
        # One leaf per line: small diffs, readable.
        f.write("{\n")
        for k in ("source", "library", "convention_source", "notes"):
            if k in doc:
                f.write(f"  {json.dumps(k)}: {json.dumps(doc[k])},\n")
        f.write('  "leaves": [\n')
        f.write(",\n".join("    " + json.dumps(leaf) for leaf in leaves))
        f.write("\n  ]\n}\n")
    print(f"{name}: {len(leaves)} leaves -> {os.path.relpath(path, REPO)}")


def entries(
    tree: Any,
    decays: Callable[[tuple[str, ...], tuple[int, ...], Any], bool],
    frozen: Callable[[tuple[str, ...]], bool] | None = None,
) -> list[dict]:
    out = []
    for kp, comps, path, shape in flat_leaves(tree):
        e: dict[str, Any] = {"path": path, "shape": list(shape)}
        if frozen is not None and frozen(comps):
            e["source_decays"] = False
            e["frozen"] = True
        else:
            e["source_decays"] = bool(decays(comps, shape, kp))
        out.append(e)
    return out


# --------------------------------------------------------------------------------------------
# Conventions (one small rule per source, each citing where it comes from).
# --------------------------------------------------------------------------------------------

HF_CONVENTION = (
    "Hugging Face Flax examples' decay_mask_fn (examples/flax/language-modeling/run_mlm_flax.py, "
    "run_clm_flax.py, run_t5_mlm_flax.py; transformers v4.x): flat = flatten_dict(params); "
    "layer_norm_candidates = ['layernorm', 'layer_norm', 'ln']; a leaf is NOT decayed iff "
    "path[-1] == 'bias' or path[-2:] equals the last two keys of some leaf whose keys, "
    "concatenated without separator and lowercased, contain a candidate; everything else "
    "(embeddings, position embeddings, heads) IS decayed"
)


def hf_decay_mask(all_components: list[tuple[str, ...]]) -> dict[tuple[str, ...], bool]:
    """The HF Flax examples' ``decay_mask_fn``, verbatim in logic (see HF_CONVENTION).

    Note ``"".join(layer)``: the keys are concatenated without a separator, so "ln" can match
    across a key boundary (e.g. ``model`` + ``norm`` in Llama's ``model/norm/weight``)."""
    candidates = ["layernorm", "layer_norm", "ln"]
    ln_named = {
        layer[-2:]
        for name in candidates
        for layer in all_components
        if name in "".join(layer).lower()
    }
    return {p: (p[-1] != "bias" and p[-2:] not in ln_named) for p in all_components}


def hf_entries(params: Any) -> list[dict]:
    comps = [c for _, c, _, _ in flat_leaves(params)]
    mask = hf_decay_mask(comps)
    return entries(params, lambda c, s, kp: mask[c])


# timm (timm/optim/_param_groups.py param_groups_weight_decay, used by create_optimizer_v2):
#   no decay iff param.ndim <= 1 or name.endswith(".bias") or name in model.no_weight_decay();
# timm VisionTransformer.no_weight_decay() = {'pos_embed', 'cls_token', 'dist_token'}.
# Mapped onto HF ViT names: embeddings/position_embeddings <-> pos_embed, embeddings/cls_token
# <-> cls_token. (HF's own examples/flax/vision/run_image_classification.py passes no mask at
# all, i.e. decays every leaf; timm/DeiT is the reference ViT training recipe.)
TIMM_VIT_CONVENTION = (
    "timm param_groups_weight_decay (timm/optim/_param_groups.py): no decay iff ndim <= 1 or "
    "name ends with 'bias' or name in VisionTransformer.no_weight_decay() = {pos_embed, "
    "cls_token, dist_token}; mapped to HF names embeddings/position_embeddings and "
    "embeddings/cls_token. (HF's examples/flax/vision/run_image_classification.py itself "
    "passes no mask: it decays every leaf.)"
)


def timm_vit_decays(comps: tuple[str, ...], shape: tuple[int, ...], kp: Any) -> bool:
    # timm's no_weight_decay() sets, mapped to HF names: VisionTransformer {pos_embed,
    # cls_token, dist_token, reg_token (timm >= 0.9)}; Beit {pos_embed, cls_token} plus every
    # name containing 'relative_position_bias_table'. DINOv2's mask_token is the same kind of
    # learned token (timm has no mask_token; DINOv2's own code keeps it out of the model's
    # decayed groups only through ndim<=1 in timm terms, so it is listed here explicitly).
    no_wd = {
        "position_embeddings",
        "cls_token",
        "distillation_token",
        "mask_token",
        "register_tokens",
    }
    return not (
        len(shape) <= 1
        or comps[-1] == "bias"
        or comps[-1] in no_wd
        or "relative_position_bias_table" in comps[-1]
    )


# OpenCLIP (open_clip/src/open_clip_train/main.py, formerly training/main.py):
#   exclude = lambda n, p: p.ndim < 2 or "bn" in n or "ln" in n or "bias" in n or
#                          "logit_scale" in n
# applied here to the "/"-joined HF path as n.
OPENCLIP_CONVENTION = (
    "OpenCLIP open_clip_train/main.py: exclude = lambda n, p: p.ndim < 2 or 'bn' in n or 'ln' "
    "in n or 'bias' in n or 'logit_scale' in n; everything else decays (token/position "
    "embeddings, patch conv, projections); applied to the '/'-joined HF Flax path as n"
)


def openclip_decays(comps: tuple[str, ...], shape: tuple[int, ...], kp: Any) -> bool:
    n = "/".join(comps)
    return not (len(shape) < 2 or "bn" in n or "ln" in n or "bias" in n or "logit_scale" in n)


# minGPT (karpathy/minGPT mingpt/model.py configure_optimizers) and the same rule in
# HazyResearch state-spaces src/utils/optim_groups.py add_optimizer_hooks / flash-attention
# training/src/optim/param_grouping.py: by *module type*, not name or ndim:
#   biases: no decay; weights of Linear (whitelist): decay; weights of Embedding and
#   normalisation layers (blacklist): no decay; params with `_no_weight_decay` (mamba_ssm's
#   A_log, D, dt_bias): no decay. Conv weights decay (state-spaces decays everything not
#   blacklisted). This is the convention Equinox / NNX users port: it is stacking-invariant
#   because it looks at module types, so a vmapped LayerNorm's 2-D weight stays undecayed.
MODULE_TYPE_CONVENTION = (
    "module-type rule of minGPT configure_optimizers (karpathy/minGPT mingpt/model.py) as "
    "generalised in HazyResearch state-spaces src/utils/optim_groups.py add_optimizer_hooks: "
    "biases no decay; weights of Embedding and normalisation modules no decay; parameters "
    "marked _no_weight_decay (mamba_ssm: A_log, D, dt_bias) no decay; Linear/Conv/attention "
    "weights decay. Decided from the module *types* of the built model, so stacking (vmap) "
    "does not change it"
)


def module_type_decays(param_name: str, module_kind: str) -> bool:
    """module_kind in {"linear", "conv", "embedding", "norm", "ssm", "lora", "other"}."""
    if "bias" in param_name and module_kind != "ssm":
        return False
    if module_kind in ("embedding", "norm"):
        return False
    if module_kind == "ssm":  # parameters with `_no_weight_decay` in mamba_ssm
        return param_name not in ("A_log", "D", "dt_bias")
    return True


# --------------------------------------------------------------------------------------------
# Hugging Face Flax models (transformers 4.49.0): built from configs, params via eval_shape.
# --------------------------------------------------------------------------------------------


def hf_params(model_cls: Any, config: Any, **kw: Any) -> Any:
    from flax.core import unfreeze

    model = model_cls(config, _do_init=False, **kw)
    params = jax.eval_shape(
        lambda r: model.init_weights(r, model.input_shape), jax.random.PRNGKey(0)
    )
    return unfreeze(params)


TEXT = dict(
    vocab_size=64,
    hidden_size=16,
    num_hidden_layers=2,
    num_attention_heads=2,
    intermediate_size=24,
    max_position_embeddings=32,
)


def rec_hf_bert() -> None:
    from transformers import BertConfig, FlaxBertForPreTraining

    p = hf_params(FlaxBertForPreTraining, BertConfig(**TEXT))
    write(
        "hf_bert",
        version("transformers") + " (FlaxBertForPreTraining)",
        HF_CONVENTION,
        hf_entries(p),
        "examples/flax/language-modeling/run_mlm_flax.py",
    )


def rec_hf_roberta() -> None:
    from transformers import FlaxRobertaForMaskedLM, RobertaConfig

    p = hf_params(FlaxRobertaForMaskedLM, RobertaConfig(**TEXT))
    write(
        "hf_roberta",
        version("transformers") + " (FlaxRobertaForMaskedLM)",
        HF_CONVENTION,
        hf_entries(p),
        "examples/flax/language-modeling/run_mlm_flax.py",
    )


def rec_hf_albert() -> None:
    from transformers import AlbertConfig, FlaxAlbertForPreTraining

    cfg = AlbertConfig(
        vocab_size=64,
        embedding_size=8,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=24,
        max_position_embeddings=32,
    )
    p = hf_params(FlaxAlbertForPreTraining, cfg)
    write(
        "hf_albert",
        version("transformers") + " (FlaxAlbertForPreTraining)",
        HF_CONVENTION,
        hf_entries(p),
        "examples/flax/language-modeling/run_mlm_flax.py; embedding_size != "
        "hidden_size, so encoder/embedding_hidden_mapping_in/kernel projects embeddings",
    )


def rec_hf_electra() -> None:
    from transformers import ElectraConfig, FlaxElectraForPreTraining

    cfg = ElectraConfig(
        vocab_size=64,
        embedding_size=8,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=24,
        max_position_embeddings=32,
    )
    p = hf_params(FlaxElectraForPreTraining, cfg)
    write(
        "hf_electra",
        version("transformers") + " (FlaxElectraForPreTraining)",
        HF_CONVENTION,
        hf_entries(p),
        "examples/flax/language-modeling/run_mlm_flax.py; embedding_size != "
        "hidden_size, so electra/embeddings_project/kernel exists",
    )


def rec_hf_gpt2() -> None:
    from transformers import FlaxGPT2LMHeadModel, GPT2Config

    cfg = GPT2Config(vocab_size=64, n_positions=32, n_embd=16, n_layer=2, n_head=2)
    p = hf_params(FlaxGPT2LMHeadModel, cfg)
    write(
        "hf_gpt2",
        version("transformers") + " (FlaxGPT2LMHeadModel)",
        HF_CONVENTION,
        hf_entries(p),
        "examples/flax/language-modeling/run_clm_flax.py",
    )


def rec_hf_llama() -> None:
    from transformers import FlaxLlamaForCausalLM, LlamaConfig

    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=32,
    )
    p = hf_params(FlaxLlamaForCausalLM, cfg)
    write(
        "hf_llama",
        version("transformers") + " (FlaxLlamaForCausalLM)",
        HF_CONVENTION,
        hf_entries(p),
        "examples/flax/language-modeling/run_clm_flax.py. RMSNorm weights are "
        "named 'weight'; the final model/norm/weight is excluded by the rule only because "
        "'model'+'norm' concatenated contains 'ln'",
    )


def rec_hf_t5() -> None:
    from transformers import FlaxT5ForConditionalGeneration, T5Config

    cfg = T5Config(vocab_size=64, d_model=16, d_kv=8, d_ff=24, num_layers=2, num_heads=2)
    # transformers 4.49's Flax T5 calls jnp.clip(x, a_max=...), a keyword newer JAX removed:
    # shim it while tracing the init (shapes only; the result is unaffected).
    clip = jnp.clip
    jnp.clip = lambda x, min=None, max=None, a_min=None, a_max=None: clip(
        x, a_min if min is None else min, a_max if max is None else max
    )
    try:
        p = hf_params(FlaxT5ForConditionalGeneration, cfg)
    finally:
        jnp.clip = clip
    write(
        "hf_t5",
        version("transformers") + " (FlaxT5ForConditionalGeneration)",
        HF_CONVENTION,
        hf_entries(p),
        "examples/flax/language-modeling/run_t5_mlm_flax.py",
    )


def rec_hf_vit() -> None:
    from transformers import FlaxViTForImageClassification, ViTConfig

    cfg = ViTConfig(
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=24,
        image_size=8,
        patch_size=4,
        num_labels=3,
    )
    p = hf_params(FlaxViTForImageClassification, cfg)
    write(
        "hf_vit",
        version("transformers") + " (FlaxViTForImageClassification)",
        TIMM_VIT_CONVENTION,
        entries(p, timm_vit_decays),
    )


VISION = dict(
    hidden_size=16,
    num_hidden_layers=2,
    num_attention_heads=2,
    intermediate_size=24,
    image_size=8,
    patch_size=4,
)


def rec_hf_beit() -> None:
    from transformers import BeitConfig, FlaxBeitForImageClassification

    cfg = BeitConfig(
        **VISION,
        num_labels=3,
        use_relative_position_bias=True,
        layer_scale_init_value=0.1,
        use_mean_pooling=True,
    )
    p = hf_params(FlaxBeitForImageClassification, cfg)
    write(
        "hf_beit",
        version("transformers") + " (FlaxBeitForImageClassification, relative "
        "position bias per layer, layer scale)",
        TIMM_VIT_CONVENTION.replace(
            "VisionTransformer.no_weight_decay() = {pos_embed, cls_token, dist_token}",
            "Beit.no_weight_decay() = {pos_embed, cls_token, *relative_position_bias_table}",
        ),
        entries(p, timm_vit_decays),
        "layer scales lambda_1/lambda_2 are 1-D",
    )


def rec_hf_dinov2() -> None:
    from transformers import Dinov2Config, FlaxDinov2Model

    cfg = Dinov2Config(**VISION, layerscale_value=0.1)
    p = hf_params(FlaxDinov2Model, cfg)
    write(
        "hf_dinov2",
        version("transformers") + " (FlaxDinov2Model)",
        TIMM_VIT_CONVENTION + "; DINOv2's mask_token treated like cls_token",
        entries(p, timm_vit_decays),
        "embeddings/mask_token is 2-D (1, hidden); layer_scale/lambda1 is 1-D",
    )


WHISPER_CONVENTION = (
    "Hugging Face examples/flax/speech-recognition/run_flax_speech_recognition_seq2seq.py "
    "decay_mask_fn (for FlaxWhisper/FlaxWav2Vec2/FlaxBart): not decayed iff path[-1] == 'bias' "
    "or path[-2:] in [(n, 'scale') for n in ['layer_norm', 'self_attn_layer_norm', "
    "'layernorm_embedding', 'final_layer_norm']]; everything else decays"
)


def rec_hf_whisper() -> None:
    from transformers import FlaxWhisperForConditionalGeneration, WhisperConfig

    cfg = WhisperConfig(
        vocab_size=64,
        num_mel_bins=8,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        d_model=16,
        encoder_ffn_dim=24,
        decoder_ffn_dim=24,
        max_source_positions=8,
        max_target_positions=16,
    )
    p = hf_params(FlaxWhisperForConditionalGeneration, cfg)
    ln = [
        (n, "scale")
        for n in ["layer_norm", "self_attn_layer_norm", "layernorm_embedding", "final_layer_norm"]
    ]
    write(
        "hf_whisper",
        version("transformers") + " (FlaxWhisperForConditionalGeneration)",
        WHISPER_CONVENTION,
        entries(p, lambda c, s, kp: c[-1] != "bias" and tuple(c[-2:]) not in ln),
        "the rule names no encoder_attn_layer_norm: those scales are decayed by the source",
    )


def rec_hf_clip() -> None:
    from transformers import CLIPConfig, FlaxCLIPModel

    cfg = CLIPConfig(
        text_config=dict(
            vocab_size=64,
            hidden_size=16,
            intermediate_size=24,
            num_hidden_layers=2,
            num_attention_heads=2,
            max_position_embeddings=16,
        ),
        vision_config=dict(
            hidden_size=16,
            intermediate_size=24,
            num_hidden_layers=2,
            num_attention_heads=2,
            image_size=8,
            patch_size=4,
        ),
        projection_dim=8,
    )
    p = hf_params(FlaxCLIPModel, cfg)
    write(
        "hf_clip",
        version("transformers") + " (FlaxCLIPModel, text + vision)",
        OPENCLIP_CONVENTION,
        entries(p, openclip_decays),
    )


# --------------------------------------------------------------------------------------------
# Equinox (0.13.8): a nanoGPT-style model with ln_1/ln_2/ln_f, unstacked and vmap-stacked.
# --------------------------------------------------------------------------------------------


def _eqx_model(stacked: bool) -> Any:
    import equinox as eqx

    D, V, T, L = 16, 64, 32, 2

    class MLP(eqx.Module):
        c_fc: eqx.nn.Linear
        c_proj: eqx.nn.Linear

        def __init__(self, key):
            k1, k2 = jax.random.split(key)
            self.c_fc = eqx.nn.Linear(D, 4 * D, key=k1)
            self.c_proj = eqx.nn.Linear(4 * D, D, key=k2)

    class Attention(eqx.Module):
        c_attn: eqx.nn.Linear
        c_proj: eqx.nn.Linear

        def __init__(self, key):
            k1, k2 = jax.random.split(key)
            self.c_attn = eqx.nn.Linear(D, 3 * D, key=k1)
            self.c_proj = eqx.nn.Linear(D, D, key=k2)

    class Block(eqx.Module):
        ln_1: eqx.nn.LayerNorm
        attn: Attention
        ln_2: eqx.nn.LayerNorm
        mlp: MLP

        def __init__(self, key):
            k1, k2 = jax.random.split(key)
            self.ln_1 = eqx.nn.LayerNorm(D)
            self.attn = Attention(k1)
            self.ln_2 = eqx.nn.LayerNorm(D)
            self.mlp = MLP(k2)

    class GPT(eqx.Module):
        wte: eqx.nn.Embedding
        wpe: eqx.nn.Embedding
        blocks: Any
        ln_f: eqx.nn.LayerNorm
        lm_head: eqx.nn.Linear

        def __init__(self, key):
            k1, k2, k3, k4 = jax.random.split(key, 4)
            self.wte = eqx.nn.Embedding(V, D, key=k1)
            self.wpe = eqx.nn.Embedding(T, D, key=k2)
            keys = jax.random.split(k3, L)
            if stacked:
                self.blocks = eqx.filter_vmap(Block)(keys)
            else:
                self.blocks = [Block(k) for k in keys]
            self.ln_f = eqx.nn.LayerNorm(D)
            self.lm_head = eqx.nn.Linear(D, V, use_bias=False, key=k4)

    return eqx.filter_eval_shape(GPT, jax.random.PRNGKey(0))


def _eqx_kind(module: Any) -> str:
    import equinox as eqx

    if isinstance(module, eqx.nn.Embedding):
        return "embedding"
    if isinstance(module, (eqx.nn.LayerNorm, eqx.nn.RMSNorm, eqx.nn.GroupNorm, eqx.nn.BatchNorm)):
        return "norm"
    if isinstance(module, (eqx.nn.Linear, eqx.nn.Conv)):
        return "linear"
    return "other"


def _owner(root: Any, kp: tuple) -> Any:
    """The object holding the leaf at key path ``kp`` (walks GetAttr/Sequence/Dict keys)."""
    obj = root
    for k in kp[:-1]:
        if isinstance(k, jax.tree_util.GetAttrKey):
            obj = getattr(obj, k.name)
        elif isinstance(k, jax.tree_util.SequenceKey):
            obj = obj[k.idx]
        elif isinstance(k, jax.tree_util.DictKey):
            obj = obj[k.key]
        else:
            raise TypeError(k)
    return obj


def rec_eqx(stacked: bool) -> None:
    import equinox as eqx

    model = _eqx_model(stacked)
    # filter_eval_shape leaves jax.ShapeDtypeStruct where arrays would be.
    params = eqx.filter(model, lambda x: isinstance(x, jax.ShapeDtypeStruct))
    name = "eqx_gpt_stacked" if stacked else "eqx_gpt"
    leaves = entries(
        params, lambda c, s, kp: module_type_decays(c[-1], _eqx_kind(_owner(model, kp)))
    )
    write(
        name,
        version("equinox")
        + (
            " (blocks built with eqx.filter_vmap: every block leaf has a leading layer axis)"
            if stacked
            else " (blocks as a Python list)"
        ),
        MODULE_TYPE_CONVENTION,
        leaves,
        "nanoGPT-style GPT: eqx.nn.Embedding wte/wpe, blocks of ln_1 (eqx.nn.LayerNorm), "
        "attn.c_attn/c_proj, ln_2, mlp.c_fc/c_proj (eqx.nn.Linear), ln_f, lm_head",
    )


# --------------------------------------------------------------------------------------------
# Flax NNX (0.12.8): single layers, an nnx.vmap-stacked block, nnx.LoRA.
# --------------------------------------------------------------------------------------------


def _nnx_kind(module: Any) -> str:
    from flax import nnx

    if isinstance(module, nnx.Embed):
        return "embedding"
    if isinstance(module, (nnx.LayerNorm, nnx.RMSNorm, nnx.BatchNorm, nnx.GroupNorm)):
        return "norm"
    if isinstance(module, (nnx.LoRA, nnx.LoRALinear)):
        return "lora"
    if isinstance(module, (nnx.Linear, nnx.Conv, nnx.LinearGeneral, nnx.Einsum)):
        return "linear"
    return "other"


def _nnx_entries(model: Any) -> list[dict]:
    from flax import nnx

    modules = {
        tuple(str(k) for k in path): node
        for path, node in nnx.iter_graph(model)
        if isinstance(node, nnx.Module)
    }
    state = nnx.state(model, nnx.Param)

    def decays(comps, shape, kp):
        owner = next(
            modules[comps[:n]] for n in range(len(comps) - 1, -1, -1) if comps[:n] in modules
        )
        return module_type_decays(comps[-1], _nnx_kind(owner))

    return entries(state, decays)


def rec_nnx_layers() -> None:
    from flax import nnx

    class Layers(nnx.Module):
        def __init__(self, rngs):
            self.embed = nnx.Embed(64, 16, rngs=rngs)
            self.conv = nnx.Conv(3, 16, kernel_size=(4, 4), strides=(4, 4), rngs=rngs)
            self.linear = nnx.Linear(16, 24, rngs=rngs)
            self.layer_norm = nnx.LayerNorm(16, rngs=rngs)
            self.rms_norm = nnx.RMSNorm(16, rngs=rngs)
            self.batch_norm = nnx.BatchNorm(16, rngs=rngs)
            self.attention = nnx.MultiHeadAttention(
                num_heads=2, in_features=16, decode=False, rngs=rngs
            )
            self.lora_linear = nnx.LoRALinear(16, 24, lora_rank=4, rngs=rngs)
            self.lora = nnx.LoRA(16, 4, 24, rngs=rngs)
            self.head = nnx.Linear(16, 3, rngs=rngs)

    model = nnx.eval_shape(lambda: Layers(nnx.Rngs(0)))
    write(
        "nnx_layers",
        version("flax") + " (flax.nnx layers, nnx.state(model, nnx.Param))",
        MODULE_TYPE_CONVENTION + "; LoRA factors lora_a/lora_b alike (decayed)",
        _nnx_entries(model),
    )


def rec_nnx_stacked() -> None:
    from flax import nnx

    class Block(nnx.Module):
        def __init__(self, rngs):
            self.norm1 = nnx.LayerNorm(16, rngs=rngs)
            self.linear1 = nnx.Linear(16, 24, rngs=rngs)
            self.norm2 = nnx.RMSNorm(24, rngs=rngs)
            self.linear2 = nnx.Linear(24, 16, rngs=rngs)

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.embedder = nnx.Embed(64, 16, rngs=rngs)

            @nnx.split_rngs(splits=3)
            @nnx.vmap(in_axes=(0,), out_axes=0)
            def make(r):
                return Block(r)

            self.layers = make(rngs)
            self.final_norm = nnx.LayerNorm(16, rngs=rngs)

    model = nnx.eval_shape(lambda: Model(nnx.Rngs(0)))
    write(
        "nnx_stacked",
        version("flax") + " (flax.nnx blocks stacked with nnx.vmap, 3 layers)",
        MODULE_TYPE_CONVENTION,
        _nnx_entries(model),
    )


# --------------------------------------------------------------------------------------------
# Flax linen: a big_vision ViT (unstacked and nn.scan-stacked).
# --------------------------------------------------------------------------------------------

BIG_VISION_CONVENTION = (
    "big_vision optax.py make(): wd_mults default [('.*/kernel$', 1.0)] matched against the "
    "'/'-joined param path: exactly the leaves named kernel are decayed (the patch conv "
    "embedding/kernel, attention and MLP kernels, head/kernel); pos_embedding, cls, scales and "
    "biases are not"
)


def _big_vision_vit(scan: bool) -> Any:
    """big_vision/models/vit.py's _Model (ViT-B/x layout at toy size), reproduced in linen
    because big_vision is not on PyPI: param names are big_vision's."""
    import flax.linen as nn

    width, depth, heads, mlp_dim, patch = 16, 2, 2, 24, 4

    class MlpBlock(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.Dense(mlp_dim)(x)
            x = nn.gelu(x)
            return nn.Dense(width)(x)

    class Encoder1DBlock(nn.Module):
        @nn.compact
        def __call__(self, x, _=None):
            y = nn.LayerNorm()(x)
            y = nn.MultiHeadDotProductAttention(num_heads=heads)(y, y)
            x = x + y
            y = nn.LayerNorm()(x)
            x = x + MlpBlock()(y)
            return x, None

    class Encoder(nn.Module):
        @nn.compact
        def __call__(self, x):
            if scan:
                block = nn.scan(
                    Encoder1DBlock,
                    variable_axes={"params": 0},
                    split_rngs={"params": True},
                    length=depth,
                )
                x, _ = block(name="encoderblock")(x, None)
            else:
                for lyr in range(depth):
                    x, _ = Encoder1DBlock(name=f"encoderblock_{lyr}")(x)
            return nn.LayerNorm(name="encoder_norm")(x)

    class ViT(nn.Module):
        @nn.compact
        def __call__(self, image):
            x = nn.Conv(
                width, (patch, patch), strides=(patch, patch), padding="VALID", name="embedding"
            )(image)
            n, h, w, c = x.shape
            x = x.reshape(n, h * w, c)
            x = x + self.param("pos_embedding", nn.initializers.normal(0.02), (1, h * w, c))
            cls = self.param("cls", nn.initializers.zeros, (1, 1, c))
            x = jnp.concatenate([jnp.tile(cls, [n, 1, 1]), x], axis=1)
            x = Encoder(name="Transformer")(x)
            return nn.Dense(5, name="head")(x[:, 0])

    model = ViT()
    return jax.eval_shape(model.init, jax.random.PRNGKey(0), jnp.zeros((1, 8, 8, 3)))["params"]


def rec_big_vision(scan: bool) -> None:
    from flax.core import unfreeze

    p = unfreeze(_big_vision_vit(scan))
    name = "big_vision_vit_scan" if scan else "big_vision_vit"
    write(
        name,
        version("flax")
        + " (flax.linen reproduction of big_vision/models/vit.py"
        + (", scan=True: nn.scan-stacked encoderblock" if scan else "")
        + ")",
        BIG_VISION_CONVENTION,
        entries(p, lambda c, s, kp: re.fullmatch(r".*/kernel$", "/".join(c)) is not None),
        "big_vision is not pip-installable; module and param names reproduce big_vision's "
        "vit.py (embedding, pos_embedding, cls, Transformer/encoderblock[_i]/LayerNorm_0, "
        "MultiHeadDotProductAttention_0, MlpBlock_0, encoder_norm, head)",
    )


# --------------------------------------------------------------------------------------------
# Gemma LoRA (gemma 3.3.0): gm.nn.LoRA around a toy-size gm.nn.Transformer.
# --------------------------------------------------------------------------------------------

GEMMA_CONVENTION = (
    "gemma examples/lora.py and docs/lora: optimizer = kd.optim.partial_updates("
    "optax.adafactor(...), mask=kd.optim.select('lora')): only the LoRA factors are trained, "
    "all of them alike (any weight decay in that optimizer applies to lora/a and lora/b "
    "equally); the base weights are frozen (marked frozen)"
)


def rec_gemma_lora() -> None:
    # kauldron 1.3.0 (which gemma 3.3.0 needs) wraps jax._src.random._check_prng_key at import
    # time, a private function jax 0.10 no longer has. Give it a no-op to wrap: jax itself
    # never calls it, so nothing else changes. (Recording script only; the package never
    # touches jax._src.)
    from jax._src import random as _jax_random

    if not hasattr(_jax_random, "_check_prng_key"):
        _jax_random._check_prng_key = lambda name, key, *args, **kwargs: key
    from gemma import gm
    from gemma.gm.nn import _config, _gemma

    cfg = _config.TransformerConfig(
        num_embed=64,
        embed_dim=16,
        hidden_dim=24,
        num_heads=2,
        head_dim=8,
        num_kv_heads=1,
        final_logit_softcap=None,
        use_post_attn_norm=True,
        use_post_ffw_norm=True,
        use_qk_norm=True,
        attention_types=_config.make_attention_layers_types(
            _gemma.GEMMA3_ATTENTION_PATTERN, num_layers=2
        ),
        query_pre_attn_norm=_config.QueryPreAttentionNormalisation.BY_ONE_OVER_SQRT_HEAD_DIM,
        sliding_window_size=8,
        transpose_gating_einsum=True,
    )
    model = gm.nn.LoRA(rank=4, model=gm.nn.Transformer(config=cfg, tokens="batch.tokens"))
    tokens = jnp.zeros((1, 4), jnp.int32)
    params = jax.eval_shape(lambda r: model.init(r, tokens), jax.random.PRNGKey(0))["params"]
    from flax.core import unfreeze

    params = unfreeze(params)
    write(
        "gemma_lora",
        version("gemma") + " (gm.nn.LoRA(rank=4) around gm.nn.Transformer with a "
        "toy Gemma3-style TransformerConfig, 2 layers)",
        GEMMA_CONVENTION,
        entries(params, lambda c, s, kp: True, frozen=lambda c: "lora" not in c),
        "LoRA factors: <layer>/lora/a, <layer>/lora/b; for einsum weights b can be 3-D "
        "(rank, heads, head_dim)",
    )


# --------------------------------------------------------------------------------------------
# Mamba2 (mamba2-jax 1.1.2, flax.nnx).
# --------------------------------------------------------------------------------------------

MAMBA_CONVENTION = (
    "mamba_ssm marks A_log, D (mamba_simple.py, mamba2.py) and dt_bias (mamba2.py) with "
    "_no_weight_decay = True; the state-spaces training code (HazyResearch state-spaces "
    "src/utils/optim_groups.py add_optimizer_hooks) honours it and also excludes biases, "
    "normalisation weights and nn.Embedding weights; all else (in_proj, conv1d, out_proj, "
    "lm_head) decays"
)


def rec_mamba2() -> None:
    from flax import nnx
    from mamba2_jax import Mamba2Config, Mamba2ForCausalLM, modeling

    cfg = Mamba2Config(
        vocab_size=64,
        hidden_size=16,
        state_size=8,
        head_dim=8,
        chunk_size=8,
        num_hidden_layers=2,
        tie_word_embeddings=False,
    )
    model = nnx.eval_shape(lambda: Mamba2ForCausalLM(cfg, rngs=nnx.Rngs(0)))
    modules = {
        tuple(str(k) for k in path): node
        for path, node in nnx.iter_graph(model)
        if isinstance(node, nnx.Module)
    }

    def kind(m):
        if isinstance(m, modeling.Mamba2Mixer):
            return "ssm"
        if isinstance(m, modeling.RMSNorm):
            return "norm"
        return _nnx_kind(m)

    def decays(comps, shape, kp):
        owner = next(
            modules[comps[:n]] for n in range(len(comps) - 1, -1, -1) if comps[:n] in modules
        )
        return module_type_decays(comps[-1], kind(owner))

    write(
        "mamba2_jax",
        version("mamba2-jax") + " (Mamba2ForCausalLM, flax.nnx, 2 layers, untied lm_head)",
        MAMBA_CONVENTION,
        entries(nnx.state(model, nnx.Param), decays),
    )


RECORDERS: dict[str, Callable[[], None]] = {
    "hf_bert": rec_hf_bert,
    "hf_roberta": rec_hf_roberta,
    "hf_albert": rec_hf_albert,
    "hf_electra": rec_hf_electra,
    "hf_gpt2": rec_hf_gpt2,
    "hf_llama": rec_hf_llama,
    "hf_t5": rec_hf_t5,
    "hf_vit": rec_hf_vit,
    "hf_clip": rec_hf_clip,
    "hf_beit": rec_hf_beit,
    "hf_dinov2": rec_hf_dinov2,
    "hf_whisper": rec_hf_whisper,
    "eqx_gpt": lambda: rec_eqx(False),
    "eqx_gpt_stacked": lambda: rec_eqx(True),
    "nnx_layers": rec_nnx_layers,
    "nnx_stacked": rec_nnx_stacked,
    "big_vision_vit": lambda: rec_big_vision(False),
    "big_vision_vit_scan": lambda: rec_big_vision(True),
    "gemma_lora": rec_gemma_lora,
    "mamba2_jax": rec_mamba2,
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", action="append", choices=sorted(RECORDERS))
    args = ap.parse_args()
    for name in args.only or RECORDERS:
        RECORDERS[name]()


if __name__ == "__main__":
    main()
