"""Every causal-LM type transformers knows, built tiny from its config (random init, nothing
downloaded): `causal_lm_token_logprobs` either equals `log_softmax(model(input_ids, mask).logits)`
at the next tokens, or refuses loudly (ValueError / TypeError). A value that differs silently
would be a bug. Types that cannot be built or run from a tiny generic config (special sub-configs,
optional dependencies, pixel/audio inputs, ...) are skipped with the reason.

The sweep over all types is `slow`; `test_common_types` runs the same check on a few common types
so the machinery always runs."""
from __future__ import annotations

import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

import rlkernels.integrations.transformers as rl_tf  # noqa: E402
from rlkernels.integrations.transformers import causal_lm_token_logprobs  # noqa: E402

try:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
except ImportError:  # pragma: no cover - a transformers without the auto mappings
    CONFIG_MAPPING, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES = {}, {}

V, B, T = 96, 2, 8  # vocabulary, batch, sequence
ATOL, RTOL = 1e-4, 1e-5
COMMON = ("llama", "qwen2", "mistral", "gpt2", "gemma", "phi3")

# attribute name → tiny value; set where the type's default config has the attribute (in its to_dict())
_SIZES = {
    **dict.fromkeys(("vocab_size", "text_vocab_size"), V),
    **dict.fromkeys(("pronunciation_vocab_size", "shape_vocab_size", "encoder_hash_byte_group_vocab"), 32),
    **dict.fromkeys(("hidden_size", "n_embd", "n_embed", "d_model", "embed_dim", "dim", "model_dim", "d_embed",
                     "hidden_dim", "embedding_size", "word_embed_proj_dim", "embedding_dim", "hidden_size_global",
                     "lru_width", "emb_dim"), 32),
    **dict.fromkeys(("num_hidden_layers", "n_layer", "num_layers", "n_layers", "decoder_layers", "encoder_layers",
                     "num_decoder_layers", "num_encoder_layers", "num_blocks"), 2),
    **dict.fromkeys(("num_attention_heads", "n_head", "num_heads", "n_heads", "decoder_attention_heads",
                     "encoder_attention_heads", "num_decoder_attention_heads", "num_encoder_attention_heads"), 4),
    **dict.fromkeys(("num_key_value_heads", "n_kv_heads", "num_kv_heads", "multi_query_group_num", "kv_n_heads",
                     "num_query_groups"), 2),
    **dict.fromkeys(("head_dim", "attention_head_dim", "kv_channels", "d_head", "d_kv", "attention_head_size"), 8),
    **dict.fromkeys(("intermediate_size", "ffn_dim", "n_inner", "decoder_ffn_dim", "encoder_ffn_dim",
                     "ffn_hidden_size", "d_ff", "d_inner", "moe_intermediate_size", "shared_expert_intermediate_size",
                     "expert_intermediate_size", "mlp_dim", "ff_dim", "expert_ffn_hidden_size",
                     "shared_experts_intermediate_size"), 64),
    **dict.fromkeys(("max_position_embeddings", "n_positions", "n_ctx", "max_seq_len", "max_target_positions",
                     "max_source_positions", "seq_length", "max_sequence_length", "model_max_length"), 64),
    **dict.fromkeys(("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"), 4),
    **dict.fromkeys(("num_experts_per_tok", "moe_topk", "moe_top_k", "num_selected_experts", "moe_k",
                     "num_experts_per_token", "index_topk"), 2),
    **dict.fromkeys(("n_shared_experts", "num_shared_experts", "moe_num_shared_experts"), 1),
    **dict.fromkeys(("n_group", "topk_group", "first_k_dense_replace", "num_expert_group", "zero_expert_num"), 1),
    # multi-head latent attention
    **dict.fromkeys(("q_lora_rank", "kv_lora_rank"), 16),
    **dict.fromkeys(("qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim"), 8),
    "qk_head_dim": 16,
    "index_head_dim": 8,
    "index_n_heads": 2,
    "rotary_dim": 4,
    # state-space / linear-attention layers
    **dict.fromkeys(("state_size", "mamba_d_state", "ssm_state_size", "d_state"), 8),
    **dict.fromkeys(("mamba_n_heads", "n_mamba_heads", "linear_num_value_heads", "linear_num_key_heads",
                     "linear_num_heads"), 4),
    **dict.fromkeys(("mamba_d_head", "mamba_headdim", "linear_key_head_dim", "linear_value_head_dim",
                     "linear_head_dim", "adapter_rank"), 8),
    **dict.fromkeys(("n_groups", "mamba_n_groups"), 1),
    **dict.fromkeys(("time_step_rank", "mamba_dt_rank"), 4),
    **dict.fromkeys(("chunk_size", "mamba_chunk_size"), 8),
    # misc
    "sliding_window": 4,  # smaller than T, so the sliding mask is exercised
    "local_attention_window_len": 4,
    "num_buckets": 8,
    "num_kv_shared_layers": 0,
    "hidden_size_per_layer_input": 8,
    "vocab_size_per_layer_input": V,
}
# set even where the default is None (the model would otherwise fail on the None)
_WHEN_NONE = ("head_dim", "num_key_value_heads", "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size",
              "n_shared_experts")
_HEADS = ("num_attention_heads", "n_head", "num_heads", "n_heads")
_KV_HEADS = ("num_key_value_heads", "n_kv_heads", "num_kv_heads", "multi_query_group_num", "kv_n_heads",
             "num_query_groups")
_HIDDEN = ("hidden_size", "n_embd", "n_embed", "d_model", "embed_dim", "dim", "model_dim", "d_embed", "hidden_dim",
           "embedding_size", "word_embed_proj_dim", "embedding_dim", "hidden_size_global", "lru_width",
           "emb_dim")
_HEAD_DIMS = ("head_dim", "attention_head_dim", "kv_channels", "d_head", "d_kv", "attention_head_size")
_LAYERS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "decoder_layers")
# sizes to try when the first fails to build or run: (hidden, heads, head dim)
_VARIANTS = (dict(hidden=32, heads=4, head_dim=8), dict(hidden=64, heads=4, head_dim=16),
             dict(hidden=64, heads=2, head_dim=32))
_TOKEN_IDS = ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id", "sep_token_id",
              "cls_token_id", "mask_token_id", "unk_token_id", "forced_eos_token_id", "forced_bos_token_id")
# per-layer lists (as long as the default's layers) that are cut to the two layers kept
_PER_LAYER = ("layer_types", "mlp_layer_types", "layers_block_type", "block_types", "intermediate_size",
              "activation_sparsity_pattern", "layer_head_dims", "attn_layer_indices", "moe_layer_freq")
# the few types whose config needs more than sizes to be valid at 2 layers
_EXTRA = {
    "gpt_neo": dict(attention_types=[[["global", "local"], 1]]),
    "lfm2_moe": dict(layer_types=["conv", "full_attention"], num_dense_layers=1),
    "zaya": dict(num_experts_per_tok=1),
    "zamba": dict(num_hidden_layers=4, layers_block_type=["mamba", "hybrid", "mamba", "hybrid"]),
    "reformer": dict(attn_layers=["local", "local"], axial_pos_embds=False, local_attn_chunk_length=4),
}


def _int(value):
    return isinstance(value, int) and not isinstance(value, bool)


def _overrides(default, variant, model_type=None):
    """Tiny values of the size attributes `default` (a config instance) has, with its sub-configs'."""
    fields = default.to_dict()
    sizes = dict(_SIZES, **dict.fromkeys(_HIDDEN, variant["hidden"]), **dict.fromkeys(_HEADS, variant["heads"]),
                 **dict.fromkeys(_HEAD_DIMS, variant["head_dim"]))
    heads = next((fields[k] for k in _HEADS if _int(fields.get(k))), None)
    for key in _KV_HEADS:  # multi-head stays multi-head (MLA needs it), MQA stays MQA, GQA gets 2 groups
        kv = fields.get(key)
        sizes[key] = variant["heads"] if kv is None or kv == heads else 1 if kv == 1 else max(1, variant["heads"] // 2)
    out = {}
    for key, value in sizes.items():
        if key in fields and (_int(fields[key]) or (fields[key] is None and key in _WHEN_NONE)):
            out[key] = value
    if out.get("hidden_size_global") and "hidden_size" in out:
        out["hidden_size_global"] = out["hidden_size"]
    for key in _TOKEN_IDS:  # special tokens inside the tiny vocabulary (embeddings' padding_idx, ...)
        current = fields.get(key)
        if _int(current) and current >= V:
            out[key] = V - 1
        elif isinstance(current, (list, tuple)) and any(_int(c) and c >= V for c in current):
            out[key] = [V - 1]
    layers = next((fields[k] for k in _LAYERS if _int(fields.get(k))), None)
    for key, current in fields.items():  # per-layer lists: two layers, of two kinds where there are two
        if isinstance(current, (list, tuple)) and layers and len(current) == layers > 2 and key in _PER_LAYER:
            kinds = list(dict.fromkeys(map(repr, current)))
            first = [next(c for c in current if repr(c) == k) for k in kinds[:2]]
            out[key] = first if len(first) == 2 else list(current[:2])
    expand = fields.get("mamba_expand", fields.get("expand"))
    hidden = next((out[k] for k in _HIDDEN if k in out), None)
    if _int(expand) and hidden:  # Mamba-2 heads: n_heads · d_head = expand · hidden
        for n_heads, d_head in (("mamba_n_heads", "mamba_d_head"), ("n_mamba_heads", "mamba_headdim"),
                                ("num_heads", "head_dim")):
            if n_heads in out and d_head in out:
                out[d_head] = expand * hidden // out[n_heads]
        if "mamba_d_ssm" in fields and "mamba_n_heads" in out:
            out["mamba_d_ssm"] = out["mamba_n_heads"] * out["mamba_d_head"]
    if "attention_hidden_size" in fields and "attention_head_dim" in fields and hidden:
        # Zamba's attention runs on [hidden states, embeddings]: twice the width
        out["attention_hidden_size"] = 2 * hidden
        out["attention_head_dim"] = 2 * hidden // next(out[k] for k in _HEADS if k in out)
    if "qk_nope_head_dim" in out and "head_dim" in out and fields.get("head_dim") != fields.get("qk_rope_head_dim"):
        out["head_dim"] = out["qk_nope_head_dim"] + out["qk_rope_head_dim"]  # MLA: head_dim = nope + rope
    if isinstance(fields.get("per_layer_config"), dict) and fields["per_layer_config"]:
        first = next(iter(fields["per_layer_config"].values()))  # one heterogeneous layer of the two, tiny
        out["per_layer_config"] = {"01": {k: 2 * sizes[k] if k in sizes and _int(v) else v for k, v in first.items()}}
    if "is_decoder" in fields:
        out["is_decoder"] = True  # BERT-style LM heads: causal, as a causal LM
    for name in getattr(type(default), "sub_configs", {}) or {}:
        sub = fields.get(name)
        if isinstance(sub, dict) and isinstance(getattr(default, name, None), transformers.PretrainedConfig):
            out[name] = {**sub, **_overrides(getattr(default, name), variant)}
    out.update(_EXTRA.get(model_type, {}))
    return out


def _config(model_type, variant, cls):
    config_cls = CONFIG_MAPPING[model_type]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        default = config_cls()
        overrides = _overrides(default, variant, model_type)
        try:
            config = config_cls(**overrides)
        except Exception:
            config = transformers.AutoConfig.for_model(model_type, **overrides)
    wanted = getattr(cls, "config_class", None)
    if wanted is not None and not isinstance(config, wanted):  # a text-only class under a composite type
        subs = [getattr(config, n, None) for n in getattr(type(config), "sub_configs", {}) or {}]
        config = next((c for c in subs if isinstance(c, wanted)), config)
    for cfg in (config, *[getattr(config, n, None) for n in getattr(type(config), "sub_configs", {}) or {}]):
        if not isinstance(cfg, transformers.PretrainedConfig):
            continue
        for attr in ("hidden_dropout", "attention_dropout", "dropout", "hidden_dropout_prob",
                     "attention_probs_dropout_prob", "resid_pdrop", "embd_pdrop", "attn_pdrop"):
            if isinstance(cfg.to_dict().get(attr), float):
                setattr(cfg, attr, 0.0)
        cfg.use_cache = False
    return config


def _model_class(model_type):
    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]
    names = name if isinstance(name, (list, tuple)) else (name,)
    for n in names:
        cls = getattr(transformers, n, None)
        if cls is not None:
            return cls
    pytest.skip(f"{model_type}: transformers has no {names[0]} here (optional dependency)")


def _batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, V - 1, (B, T), generator=g)  # no special token
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1, :3] = 0  # a left-padded row, as RL rollouts have
    return ids, mask


def _reference(model, ids, mask):
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits
    return torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None]).squeeze(-1)


@pytest.fixture(autouse=True)
def _quiet():
    """transformers' logger is loud about tiny configs (token ids, rope fields, layer types): errors only."""
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    yield
    transformers.logging.set_verbosity(verbosity)


def _why(e):
    """The first lines of an exception's message, short (a validation error's cause is on its second)."""
    return " ".join(line.strip() for line in str(e).splitlines()[:2])[:200]


def _build(model_type):
    """(model, reference log-probs, input ids, mask used) of a tiny `model_type`, or pytest.skip with why not."""
    if model_type not in CONFIG_MAPPING:
        pytest.skip(f"{model_type}: no config class")
    cls = _model_class(model_type)
    ids, mask = _batch()
    errors = []
    for variant in _VARIANTS:
        try:
            config = _config(model_type, variant, cls)
        except Exception as e:  # noqa: BLE001 - any reason the config cannot be made small
            errors.append(f"config: {type(e).__name__}: {_why(e)}")
            continue
        try:
            torch.manual_seed(0)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                model = cls(config).float().eval()
                if hasattr(model, "set_default_language") and getattr(config, "languages", None):
                    model.set_default_language(config.languages[0])  # X-MOD's adapters need a language
            if sum(p.numel() for p in model.parameters()) > 20_000_000:
                errors.append(f"build: {sum(p.numel() for p in model.parameters())} parameters, not tiny")
                continue
            head = model.get_output_embeddings()
            if head is not None and getattr(head, "weight", None) is not None:
                with torch.no_grad():  # log-probs far from uniform, so a mismatch shows (tied: the input side too)
                    head.weight.mul_(20)
        except Exception as e:  # noqa: BLE001
            errors.append(f"build: {type(e).__name__}: {_why(e)}")
            continue
        for m in (mask, None):  # models without an attention mask (recurrent ones) run unpadded
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    ref = _reference(model, ids, m)
            except Exception as e:  # noqa: BLE001
                errors.append(f"forward(mask={'yes' if m is not None else 'no'}): {type(e).__name__}: "
                              f"{_why(e)}")
                continue
            if ref.shape != (B, T - 1):
                errors.append(f"forward: logits of shape {tuple(ref.shape)}")
                break
            return model, ref, ids, m
    pytest.skip(f"{model_type}: cannot build/run tiny: " + " | ".join(dict.fromkeys(errors)))


def _check(model_type, monkeypatch):
    model, ref, ids, mask = _build(model_type)
    monkeypatch.setattr(rl_tf, "_checked", set())  # each type is head-checked itself, whatever ran before
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ours = causal_lm_token_logprobs(model, ids, mask)
    except (ValueError, TypeError) as e:  # a loud refusal is acceptable
        return f"refused: {type(e).__name__}: {e}"
    assert ours.shape == ref.shape
    finite = torch.isfinite(ref)
    assert torch.equal(finite, torch.isfinite(ours)), f"{model_type}: SILENTLY non-finite where the reference is not"
    gap = float((ours[finite] - ref[finite]).abs().max()) if finite.any() else 0.0
    assert torch.allclose(ours[finite], ref[finite], atol=ATOL, rtol=RTOL), (
        f"{model_type} ({type(model).__name__}): causal_lm_token_logprobs is SILENTLY off "
        f"log_softmax(model(...).logits) by max |Δ| = {gap:.3g} nats (mask={'yes' if mask is not None else 'no'})")
    return "matched" if mask is not None else "matched (unpadded: the model takes no attention mask)"


@pytest.mark.parametrize("model_type", COMMON)
def test_common_types(model_type, monkeypatch):
    outcome = _check(model_type, monkeypatch)
    assert outcome == "matched", outcome  # plain decoders are exact, never refused


@pytest.mark.slow
@pytest.mark.parametrize("model_type", sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES))
def test_every_causal_lm_type(model_type, monkeypatch, record_property):
    outcome = _check(model_type, monkeypatch)
    record_property("outcome", outcome)
    print(f"{model_type}: {outcome}")
