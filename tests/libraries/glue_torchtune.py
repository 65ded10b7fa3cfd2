"""What a user writes to check a torchtune 0.6.1 model (``torchtune.modules.TransformerDecoder``) with
parity.check_model: torchtune's model builders and its HF-checkpoint converters (``hf_to_tune``, which
permutes q/k rows for torchtune's interleaved RoPE). Counted between ``# --- glue: <name> ---`` markers."""

# --- glue: shared ---
from torchtune.models import llama2, llama3_2, mistral, qwen2
from torchtune.models.convert_weights import hf_to_tune
from torchtune.models.qwen2._convert_weights import qwen2_hf_to_tune


def _sizes(hf):
    assert getattr(hf, "head_dim", None) in (None, hf.hidden_size // hf.num_attention_heads)  # torchtune: d / heads
    return dict(vocab_size=hf.vocab_size, num_layers=hf.num_hidden_layers, num_heads=hf.num_attention_heads,
                num_kv_heads=hf.num_key_value_heads, embed_dim=hf.hidden_size, intermediate_dim=hf.intermediate_size,
                max_seq_len=hf.max_position_embeddings, norm_eps=hf.rms_norm_eps,
                rope_base=hf.rope_parameters["rope_theta"])  # fmt: skip


def _load(model, state_dict, hf, convert=hf_to_tune, **kw):
    """``convert`` (torchtune's own) renames and permutes the HF tensors; forward(tokens) -> logits."""
    kw.update(num_heads=hf.num_attention_heads, num_kv_heads=hf.num_key_value_heads, dim=hf.hidden_size)
    model.load_state_dict(convert(state_dict, **kw))
    return model


# --- end glue ---


# --- glue: llama2 ---
def build_llama2(state_dict, hf):
    assert hf.rope_parameters["rope_type"] == "default" and not hf.tie_word_embeddings
    return _load(llama2.llama2(**_sizes(hf)), state_dict, hf)


# --- end glue ---


# --- glue: llama3 ---
def build_llama3(state_dict, hf):
    rp = hf.rope_parameters  # torchtune hard-codes low 1 / high 4 / original context 8192
    assert (rp["rope_type"], rp["low_freq_factor"], rp["high_freq_factor"], rp["original_max_position_embeddings"]) == (
        "llama3",
        1,
        4,
        8192,
    )
    model = llama3_2.llama3_2(**_sizes(hf), scale_factor=rp["factor"], tie_word_embeddings=hf.tie_word_embeddings)
    if hf.tie_word_embeddings:  # torchtune's TiedLinear reads tok_embeddings.weight: no output.weight to load
        state_dict = {k: v for k, v in state_dict.items() if k != "lm_head.weight"}
    return _load(model, state_dict, hf)


# --- end glue ---


# --- glue: mistral ---
def build_mistral(state_dict, hf):  # torchtune's mistral has no sliding window (its docstring says so)
    assert not hf.tie_word_embeddings
    return _load(mistral.mistral(**_sizes(hf)), state_dict, hf)


# --- end glue ---


# --- glue: qwen2 ---
def build_qwen2(state_dict, hf):
    model = qwen2.qwen2(**_sizes(hf), tie_word_embeddings=hf.tie_word_embeddings)
    return _load(model, state_dict, hf, qwen2_hf_to_tune, tie_word_embeddings=hf.tie_word_embeddings)


# --- end glue ---
