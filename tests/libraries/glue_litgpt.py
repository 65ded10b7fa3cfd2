"""What a user writes to check a litgpt 0.5.13 model (``litgpt.model.GPT``) with parity.check_model:
litgpt's own config templates and HF-checkpoint converters (``litgpt.scripts.convert_hf_checkpoint``).
Lines between ``# --- glue: <name> ---`` markers are counted (tests/libraries/_libcheck.glue_lines)."""

# --- glue: shared ---
from litgpt.config import Config
from litgpt.model import GPT
from litgpt.scripts import convert_hf_checkpoint as convert


def _gpt(template, hf, copy_weights, state_dict, **cfg_kw):
    """litgpt's ``template`` resized to ``hf``; loaded with litgpt's converter; forward(idx) -> logits."""
    cfg = Config.from_name(
        template, n_layer=hf.num_hidden_layers, n_embd=hf.hidden_size, n_head=hf.num_attention_heads,
        n_query_groups=hf.num_key_value_heads, intermediate_size=hf.intermediate_size, vocab_size=hf.vocab_size,
        padded_vocab_size=hf.vocab_size, norm_eps=hf.rms_norm_eps, block_size=hf.max_position_embeddings,
        **{"head_size": getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads, **cfg_kw})  # fmt: skip
    sd: dict = {}
    copy_weights(cfg, {}, sd, state_dict)
    model = GPT(cfg)
    model.load_state_dict(sd)
    return model


# --- end glue ---


# --- glue: llama2 ---
def build_llama2(state_dict, hf):
    return _gpt("Llama-2-7b-hf", hf, convert.copy_weights_hf_llama, state_dict,
                rope_base=hf.rope_parameters["rope_theta"])  # fmt: skip


# --- end glue ---


# --- glue: llama3 ---
def build_llama3(state_dict, hf):
    rp = hf.rope_parameters
    return _gpt("Llama-3.2-1B", hf, convert.copy_weights_hf_llama, state_dict, rope_base=rp["rope_theta"],
                rope_adjustments=dict(factor=rp["factor"], low_freq_factor=rp["low_freq_factor"],
                                      high_freq_factor=rp["high_freq_factor"],
                                      original_max_seq_len=rp["original_max_position_embeddings"]))  # fmt: skip


# --- end glue ---


# --- glue: mistral ---
def build_mistral(state_dict, hf):
    return _gpt("Mistral-7B-v0.1", hf, convert.copy_weights_hf_llama, state_dict,
                rope_base=hf.rope_parameters["rope_theta"], sliding_window_size=hf.sliding_window)  # fmt: skip


# --- end glue ---


# --- glue: qwen3 ---
def build_qwen3(state_dict, hf):
    return _gpt("Qwen3-0.6B", hf, convert.copy_weights_qwen_3, state_dict, rope_base=hf.rope_parameters["rope_theta"])


# --- end glue ---


# --- glue: qwen3_moe ---
def build_qwen3_moe(state_dict, hf):
    """Transformers 5 holds the experts fused (experts.gate_up_proj (e, 2i, d), experts.down_proj);
    litgpt's converter reads the per-expert tensors of the files on disk (experts.{e}.gate_proj.weight)."""
    sd = {}
    for key, value in state_dict.items():
        if key.endswith("experts.gate_up_proj"):
            gate, up = value.chunk(2, dim=1)
            for e in range(len(value)):
                sd[key.replace("gate_up_proj", f"{e}.gate_proj.weight")] = gate[e]
                sd[key.replace("gate_up_proj", f"{e}.up_proj.weight")] = up[e]
        elif key.endswith("experts.down_proj"):
            sd.update({key.replace("down_proj", f"{e}.down_proj.weight"): w for e, w in enumerate(value)})
        else:
            sd[key] = value
    return _gpt("Qwen3-30B-A3B", hf, convert.copy_weights_qwen_3, sd, rope_base=hf.rope_parameters["rope_theta"],
                moe_intermediate_size=hf.moe_intermediate_size, n_expert=hf.num_experts,
                n_expert_per_token=hf.num_experts_per_tok)  # fmt: skip


# --- end glue ---


# --- glue: gemma3 ---
def build_gemma3(state_dict, hf):
    rp, sliding = hf.rope_parameters, [int(t == "sliding_attention") for t in hf.layer_types]
    return _gpt("Gemma-3-1b-it", hf, lambda cfg, *a: convert.copy_weights_gemma_3(*a, config=cfg), state_dict,
                attention_scores_scalar=hf.query_pre_attn_scalar, sliding_window_size=hf.sliding_window,
                sliding_window_indices=sliding, rope_indices=sliding, rope_base=rp["full_attention"]["rope_theta"],
                rope_local_base_freq=rp["sliding_attention"]["rope_theta"],
                final_logit_softcapping=hf.final_logit_softcapping)  # fmt: skip


# --- end glue ---


# --- glue: olmo3 ---
def build_olmo3(state_dict, hf):
    return _gpt("OLMo-2-1124-7B", hf, convert.copy_weights_olmo2, state_dict,
                rope_base=hf.rope_parameters["full_attention"]["rope_theta"], sliding_window_size=hf.sliding_window,
                sliding_window_indices=[int(t == "sliding_attention") for t in hf.layer_types])  # fmt: skip


# --- end glue ---
