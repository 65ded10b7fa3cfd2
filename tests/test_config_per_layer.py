"""Configs that size each layer apart: a per-layer list of a count field (Gemma 3n's ``intermediate_size``) and a
heterogeneous config (Transformers' ``per_layer_config``: dots.3-note's sliding layers with their own heads, latent
ranks and head widths), read as each layer has it (set 40 was refused or crashed on both before)."""

from __future__ import annotations

import pytest

from parity.model.derive import count_field_problems, derive_facts
from tests import heldout_support


def _dots3_config():
    from transformers import AutoConfig

    return AutoConfig.for_model(
        "dots3_note_text",
        **{
            **heldout_support.COMMON,
            "num_key_value_heads": 4, "use_dsa": None, "sliding_window": 6,
            "layer_types": ["indexed_attention", "sliding_attention", "full_attention", "sliding_attention"],
            "q_lora_rank": 32, "kv_lora_rank": 16, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 12,
            "head_dim": 32, "swa_num_attention_heads": 2, "swa_num_key_value_heads": 2, "swa_q_lora_rank": 24,
            "swa_kv_lora_rank": 20, "swa_head_dim": 32, "swa_qk_nope_head_dim": 16, "swa_v_head_dim": 16,
        },
    )  # fmt: skip


def test_a_heterogeneous_config_gives_each_layer_its_own_heads_and_widths():
    config = _dots3_config()
    assert config.is_heterogeneous  # reading config.qk_rope_head_dim raises: it varies per layer
    facts = derive_facts(config)
    full, sliding = facts.layer(0), facts.layer(1)
    assert (facts.heads_at(0), full.num_kv_heads, full.head_dim) == (4, 4, 16 + 8)  # q/k: nope + rope wide
    assert (facts.heads_at(1), sliding.num_kv_heads, sliding.head_dim) == (2, 2, 16 + 16)
    assert full.attention_scale == pytest.approx(24**-0.5) and sliding.attention_scale == pytest.approx(32**-0.5)
    assert full.rope is not None and sliding.rope is not None
    assert (full.rope.rotary_dim, sliding.rope.rotary_dim) == (8, 16)


def test_a_count_field_given_per_layer_is_read_as_a_list_of_counts():
    from transformers import AutoConfig

    config = AutoConfig.for_model("gemma3n_text", **{**heldout_support.COMMON, "intermediate_size": [64, 96, 64, 96]})
    assert count_field_problems(config) == []
    assert derive_facts(config).intermediate_size == 96  # the widest layer's
    assert count_field_problems({"intermediate_size": [64, "wide"], "head_dim": [16, 16]}) == [
        "intermediate_size is [64, 'wide']; it must be an integer, or one per layer",
        "head_dim is [16, 16]; it must be an integer",  # a list only where the architecture sizes layers apart
    ]
    assert count_field_problems({"intermediate_size": [64, 0]}) == [
        "intermediate_size is [64, 0]; it must be at least 1"
    ]


@pytest.mark.parametrize(
    ("model_type", "fields", "nope"),
    [
        ("granite_swa", {"layer_rope_theta": [1000.0, 0, 50000.0, 1000.0]}, [1]),  # a theta of 0: a NoPE layer
        ("llama4_text", {"no_rope_layers": [1, 0, 0, 1]}, [1, 2]),  # 1 marks a layer that uses RoPE
        ("llama", {}, []),  # no such list: every layer rotates
    ],
)
def test_a_per_layer_list_saying_which_layers_rotate_gives_those_layers_no_rope(model_type, fields, nope):
    """``layer_rope_theta`` (0: NoPE; Granite-SWA's, Muse Spark's) and ``no_rope_layers`` (0: NoPE; Llama 4's,
    Mistral Large 4's) read for any family with no rule of its own: those layers carry no RoPE facts and the field
    is named (a rotation there is then named as RoPE applied at a NoPE layer)."""
    from transformers import AutoConfig

    facts = derive_facts(AutoConfig.for_model(model_type, **{**heldout_support.COMMON, **fields}))
    assert [i for i in range(4) if facts.layer(i).rope is None] == nope
    assert facts.nope_field == next(iter(fields), "")
