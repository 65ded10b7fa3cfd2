"""The scans :mod:`parity.diagnose.scan_order` puts in place of a reference's: in the reference's own step order
each computes what Transformers' function computes (the condition for trying the others), in every other order
something else."""

from __future__ import annotations

import pytest
import torch
from transformers.models.bamba import modeling_bamba
from transformers.models.jamba import modeling_jamba
from transformers.models.qwen3_next import modeling_qwen3_next
from transformers.models.rwkv import modeling_rwkv
from transformers.models.xlstm import modeling_xlstm

from parity.diagnose import scan_order


def _mamba1_args(g: torch.Generator) -> tuple[tuple, dict]:
    batch, channels, state, seq = 2, 6, 4, 9
    u, dt, z = (torch.randn(batch, channels, seq, generator=g) for _ in range(3))
    A = -torch.rand(channels, state, generator=g) - 0.1
    B, C = (torch.randn(batch, state, seq, generator=g) for _ in range(2))
    kwargs = dict(D=torch.randn(channels, generator=g), z=z, delta_bias=torch.randn(channels, generator=g))
    return (u, dt, A, B, C), {**kwargs, "delta_softplus": True, "return_last_state": True}


def _mamba2_args(g: torch.Generator) -> tuple[tuple, dict]:
    batch, seq, heads, head_dim, groups, state = 2, 11, 4, 3, 2, 5
    x = torch.randn(batch, seq, heads, head_dim, generator=g)
    dt = torch.randn(batch, seq, heads, generator=g)
    A = -torch.rand(heads, generator=g) - 0.1
    B, C = (torch.randn(batch, seq, groups, state, generator=g) for _ in range(2))
    kwargs = dict(chunk_size=4, D=torch.randn(heads, generator=g), dt_bias=torch.randn(heads, generator=g))
    return (x, dt, A, B, C), {**kwargs, "dt_softplus": True, "dt_limit": (0.0, 2.0), "return_final_states": True}


def _delta_args(g: torch.Generator) -> tuple[tuple, dict]:
    batch, seq, heads, dim = 1, 10, 2, 4
    q, k, v = (torch.randn(batch, seq, heads, dim, generator=g) for _ in range(3))
    g_, beta = -torch.rand(batch, seq, heads, generator=g), torch.rand(batch, seq, heads, generator=g)
    return (q, k, v, g_, beta), {"output_final_state": True, "use_qk_l2norm_in_kernel": True}


@pytest.mark.parametrize(
    "module, name, make",
    [
        (modeling_jamba, "mamba_selective_scan", _mamba1_args),
        (modeling_bamba, "mamba2_chunk_scan", _mamba2_args),
        (modeling_qwen3_next, "torch_chunk_gated_delta_rule", _delta_args),
    ],
)
def test_the_replacement_in_the_reference_s_order_computes_transformers_scan_and_no_other_does(module, name, make):
    args, kwargs = make(torch.Generator().manual_seed(0))
    original = getattr(module, name)
    want, want_state = original(*args, **kwargs)
    replacements = scan_order.replacements(name, original)
    assert [r.own for r, _ in replacements] == [True] + [False] * (len(replacements) - 1)
    for replacement, words in replacements:
        out, state = replacement(*args, **kwargs)
        assert out.shape == want.shape and state.shape == want_state.shape, words
        same = torch.allclose(out.float(), want.float(), atol=1e-5) and torch.allclose(state, want_state, atol=1e-5)
        assert same == replacement.own, words


def test_the_wkv_recurrence_in_transformers_order_computes_rwkvs_and_no_other_order_does():
    """RWKV's state is a list ``[numerator, denominator, max]``, compared as the real state ``num * e^max``."""
    g = torch.Generator().manual_seed(0)
    batch, seq, channels = 2, 9, 6
    k, v = (torch.randn(batch, seq, channels, generator=g) for _ in range(2))
    decay, first = torch.randn(channels, generator=g), torch.randn(channels, generator=g)
    original = modeling_rwkv.rwkv_linear_attention
    want, want_state = original(decay, first, k, v, return_state=True)
    replacements = scan_order.replacements("rwkv_linear_attention", original)
    assert [r.order for r, _ in replacements] == list(scan_order.WKV_ORDERS)
    assert [r.own for r, _ in replacements] == [True, False, False]
    real = lambda s: (s[0] * s[2].exp(), s[1] * s[2].exp())
    for replacement, words in replacements:
        out, state = replacement(decay, first, k, v, return_state=True)
        same = torch.allclose(out, want, atol=1e-5) and all(
            torch.allclose(a, b, rtol=1e-4) for a, b in zip(real(state), real(want_state))
        )
        assert same == replacement.own, words


def test_mamba2_s_scan_takes_no_gate_so_no_skip_after_it_is_tried():
    orders = [r.order for r, _ in scan_order.replacements("mamba2_chunk_scan", modeling_bamba.mamba2_chunk_scan)]
    assert "D_after_gate" not in orders and orders[0] == "euler_B"
    orders = [r.order for r, _ in scan_order.replacements("mamba_selective_scan", modeling_jamba.mamba_selective_scan)]
    assert "D_after_gate" in orders


def test_the_mlstm_cell_in_transformers_order_computes_its_kernels_and_no_variant_does():
    g = torch.Generator().manual_seed(0)
    batch, heads, seq, d_qk, d_v = 2, 2, 12, 4, 6
    q, k = (torch.randn(batch, heads, seq, d_qk, generator=g) for _ in range(2))
    v = torch.randn(batch, heads, seq, d_v, generator=g)
    i, f = (3 * torch.randn(batch, heads, seq, generator=g) for _ in range(2))
    recurrent = modeling_xlstm.mlstm_recurrent_sequence_native(q, k, v, i, f, eps=1e-2)
    chunked = modeling_xlstm.mlstm_chunkwise_native_autograd(q, k, v, i, f, eps=1e-2, chunk_size=4)
    orders = list(scan_order.MLSTM_ORDERS)
    for order in orders:
        h = scan_order.mlstm(order, q, k, v, i, f, 1e-2)
        assert h.shape == recurrent.shape
        same = torch.allclose(h, recurrent, atol=1e-5) and torch.allclose(h, chunked, atol=1e-4)
        assert same == (order == orders[0]), order
