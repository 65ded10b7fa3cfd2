"""GPT-2 fault catalogue for ``parity selftest gpt2``: what goes wrong porting GPT-2 (the book's
ch. 5.5 loads OpenAI's weights by hand) and shared/cases F08, F10. Each fault replaces a Parameter
or a method of ours, never a shared tensor in place."""

from __future__ import annotations

import types

from torch import nn
from torch.nn import functional as F

from parity.selftest.faults import Fault

from ..common.faults import f08_untied_head, f10_masked_neg_inf, rms_instead_of

H = "transformer.h.{}"


def _untransposed_c_proj(pair):
    """A loader that forgets to transpose the attention's ``c_proj`` (Conv1D ``(in, out)``): square,
    so it loads without a shape error (the non-square c_attn, c_fc and mlp.c_proj would not)."""
    for i, block in enumerate(pair.ours.blocks):
        stored = pair.loading.state_dict[f"{H.format(i)}.attn.c_proj.weight"]
        block.att.out_proj.weight = nn.Parameter(stored, requires_grad=False)


def _qkv_split_k_first(pair):
    """``c_attn``'s output split as k, q, v instead of q, k, v (the order np.split's three parts are assigned in)."""
    for block in pair.ours.blocks:
        att = block.att

        def split(self, qkv):
            k, q, v = qkv.split(self.widths, dim=-1)  # the first block is GPT-2's q
            return q, k, v

        att.split_qkv = types.MethodType(split, att)


def _exact_gelu(pair):
    """``nn.GELU()`` (erf) instead of GPT-2's tanh approximation ``gelu_new``."""
    for block in pair.ours.blocks:
        block.ff.act = F.gelu


def _positions_plus_one(pair):
    """Learned positions read one row late: ``pos_emb(positions + 1)``."""
    pos_emb = pair.ours.pos_emb

    def forward(self, positions):
        return nn.Embedding.forward(self, positions + 1)

    pos_emb.forward = types.MethodType(forward, pos_emb)


def _rmsnorm_for_layernorm(layer):
    def inject(pair):
        block = pair.ours.blocks[layer]
        block.norm1 = rms_instead_of(block.norm1)

    return inject


FAULTS = (
    Fault(
        "conv1d-not-transposed",
        "attn.c_proj's Conv1D weight loaded into nn.Linear without a transpose",
        "tiny",
        _untransposed_c_proj,
        f"{H.format(0)}.attn.c_proj",
        "transposed_weight",
        scope=f"{H.format('*')}.attn.c_proj",
    ),
    Fault(
        "qkv-split-order",
        "c_attn's output split as (k, q, v) instead of (q, k, v)",
        "tiny",
        _qkv_split_k_first,
        f"{H.format(0)}.attn.q_rot",
        "swapped_roles",
        scope=f"{H.format('*')}.attn",
    ),
    Fault(
        "exact-gelu",
        "exact (erf) GELU instead of GPT-2's tanh approximation gelu_new",
        "tiny",
        _exact_gelu,
        f"{H.format(0)}.mlp.c_proj@input",
        "activation",
        scope=f"{H.format('*')}.mlp.c_proj",
    ),
    Fault(
        "positions-off-by-one",
        "learned position embeddings read at position + 1",
        "tiny",
        _positions_plus_one,
        "transformer.wpe",
        "position_offset",
    ),
    Fault(
        "rmsnorm-for-layernorm",
        "ln_1 of layer 1 computed as RMSNorm (no mean subtraction, no bias)",
        "tiny",
        _rmsnorm_for_layernorm(1),
        f"{H.format(1)}.ln_1",
        "norm_kind",
    ),
    f08_untied_head(),
    f10_masked_neg_inf(H + ".attn"),
)
