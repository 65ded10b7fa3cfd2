"""Every node of every clean CI config of every registered family is bit-identical to Transformers
(atol = rtol = 0) in each dtype its family claims (``Family.exact_dtypes``), in chained mode: the
shared blocks round as each reference rounds."""

from __future__ import annotations

import pytest

import parity
import parity.build
from parity.model.registry import families

CASES = [
    (name, config, dtype) for name, fam in families().items() for config in fam.ci_configs for dtype in fam.exact_dtypes
]


@pytest.mark.parametrize(
    "family, config, dtype", CASES, ids=[f"{f}-{c}-{str(d).replace('torch.', '')}" for f, c, d in CASES]
)
def test_every_node_is_bit_identical(family, config, dtype):
    res = parity.check(parity.build.build_pair(families()[family], config, dtype=dtype), batch_size=2, atol=0, rtol=0)
    assert res.passed, res.verdict()
    assert all(n.max_abs == 0.0 for n in res.nodes), [(n.name, n.max_abs) for n in res.nodes if n.max_abs]


def test_f18_olmo3_yarn_factor_12_is_bit_identical_in_both_modes():
    """shared/cases F18: YaRN with a factor that is not a power of two."""
    from reference_pairs.olmo3 import build_pair

    pair = build_pair(
        config="tiny",
        n_layers=1,
        emb_dim=2,
        n_heads=1,
        n_kv_heads=1,
        head_dim=32,
        hidden_dim=16,
        vocab_size=64,
        rope_type="yarn",
        rope_scaled_layer_types=["sliding_attention"],
        rope_factor=12.0,
        rope_orig_max=64,
        rope_local_base=10000.0,
        rope_attention_factor=2.0,
        seed=8564,
    )
    res = parity.check(pair, seq_len=22, mode="both")
    assert res.passed, res.verdict()
    assert all(n.max_abs == 0.0 for n in res.nodes)
