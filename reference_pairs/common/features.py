"""Features a config exercises, for the gate's config coverage: a real config's feature that no
CI config has is a branch the gate never tests (a YaRN bug once hid behind a default-RoPE debug config)."""

from __future__ import annotations


def common_features(cfg: dict) -> set[str]:
    """Head sharing, layer types, output head tying and attention bias, from the shared cfg keys."""
    n_heads, n_kv = cfg["n_heads"], cfg["n_kv_heads"]
    feats = {"MQA" if n_kv == 1 else "MHA" if n_kv == n_heads else "GQA"}
    feats |= {f"{t} layers" for t in cfg.get("layer_types", [])}
    feats.add("tied head" if cfg.get("tie_word_embeddings") else "untied head")
    if cfg.get("attention_bias"):
        feats.add("attention bias")
    return feats
