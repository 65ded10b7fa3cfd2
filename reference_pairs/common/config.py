"""The cfg keys every decoder family shares with its Transformers config (the book's names on the
left, Transformers' on the right), translated both ways in one place."""

from __future__ import annotations

#: cfg key -> Transformers config attribute
SHARED_FIELDS = (
    ("vocab_size", "vocab_size"),
    ("context_length", "max_position_embeddings"),
    ("emb_dim", "hidden_size"),
    ("hidden_dim", "intermediate_size"),
    ("n_layers", "num_hidden_layers"),
    ("n_heads", "num_attention_heads"),
    ("n_kv_heads", "num_key_value_heads"),
    ("head_dim", "head_dim"),
    ("tie_word_embeddings", "tie_word_embeddings"),
)
#: a config built here has no special tokens (random weights, random token ids)
NO_SPECIAL_TOKENS = dict(pad_token_id=None, bos_token_id=None, eos_token_id=None)


def shared_to_hf(cfg: dict) -> dict:
    """Keyword arguments of a Transformers config for the :data:`SHARED_FIELDS` of ``cfg``."""
    return {hf: cfg[ours] for ours, hf in SHARED_FIELDS} | NO_SPECIAL_TOKENS


def shared_from_hf(hc) -> dict:
    """The :data:`SHARED_FIELDS` of our cfg from a Transformers config (``head_dim`` defaults to
    ``hidden_size // num_attention_heads``, as the reference's attention computes it)."""
    cfg = {ours: getattr(hc, hf, None) for ours, hf in SHARED_FIELDS}
    cfg["head_dim"] = cfg["head_dim"] or hc.hidden_size // hc.num_attention_heads
    cfg["tie_word_embeddings"] = bool(cfg["tie_word_embeddings"])
    return cfg
