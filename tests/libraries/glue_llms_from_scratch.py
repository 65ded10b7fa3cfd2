"""What a user writes to check a model of llms-from-scratch 1.0.19 (the code of Raschka's "Build a Large
Language Model (From Scratch)": ch04 GPT-2, llama3.py, qwen3.py) with parity.check_model, loaded by the
book's own loaders (``load_weights_into_gpt``, ``load_weights_into_llama``, ``load_weights_into_qwen``).
Counted between ``# --- glue: <name> ---`` markers."""

# --- glue: shared ---
import torch

# --- end glue ---


# --- glue: gpt2 ---
def build_gpt2(state_dict, hf):
    """The book loads OpenAI's TF checkpoint: nested {"blocks": [{"attn": {"c_attn": {"w", "b"}}}], "wte"...},
    Conv1D weights (in, out) as HF stores them; LayerNorm weight/bias are "g"/"b"."""
    from llms_from_scratch.ch04 import GPTModel
    from llms_from_scratch.ch05 import load_weights_into_gpt

    params: dict = {"blocks": [{} for _ in range(hf.n_layer)]}
    for key, value in state_dict.items():
        *path, leaf = key.removeprefix("transformer.").split(".")
        node = params["blocks"][int(path[1])] if path[0] == "h" else params
        for part in path[2:] if path[0] == "h" else []:
            node = node.setdefault(part, {})
        name = {"weight": "g" if path[-1].startswith("ln") else "w", "bias": "b"}[leaf]
        node[path[0] if path[0] in ("wte", "wpe") else name] = value.numpy()
    model = GPTModel(dict(vocab_size=hf.vocab_size, context_length=hf.n_positions, emb_dim=hf.n_embd,
                          n_heads=hf.n_head, n_layers=hf.n_layer, drop_rate=0.0, qkv_bias=True))  # fmt: skip
    load_weights_into_gpt(model, params)
    return model


# --- end glue ---


# --- glue: llama3 ---
def build_llama3(state_dict, hf):
    from llms_from_scratch.llama3 import Llama3Model, load_weights_into_llama

    assert hf.rms_norm_eps == 1e-5 and hf.head_dim == hf.hidden_size // hf.num_attention_heads  # the book's
    rp = hf.rope_parameters
    cfg = dict(vocab_size=hf.vocab_size, context_length=hf.max_position_embeddings, emb_dim=hf.hidden_size,
               n_heads=hf.num_attention_heads, n_layers=hf.num_hidden_layers, hidden_dim=hf.intermediate_size,
               n_kv_groups=hf.num_key_value_heads, rope_base=rp["rope_theta"], dtype=torch.float32,
               rope_freq=dict(factor=rp["factor"], low_freq_factor=rp["low_freq_factor"],
                              high_freq_factor=rp["high_freq_factor"],
                              original_context_length=rp["original_max_position_embeddings"]))  # fmt: skip
    model = Llama3Model(cfg)
    load_weights_into_llama(model, cfg, state_dict)
    return model


# --- end glue ---


# --- glue: qwen3 ---
def build_qwen3(state_dict, hf):
    from llms_from_scratch.qwen3 import Qwen3Model, load_weights_into_qwen

    assert hf.rms_norm_eps == 1e-6  # the book's RMSNorm default
    cfg = dict(vocab_size=hf.vocab_size, context_length=hf.max_position_embeddings, emb_dim=hf.hidden_size,
               n_heads=hf.num_attention_heads, n_layers=hf.num_hidden_layers, hidden_dim=hf.intermediate_size,
               head_dim=hf.head_dim, qk_norm=True, n_kv_groups=hf.num_key_value_heads,
               rope_base=hf.rope_parameters["rope_theta"], dtype=torch.float32)  # fmt: skip
    model = Qwen3Model(cfg)
    load_weights_into_qwen(model, cfg, state_dict)
    return model


# --- end glue ---


# --- glue: qwen3_moe ---
def build_qwen3_moe(state_dict, hf):
    """The book's loader reads per-expert tensors (experts.{e}.gate_proj.weight), as the files on disk
    hold them; Transformers 5 holds them fused (experts.gate_up_proj (e, 2i, d), experts.down_proj)."""
    from llms_from_scratch.qwen3 import Qwen3Model, load_weights_into_qwen

    assert hf.rms_norm_eps == 1e-6 and hf.norm_topk_prob and hf.decoder_sparse_step == 1 and not hf.mlp_only_layers
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
    cfg = dict(vocab_size=hf.vocab_size, context_length=hf.max_position_embeddings, emb_dim=hf.hidden_size,
               n_heads=hf.num_attention_heads, n_layers=hf.num_hidden_layers, head_dim=hf.head_dim, qk_norm=True,
               n_kv_groups=hf.num_key_value_heads, rope_base=hf.rope_parameters["rope_theta"], dtype=torch.float32,
               num_experts=hf.num_experts, num_experts_per_tok=hf.num_experts_per_tok,
               moe_intermediate_size=hf.moe_intermediate_size)  # fmt: skip
    model = Qwen3Model(cfg)
    load_weights_into_qwen(model, cfg, sd)
    return model


# --- end glue ---
