"""Load a Transformers-format GPT-2 state dict into :class:`~reference_pairs.gpt2.model.GPTModel`.

The map is data: checkpoint key template -> our parameter path template (``{i}`` = layer). Every
projection of GPT-2 is a Transformers ``Conv1D`` whose weight is stored ``(in, out)``, the
transpose of ``nn.Linear``'s ``(out, in)``: those entries are :class:`~parity.model.weights.Transposed`
(ours gets a transposed view, no copy; loader coverage lists each transpose). The fused ``c_attn``
(q, k, v side by side) lands whole in ``W_qkv``. The book (ch. 5.5) splits it into ``W_query``,
``W_key``, ``W_value`` instead; see ``GPTModel`` for why ours keeps it fused.
"""

from __future__ import annotations

from parity.model.weights import Transposed

from ..common.builders import table_loader

BLOCK = "transformer.h.{i}"
WEIGHT_MAP = {
    "transformer.wte.weight": "tok_emb.weight",
    "transformer.wpe.weight": "pos_emb.weight",
    **{f"{BLOCK}.ln_1.{p}": f"blocks.{{i}}.norm1.{p}" for p in ("weight", "bias")},
    f"{BLOCK}.attn.c_attn.weight": Transposed("blocks.{i}.att.W_qkv.weight"),
    f"{BLOCK}.attn.c_attn.bias": "blocks.{i}.att.W_qkv.bias",
    f"{BLOCK}.attn.c_proj.weight": Transposed("blocks.{i}.att.out_proj.weight"),
    f"{BLOCK}.attn.c_proj.bias": "blocks.{i}.att.out_proj.bias",
    **{f"{BLOCK}.ln_2.{p}": f"blocks.{{i}}.norm2.{p}" for p in ("weight", "bias")},
    f"{BLOCK}.mlp.c_fc.weight": Transposed("blocks.{i}.ff.fc1.weight"),
    f"{BLOCK}.mlp.c_fc.bias": "blocks.{i}.ff.fc1.bias",
    f"{BLOCK}.mlp.c_proj.weight": Transposed("blocks.{i}.ff.fc2.weight"),
    f"{BLOCK}.mlp.c_proj.bias": "blocks.{i}.ff.fc2.bias",
    **{f"transformer.ln_f.{p}": f"final_norm.{p}" for p in ("weight", "bias")},
    "lm_head.weight": "out_head.weight",  # tied: the embedding's Parameter; save_pretrained omits it
}


load_weights_into_gpt = table_loader("gpt", WEIGHT_MAP)
