"""What a user writes to check a TransformerLens 3.9 model (``HookedTransformer``) with parity.check_model:
TL maps the HF config and converts the HF weights with its own code (``get_pretrained_model_config``,
``get_pretrained_state_dict``), loaded **unprocessed** (no folded norms, no centred writing weights: see
test_processed_weights_are_refused_with_the_unprocessed_load_named). Gemma 3 is built from a
HookedTransformerConfig, as TL 3.9 maps no Gemma 3 text config. Counted between ``# --- glue ---`` markers."""

# --- glue: shared ---
import copy
import tempfile

import torch
from transformer_lens import HookedTransformer
from transformer_lens import loading_from_pretrained as loading
from transformers import AutoModelForCausalLM

UNPROCESSED = dict(fold_ln=False, center_writing_weights=False, center_unembed=False, fold_value_biases=False,
                   refactor_factored_attn_matrices=False)  # fmt: skip


def _hf_model(state_dict, hf):
    """The reference's own tensors in an HF module tree, which TL's converters read."""
    with torch.device("meta"):
        hf_model = AutoModelForCausalLM.from_config(hf)
    hf_model.load_state_dict(state_dict, assign=True, strict=False)
    hf_model.tie_weights()
    return hf_model


# --- end glue ---


# --- glue: gpt2 llama2 llama3 mistral qwen3 olmo3 ---
def build(state_dict, hf, **processing):
    hf = copy.deepcopy(hf)
    hf.n_ctx = getattr(hf, "n_positions", None)  # TL 3.9's GPT-2 mapping reads n_ctx (Transformers 5 has none)
    with tempfile.TemporaryDirectory() as d:
        hf.save_pretrained(d)  # TL maps a folder's config.json with its own convert_hf_model_config
        cfg = loading.get_pretrained_model_config(d, fold_ln=False, device="cpu", dtype=torch.float32)
        sd = loading.get_pretrained_state_dict(d, cfg, _hf_model(state_dict, hf), dtype=torch.float32)
    cfg.tokenizer_name = None  # tokens are passed directly
    model = HookedTransformer(cfg, move_to_device=False)
    model.load_and_process_state_dict(sd, **{**UNPROCESSED, **processing})
    return model  # forward(input, return_type="logits", attention_mask=None) -> logits


# --- end glue ---


# --- glue: gemma3 ---
def build_gemma3(state_dict, hf):
    from transformer_lens import HookedTransformerConfig
    from transformer_lens.pretrained.weight_conversions import convert_gemma_weights

    rp = hf.rope_parameters
    assert hf.query_pre_attn_scalar == hf.head_dim and hf.attn_logit_softcapping is None  # TL: 1 / sqrt(d_head)
    cfg = HookedTransformerConfig(
        d_model=hf.hidden_size, d_head=hf.head_dim, n_heads=hf.num_attention_heads, d_mlp=hf.intermediate_size,
        n_layers=hf.num_hidden_layers, n_ctx=hf.max_position_embeddings, eps=hf.rms_norm_eps, d_vocab=hf.vocab_size,
        act_fn=hf.hidden_activation, normalization_type="RMS", rotary_base=rp["full_attention"]["rope_theta"],
        rotary_base_local=rp["sliding_attention"]["rope_theta"], positional_embedding_type="rotary",
        rotary_dim=hf.head_dim, rotary_adjacent_pairs=False, use_attn_scale=True,
        n_key_value_heads=hf.num_key_value_heads, gated_mlp=True, final_rms=True,
        use_normalization_before_and_after=True, use_qk_norm=True, window_size=hf.sliding_window,
        use_local_attn=True, attn_types=["local" if t == "sliding_attention" else "global" for t in hf.layer_types],
        output_logits_soft_cap=hf.final_logit_softcapping or -1.0, original_architecture="Gemma3ForCausalLM",
        dtype=torch.float32, device="cpu", init_weights=False)  # fmt: skip
    model = HookedTransformer(cfg, move_to_device=False)
    model.load_and_process_state_dict(convert_gemma_weights(_hf_model(state_dict, hf), cfg), **UNPROCESSED)
    return model


# --- end glue ---
