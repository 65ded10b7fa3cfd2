"""check_model on conventions nobody wrote for parity: each kind of loader or layout a library uses,
and the verdict a user relies on for it (a correct model passes; a bug is located at its node with a
hint naming the cause), chained and isolated.

The kinds: a tie kept as copies (plain or transposed) is a note, never a gap; which of two modules
holding one tensor is the embedding is decided by the op reading it; a part of a fused tensor, then
permuted and reshaped (weights and 1-D biases), is compared through the reference's output features
of that part; a copy scaled by a named constant; per-expert modules holding copies of a fused experts
tensor aligned to the reference's experts, its router's weights and choices read from torch.topk; a
node's layout decided by shapes, so a wrong value in another layout is a mismatch; projections
computed by a function on a rearranged parameter are recorded, not untapped."""

from __future__ import annotations

import dataclasses
import math
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import parity
from parity.build.coverage import CONVENTIONS, FLIPPED, SCALED, SPLIT, loader_coverage
from parity.compare.layouts import layouts, match_layout
from parity.user.check_model import build_user_pair

USER_MODELS = Path(__file__).parent / "user_models"
sys.path.insert(0, str(USER_MODELS))

import conv_gemma3_scale  # noqa: E402  (Gemma 3 with scale norms, an nn.Embedding scaled by its caller)
import conv_lens_qwen3  # noqa: E402  (TransformerLens style: W_E and W_U copies, einsum on parameters)
import conv_moe_qwen3  # noqa: E402  (per-expert nn.Linear modules copied out of the fused experts)


def rows(res) -> dict:
    return {r.node: r for r in res.alignment}


def first(res):
    """The first failing node of each mode: (chained, isolated)."""
    return res.first_mismatch, res.first_isolated_mismatch


#: where a bug is located does not depend on the semantic run's float64 rebuild (a correct model's
#: verdict does, and is checked with the defaults): bug tests skip it to stay fast
FAST = {"mode": "both", "semantic": False}


@pytest.fixture
def bug(monkeypatch):
    """Set a user model's module-level BUG switch for one test."""

    def set_bug(module, name):
        monkeypatch.setattr(module, "BUG", name)

    return set_bug


# --- a tie kept as copies; the embedding and the head told apart by the op reading the tensor


def test_a_tie_kept_as_a_copy_and_a_transposed_copy_is_a_note_and_each_copy_is_placed_by_its_op():
    """TransformerLens keeps Qwen3's tied embedding as W_E (a copy) and W_U (a transposed copy)."""
    res = parity.check_model(conv_lens_qwen3.build, "qwen3", mode="both")
    assert res.passed, res.verdict()
    assert res.coverage.ok and not res.coverage.gaps
    assert any("2 copies in ours (embed.W_E, unembed.W_U)" in u for u in res.coverage.untied)
    a = rows(res)
    assert a["model.embed_tokens"].ours == "embed"  # read by indexing: the lookup
    assert a["lm_head"].ours == "unembed"  # read by an einsum: the product
    assert all(n.status != "untapped" for n in res.nodes)


def test_our_families_keep_a_tie_kept_as_copies_as_a_gap():
    """The same loader output is a gap where the loader is ours (copies_break_ties, our families)."""
    table = torch.randn(10, 4)
    state = {"embed.weight": table}

    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(10, 4)
            self.head = nn.Linear(4, 10, bias=False)

    model = Tied()
    with torch.no_grad():
        model.embed.weight.copy_(table)
        model.head.weight.copy_(table)
    ties = {"head.weight": "embed.weight"}
    strict = loader_coverage(model, state, ties)
    assert any("are not the same Parameter" in g for g in strict.gaps)
    lenient = loader_coverage(model, state, ties, copies_break_ties=False)
    assert lenient.ok and lenient.untied


# --- a part of a fused tensor, then permuted and reshaped: TransformerLens' GPT-2, written here


class _LayerNorm(nn.Module):
    def __init__(self, d: int, eps: float):
        super().__init__()
        self.eps, self.w, self.b = eps, nn.Parameter(torch.ones(d)), nn.Parameter(torch.zeros(d))

    def forward(self, x):
        return F.layer_norm(x, x.shape[-1:], self.w, self.b, self.eps)


class _LensAttention(nn.Module):
    """W_Q, W_K, W_V [heads, d_model, d_head] and b_Q.. [heads, d_head]; each projection is F.linear on
    the weight rearranged to (heads * d_head, d_model), as TransformerLens' simple_attn_linear does."""

    def __init__(self, d: int, n: int):
        super().__init__()
        h = d // n
        for name in ("Q", "K", "V"):
            setattr(self, f"W_{name}", nn.Parameter(torch.empty(n, d, h)))
            setattr(self, f"b_{name}", nn.Parameter(torch.empty(n, h)))
        self.W_O, self.b_O = nn.Parameter(torch.empty(n, h, d)), nn.Parameter(torch.empty(d))
        self.scale = math.sqrt(h)

    def project(self, x, w, b):
        n, d, h = w.shape
        return F.linear(x, w.permute(0, 2, 1).reshape(n * h, d), b.reshape(-1)).reshape(*x.shape[:2], n, h)

    def forward(self, x):
        q, k, v = (self.project(x, getattr(self, f"W_{n}"), getattr(self, f"b_{n}")) for n in "QKV")
        scores = torch.einsum("bqnh,bknh->bnqk", q, k) / self.scale
        t = x.shape[1]
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        z = torch.einsum("bnqk,bknh->bqnh", probs, v)
        return torch.einsum("bqnh,nhd->bqd", z, self.W_O) + self.b_O


class _LensMLP(nn.Module):
    """W_in [d, m], W_out [m, d] read by addmm, as TransformerLens' batch_addmm does."""

    def __init__(self, d: int, m: int):
        super().__init__()
        self.W_in, self.b_in = nn.Parameter(torch.empty(d, m)), nn.Parameter(torch.empty(m))
        self.W_out, self.b_out = nn.Parameter(torch.empty(m, d)), nn.Parameter(torch.empty(d))

    def forward(self, x):
        pre = torch.addmm(self.b_in, x.reshape(-1, x.shape[-1]), self.W_in).reshape(*x.shape[:2], -1)
        post = F.gelu(pre, approximate="tanh")
        return torch.addmm(self.b_out, post.reshape(-1, post.shape[-1]), self.W_out).reshape(x.shape)


class _LensBlock(nn.Module):
    def __init__(self, d: int, n: int, m: int, eps: float):
        super().__init__()
        self.ln1, self.attn, self.ln2, self.mlp = (
            _LayerNorm(d, eps),
            _LensAttention(d, n),
            _LayerNorm(d, eps),
            _LensMLP(d, m),
        )

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class _Embed(nn.Module):
    """TransformerLens' Embed: ``W_E[tokens]``; PosEmbed: ``W_pos[:seq]``; Unembed: ``x @ W_U``."""

    def __init__(self, rows: int, cols: int, kind: str):
        super().__init__()
        self.W, self.kind = nn.Parameter(torch.empty(rows, cols)), kind

    def forward(self, x):
        if self.kind == "tokens":
            return self.W[x]
        return self.W[: x.shape[1]] if self.kind == "positions" else x @ self.W


class LensGPT2(nn.Module):
    """GPT-2 in TransformerLens' layout: W_E and W_U copies of the tied table (W_U transposed), c_attn
    cut into W_Q/W_K/W_V and b_Q/b_K/b_V per head."""

    def __init__(self, vocab: int, positions: int, d: int, n: int, m: int, layers: int, eps: float):
        super().__init__()
        self.embed, self.pos_embed = _Embed(vocab, d, "tokens"), _Embed(positions, d, "positions")
        self.blocks = nn.ModuleList(_LensBlock(d, n, m, eps) for _ in range(layers))
        self.ln_final, self.unembed = _LayerNorm(d, eps), _Embed(d, vocab, "product")

    def forward(self, input_ids, attention_mask=None):
        x = self.embed(input_ids) + self.pos_embed(input_ids)
        for block in self.blocks:
            x = block(x)
        return self.unembed(self.ln_final(x))


def build_lens_gpt2(state_dict, hf, value_bias_for_key_bias: bool = False, swap_kv: bool = False):
    d, n = hf.n_embd, hf.n_head
    model = LensGPT2(hf.vocab_size, hf.n_positions, d, n, 4 * d, hf.n_layer, hf.layer_norm_epsilon)
    sd = {k: v.detach().clone() for k, v in state_dict.items()}
    with torch.no_grad():
        model.embed.W.copy_(sd["transformer.wte.weight"])
        model.pos_embed.W.copy_(sd["transformer.wpe.weight"])
        model.unembed.W.copy_(sd["transformer.wte.weight"].T)
        model.ln_final.w.copy_(sd["transformer.ln_f.weight"])
        model.ln_final.b.copy_(sd["transformer.ln_f.bias"])
        for i, block in enumerate(model.blocks):
            p = f"transformer.h.{i}."
            w, b = sd[p + "attn.c_attn.weight"], sd[p + "attn.c_attn.bias"]  # (d, 3d) Conv1D, (3d,)
            for j, name in enumerate("QKV" if not swap_kv else "QVK"):
                getattr(block.attn, f"W_{name}").copy_(w[:, j * d : (j + 1) * d].reshape(d, n, d // n).permute(1, 0, 2))
                part = 2 if (value_bias_for_key_bias and name == "K") else j
                getattr(block.attn, f"b_{name}").copy_(b[part * d : (part + 1) * d].reshape(n, d // n))
            block.attn.W_O.copy_(sd[p + "attn.c_proj.weight"].reshape(n, d // n, d))
            block.attn.b_O.copy_(sd[p + "attn.c_proj.bias"])
            for ln, key in ((block.ln1, "ln_1"), (block.ln2, "ln_2")):
                ln.w.copy_(sd[p + key + ".weight"])
                ln.b.copy_(sd[p + key + ".bias"])
            block.mlp.W_in.copy_(sd[p + "mlp.c_fc.weight"])
            block.mlp.b_in.copy_(sd[p + "mlp.c_fc.bias"])
            block.mlp.W_out.copy_(sd[p + "mlp.c_proj.weight"])
            block.mlp.b_out.copy_(sd[p + "mlp.c_proj.bias"])
    return model.eval()


def test_a_fused_c_attn_cut_per_head_is_compared_through_its_output_features():
    res = parity.check_model(build_lens_gpt2, "gpt2", mode="both")
    assert res.passed, res.verdict()
    assert all(n.status == "ok" for n in res.nodes if "@input" not in n.name), [
        (n.name, n.status) for n in res.nodes if n.status != "ok"
    ]
    a = rows(res)
    d = 48
    for j, name in enumerate("QKV"):
        row = a[f"transformer.h.1.attn.c_attn[{j * d}:{(j + 1) * d}]"]
        assert row.ours == f"param:blocks.1.attn.W_{name}+blocks.1.attn.b_{name}" and row.how == "part"
        assert f"transformer.h.1.attn.c_attn.weight[:, {j * d}:{(j + 1) * d}]" in row.detail
        assert CONVENTIONS[SPLIT].split(" (")[0] in row.detail
    # the projections F.linear computes from the rearranged weights are recorded, not untapped
    status = {n.name: n.status for n in res.nodes}
    assert status["transformer.h.0.attn.c_proj"] == status["transformer.h.0.mlp.c_fc"] == "ok"
    cuts = [c for c in res.coverage.conversions if "cut in 3 parts" in c]
    assert len(cuts) == 4  # weight and bias of c_attn, per layer


def test_key_and_value_weights_cut_the_other_way_round_are_found_where_the_keys_are_used():
    """Each part still holds a part of c_attn (the loader cut K's weight where V's is): the parts agree,
    and the keys attention reads are the values."""
    res = parity.check_model(lambda sd, hf: build_lens_gpt2(sd, hf, swap_kv=True), "gpt2", **FAST)
    assert all(n.status == "ok" for n in res.nodes if n.name.startswith("transformer.h.0.attn.c_attn["))
    for bad in first(res):
        assert bad.name == "transformer.h.0.attn.k_rot" and bad.status == "mismatch"
        assert bad.hint is not None and bad.hint.kind == "swapped_roles", bad.hint
        assert "c_attn[96:144]" in bad.hint.text


def test_a_bias_cut_from_the_wrong_part_is_a_loader_gap():
    build = lambda sd, hf: build_lens_gpt2(sd, hf, value_bias_for_key_bias=True)
    pair = build_user_pair(build, "gpt2")
    gaps = pair.loading.coverage.gaps
    assert "transformer.h.0.attn.c_attn.bias: part 32:48 along axis 0 lands in no parameter of ours" not in gaps
    assert any(
        "transformer.h.0.attn.c_attn.bias: part 48:96 along axis 0 lands in no parameter of ours" in g for g in gaps
    )


# --- a copy scaled by a named constant: TransformerLens' Gemma 3 keeps W_E * sqrt(hidden_size)


def build_prescaled_gemma3(state_dict, hf):
    """conv_gemma3_scale with TransformerLens' embedding: the table pre-multiplied by sqrt(hidden_size)
    (its lookup needs no scaling) and the head a plain copy of the unscaled table."""
    model = conv_gemma3_scale.build(state_dict, hf)
    table = model.embedder.weight.detach()
    scale = torch.tensor(model.cfg.hidden_size**0.5, dtype=table.dtype)
    head = nn.Linear(table.shape[1], table.shape[0], bias=False)
    with torch.no_grad():
        head.weight.copy_(table)
    model.embedder.weight = nn.Parameter(table * scale)
    model.lm_head = head
    model.cfg = dataclasses.replace(model.cfg, hidden_size=1)  # its forward's normalizer: 1
    return model


def test_an_embedding_scaled_by_a_named_constant_is_found_and_aligned():
    res = parity.check_model(build_prescaled_gemma3, "gemma3", mode="both")
    assert res.passed, res.verdict()
    row = rows(res)["model.embed_tokens"]
    assert row.ours == "embedder" and row.how == "weights" and "the embedding scale" in row.detail
    assert any("times the embedding scale" in c for c in res.coverage.conversions)
    assert res.coverage.sources["embedder.weight"][0].how == SCALED


def test_a_scaled_copy_is_found_whatever_rows_are_zero():
    """A padding row of zeros first (GPT-style tables) does not hide the constant."""
    table = torch.randn(12, 8)
    table[:3] = 0
    model = nn.Module()
    model.W_E = nn.Parameter(table * torch.tensor(8**0.5))
    cov = loader_coverage(model, {"embed.weight": table}, constants={"sqrt(hidden_size=8)": 8**0.5})
    assert cov.ok and cov.sources["W_E"][0].how == SCALED
    assert cov.sources["W_E"][0].description == "embed.weight * sqrt(hidden_size=8) (2.82843)"


def test_conv_taps_kept_in_lag_order_are_found_but_rows_in_reverse_are_rows_reordered():
    """A short conv's ``(channels, 1, K)`` taps held ``(channels, K)`` reversed (the newest token's tap first, applied by
    a shifted sum) are the checkpoint's tensor reversed along its last axis; a matrix's rows held in reverse (experts
    stacked the other way round) are rows reordered, never a reversal."""
    taps, router = torch.randn(6, 1, 4), torch.randn(5, 8)
    model = nn.Module()
    model.lag = nn.Parameter(taps.reshape(6, 4).flip(-1).clone())
    model.gate = nn.Parameter(router.flip(0).clone())
    cov = loader_coverage(model, {"conv1d.weight": taps, "gate.weight": router})
    assert cov.ok, cov
    assert cov.sources["lag"][0].how == FLIPPED and cov.sources["lag"][0].flip_axis == 1
    assert cov.sources["gate"][0].how != FLIPPED
    assert any("conv1d.weight: into lag (6, 4) reversed along axis 1" in c for c in cov.conversions)


def _plain_model(rope: torch.Tensor, weight: torch.Tensor) -> nn.Module:
    """A JAX-style port: its weight and its RoPE frequencies kept in plain dicts, adopted as parameters."""
    from parity.user.check_model import adopt_plain_tensors

    model = nn.Module()
    model.w = {"proj": weight}
    model.rope = {"full_attention": rope}
    adopt_plain_tensors(model)
    return model


def test_a_plain_tensor_computed_at_build_is_no_gap_but_one_sized_like_an_unplaced_weight_is():
    """RoPE frequencies kept in a dict hold no checkpoint tensor, as a buffer's would not (LFM3's port): state
    computed at build. A plain tensor as large as a checkpoint tensor nothing holds may be that weight in a
    layout parity does not know: it stays a gap, named."""
    weight, rope = torch.randn(6, 4), 1.0 / 10000 ** (torch.arange(0, 8, 2) / 8)
    cov = loader_coverage(_plain_model(rope, weight.clone()), {"proj.weight": weight})
    assert cov.ok and cov.computed == ["plain__rope__full_attention"] and not cov.unwritten, cov
    cov = loader_coverage(_plain_model(rope, weight * 3.7), {"proj.weight": weight})  # no layout parity knows
    assert not cov.ok and cov.unused == ["proj.weight"], cov
    assert cov.unwritten_names() == ["plain__w__proj"] and cov.computed == ["plain__rope__full_attention"], cov


# --- layouts are decided by shapes


def test_a_layout_is_decided_by_shape_so_a_wrong_value_is_a_mismatch_not_a_shape():
    ref = torch.randn(1, 16, 64)
    ours = ref.reshape(16, 64) * 1.5  # the only layout that fits; the values are wrong
    found = match_layout(ours, ref)
    assert found is not None and torch.equal(found[0], ours.reshape(1, 16, 64))


def test_a_per_head_norm_with_sequence_and_heads_merged_in_another_order_is_compared():
    """TransformerLens' q_norm runs on (seq * heads, head_dim); Gemma 3's on (batch, heads, seq, head_dim)."""
    ref = torch.randn(1, 4, 16, 16)
    ours = ref[0].transpose(0, 1).reshape(64, 16)  # (seq, heads) merged
    fits = layouts((64, 16), (1, 4, 16, 16))
    assert len(fits) == 2  # (heads, seq) or (seq, heads): the last axis, normalised, stays last
    moved, how = match_layout(ours, ref)
    assert torch.equal(moved, ref) and "closest of 2" in how


# --- mixtures of experts: per-expert modules copied out of the fused experts


def test_per_expert_copies_are_aligned_to_the_reference_experts_and_its_router():
    res = parity.check_model(conv_moe_qwen3.build, "qwen3_moe", mode="both")
    assert res.passed, res.verdict()
    a = rows(res)
    assert a["model.layers.0.mlp.router.experts"].how == "routing"
    assert a["model.layers.0.mlp.router.experts"].ours == "tap:blocks.0.ffn.router.experts"
    assert a["model.layers.0.mlp.router.weights"].ours == "tap:blocks.0.ffn.router.weights"
    assert a["model.layers.0.mlp.experts.3"].ours == "param:blocks.0.ffn.experts.3.2.weight"
    assert a["model.layers.0.mlp.experts.3"].how == "expert"
    assert a["model.layers.0.mlp.experts"].ours == "blocks.0.ffn"  # its experts are a ModuleList: the block sums
    assert all(r.ours is not None for r in res.alignment)
    judged = [n for n in res.nodes if n.status != "untapped"]
    assert all(n.status == "ok" for n in judged)
    # an expert ours never ran is untapped only where the reference gave it no token either
    for n in res.nodes:
        if n.status == "untapped":
            assert n.kind == "expert" and "all zeros" in n.detail


def test_routing_weights_renormalised_in_place_are_recorded_after_it_and_pass(monkeypatch):
    """``weights /= weights.sum(-1, keepdim=True)`` on the top-k values: the routing weights are followed through
    the in-place division, not recorded before it."""
    monkeypatch.setattr(conv_moe_qwen3, "IN_PLACE_RENORM", True)
    res = parity.check_model(conv_moe_qwen3.build, "qwen3_moe", **FAST)
    assert res.passed, res.verdict()
    assert next(n for n in res.nodes if n.name == "model.layers.0.mlp.router.weights").status == "ok"


@pytest.mark.parametrize(
    ("name", "kind"),
    [("no_softmax", "routing_weights"), ("no_renorm", "renormalisation")],
    ids=["no_softmax", "no_renorm"],
)
def test_routing_weight_bugs_are_found_at_the_router_weights(bug, name, kind):
    bug(conv_moe_qwen3, name)
    res = parity.check_model(conv_moe_qwen3.build, "qwen3_moe", **FAST)
    for bad in first(res):
        assert bad.name == "model.layers.0.mlp.router.weights" and bad.status == "mismatch"
        assert bad.hint is not None and bad.hint.kind == kind, bad.hint
    if name == "no_softmax":
        assert "raw logits" in res.first_mismatch.hint.text


@pytest.mark.parametrize("what", ["whole", "down"])
def test_two_experts_swapped_are_found_at_the_first_expert_with_the_tokens_it_runs_on(what):
    def build(sd, cfg):
        model = conv_moe_qwen3.build(sd, cfg)
        ex = model.blocks[0].ffn.experts
        if what == "whole":
            ex[2], ex[5] = ex[5], ex[2]
        else:  # only the down projections
            ex[2][2], ex[5][2] = ex[5][2], ex[2][2]
        return model

    res = parity.check_model(build, "qwen3_moe", **FAST)
    for bad in first(res):
        assert bad.name == "model.layers.0.mlp.experts.2" and bad.status == "mismatch"
        assert bad.hint is not None and bad.hint.kind == "expert_mapping", bad.hint
        assert "the router sends to expert 5" in bad.hint.text
    row = rows(res)["model.layers.0.mlp.experts.2"]
    assert row.ours == "param:blocks.0.ffn.experts.5.2.weight"  # the module holding expert 2's down projection
    if what == "down":
        assert "blocks.0.ffn.experts.2.0" in row.detail and "blocks.0.ffn.experts.5.2" in row.detail


def test_an_expert_ours_holds_fused_says_why_in_true_words():
    """Ours keeps the experts fused (no module per expert): the reference's per-expert node says so,
    never that it is not a module of the reference."""

    def build(sd, cfg):
        model = conv_moe_qwen3.build(sd, cfg)
        fused = nn.Module()  # the experts as the reference holds them, one tensor each
        fused.gate_up = nn.Parameter(sd["model.layers.0.mlp.experts.gate_up_proj"].clone())
        fused.down = nn.Parameter(sd["model.layers.0.mlp.experts.down_proj"].clone())
        model.blocks[0].ffn.experts = nn.ModuleList()
        model.blocks[0].ffn.fused = fused
        return model

    a = {r.node: r for r in build_user_pair(build, "qwen3_moe").alignment}
    row = a["model.layers.0.mlp.experts.3"]
    assert row.ours is None and "not a module of the reference" not in row.detail
    assert "expert 3" in row.detail


# --- two modules' weights swapped by the loader


def test_q_norm_and_k_norm_weights_swapped_are_named_at_q_norm():
    def build(sd, cfg):
        model = conv_lens_qwen3.build(sd, cfg)
        a = model.blocks[0].attn
        a.q_norm.w, a.k_norm.w = a.k_norm.w, a.q_norm.w
        return model

    res = parity.check_model(build, "qwen3", **FAST)
    for bad in first(res):
        assert bad.name == "model.layers.0.self_attn.q_norm"
        assert bad.hint is not None and bad.hint.kind == "swapped_weights", bad.hint
        assert "q_norm and k_norm" in bad.hint.text


def _lens_like(normalization_type: str, centred: bool) -> nn.Module:
    """A model whose class lives in a ``transformer_lens`` module, as HookedTransformer's does."""
    module_cls = type("HookedTransformer", (nn.Module,), {"__module__": "transformer_lens.HookedTransformer"})
    model = module_cls()
    model.cfg = dataclasses.make_dataclass("Cfg", ["normalization_type"])(normalization_type)
    model.embed = nn.Module()
    w_e = torch.randn(32, 16, generator=torch.Generator().manual_seed(0))
    model.embed.W_E = nn.Parameter(w_e - w_e.mean(-1, keepdim=True) if centred else w_e)
    return model


@pytest.mark.parametrize(
    ("normalization_type", "centred", "named"),
    [("LNPre", False, True), ("RMSPre", False, True), ("LN", True, True), ("LN", False, False), ("RMS", False, False)],
)
def test_processed_transformer_lens_weights_are_refused_naming_the_unprocessed_load(normalization_type, centred, named):
    """TransformerLens' from_pretrained folds norms into the next projections (its cfg then says LNPre /
    RMSPre) and centres the writing weights (W_E rows of mean 0): the refusal names the unprocessed load.
    An unprocessed TransformerLens model missing a tensor (a real loader bug) is not told so.
    Live: tests/libraries/test_transformer_lens.py (pytest -m libs)."""
    from types import SimpleNamespace

    from parity.user.check_model import unplaced_message

    coverage = SimpleNamespace(
        unused=["transformer.h.0.ln_1.weight", "transformer.h.0.attn.c_attn.weight"],
        unwritten=["blocks.0.attn.W_Q (16, 4, 4)"],
        constants=[],
    )
    text = unplaced_message(coverage, _lens_like(normalization_type, centred))
    assert ("from_pretrained_no_processing" in text) is named, text
    assert ("fold_ln=False, center_writing_weights=False" in text) is named, text
    assert "\n" not in text


# --- a from-scratch book's conventions (llms-from-scratch: tests/libraries/test_llms_from_scratch.py, -m libs)


class _BookAttention(nn.Module):
    """q, k, v as nn.Linear, each ``(d, d)``: a square part of GPT-2's Conv1D ``c_attn`` ``(d, 3 d)``,
    transposed; the causal mask filled in place on ``q @ k^T`` before the scaling."""

    def __init__(self, d: int, heads: int, scale_by_head_dim: bool = False, in_place: bool = False):
        super().__init__()
        self.heads, self.scale_by_head_dim, self.in_place = heads, scale_by_head_dim, in_place
        self.q, self.k, self.v, self.out = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = (m(x).view(b, t, self.heads, -1).transpose(1, 2) for m in (self.q, self.k, self.v))
        scores = q @ k.transpose(-1, -2)
        head_dim = q.shape[-1]
        if self.in_place:  # scaled in place before the mask (Falcon's eager attention: scores /= sqrt(d))
            scores /= math.sqrt(head_dim)
            scores.masked_fill_(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
            return self.out((torch.softmax(scores, dim=-1) @ v).transpose(1, 2).reshape(b, t, d))
        scores.masked_fill_(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
        probs = torch.softmax(scores / (head_dim if self.scale_by_head_dim else math.sqrt(head_dim)), dim=-1)
        return self.out((probs @ v).transpose(1, 2).reshape(b, t, d))


class _BookGPT2(nn.Module):
    def __init__(self, c, scale_by_head_dim: bool = False, in_place: bool = False):
        super().__init__()
        d, eps = c.n_embd, c.layer_norm_epsilon
        self.tok, self.pos = nn.Embedding(c.vocab_size, d), nn.Embedding(c.n_positions, d)
        self.blocks = nn.ModuleList()
        for i in range(c.n_layer):
            block = nn.Module()
            block.ln1, block.ln2 = nn.LayerNorm(d, eps=eps), nn.LayerNorm(d, eps=eps)
            block.attn = _BookAttention(d, c.n_head, scale_by_head_dim and i == 1, in_place)
            block.fc, block.proj = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
            self.blocks.append(block)
        self.ln_f, self.head = nn.LayerNorm(d, eps=eps), nn.Linear(d, c.vocab_size, bias=False)

    def forward(self, input_ids):
        x = self.tok(input_ids) + self.pos(torch.arange(input_ids.shape[1]))
        for blk in self.blocks:
            x = x + blk.attn(blk.ln1(x))
            x = x + blk.proj(F.gelu(blk.fc(blk.ln2(x)), approximate="tanh"))
        return self.head(self.ln_f(x))


def build_book_gpt2(sd, c, scale_by_head_dim: bool = False, in_place: bool = False) -> nn.Module:
    assert c.activation_function == "gelu_new"
    model, d = _BookGPT2(c, scale_by_head_dim, in_place), c.n_embd
    with torch.no_grad():
        model.tok.weight.copy_(sd["transformer.wte.weight"])
        model.pos.weight.copy_(sd["transformer.wpe.weight"])
        model.head.weight.copy_(sd["transformer.wte.weight"])  # the tie kept as a copy
        model.ln_f.weight.copy_(sd["transformer.ln_f.weight"])
        model.ln_f.bias.copy_(sd["transformer.ln_f.bias"])
        for i, blk in enumerate(model.blocks):
            p = f"transformer.h.{i}."
            w, b = sd[p + "attn.c_attn.weight"], sd[p + "attn.c_attn.bias"]
            for j, lin in enumerate((blk.attn.q, blk.attn.k, blk.attn.v)):
                lin.weight.copy_(w[:, j * d : (j + 1) * d].T)
                lin.bias.copy_(b[j * d : (j + 1) * d])
            for lin, key in ((blk.attn.out, "attn.c_proj"), (blk.fc, "mlp.c_fc"), (blk.proj, "mlp.c_proj")):
                lin.weight.copy_(sd[p + key + ".weight"].T)
                lin.bias.copy_(sd[p + key + ".bias"])
            for ln, key in ((blk.ln1, "ln_1"), (blk.ln2, "ln_2")):
                ln.weight.copy_(sd[p + key + ".weight"])
                ln.bias.copy_(sd[p + key + ".bias"])
    return model.eval()


def test_q_k_v_cut_square_and_transposed_out_of_c_attn_pass_with_every_attention_node_compared():
    """Each of q, k, v is a square (d, d) part of c_attn, transposed: a part of a fused tensor (not refused);
    the attention block is found from those parts, so q, k, scores, probs and context are compared; the
    scores are q @ k^T as it was before the mask was filled into it in place."""
    res = parity.check_model(build_book_gpt2, "gpt2", **FAST)
    assert res.passed, res.verdict()
    not_ok = {n.name: n.status for n in res.nodes if n.status != "ok"}
    # its blocks hold modules but never run as one (the model's forward calls their parts): no block output
    assert not_ok == {"transformer.h.0": "untapped", "transformer.h.1": "untapped"}, not_ok
    a = rows(res)
    assert a["transformer.h.0.attn.c_attn[0:48]"].ours == "blocks.0.attn.q"  # the module computing that part
    assert a["transformer.h.1.attn.scores"].ours == "tap:blocks.1.attn.scores"
    assert sum("cut in 3 parts" in c for c in res.coverage.conversions) == 4  # weight and bias, per layer


def test_scores_scaled_in_place_are_recorded_scaled_and_pass():
    """``scores /= sqrt(d)`` on the product itself: the scores are the scaled product, as the reference's."""
    res = parity.check_model(lambda sd, c: build_book_gpt2(sd, c, in_place=True), "gpt2", **FAST)
    assert res.passed, res.verdict()
    assert all(n.status == "ok" for n in res.nodes if n.name.endswith((".scores", ".probs")))


def test_an_attention_scale_bug_in_a_book_gpt2_is_found_at_the_scores():
    res = parity.check_model(lambda sd, c: build_book_gpt2(sd, c, scale_by_head_dim=True), "gpt2", **FAST)
    for bad in first(res):
        assert bad.name == "transformer.h.1.attn.scores" and bad.status == "mismatch"
        assert bad.hint is not None and bad.hint.kind == "attention_scale", bad.hint


def _dense_batched_moe(self, x):
    """Every expert on every token, the batch axis kept throughout: routing ``(b, t, k)``, each expert's
    output ``(b, t, d)``, summed with the weights scattered over ``(b, t, experts)``."""
    logits = self.router(x)
    weights, ids = torch.topk(F.softmax(logits.float(), dim=-1), self.a.top_k, dim=-1)
    if self.a.norm_topk:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    gates = torch.zeros_like(logits).scatter(-1, ids, weights.to(x.dtype))
    outs = torch.stack([down(F.silu(gate(x)) * up(x)) for gate, up, down in self.experts], dim=-2)
    return (gates[..., None] * outs).sum(dim=-2)


def test_a_moe_keeping_the_batch_axis_and_running_every_expert_on_every_token_passes(monkeypatch):
    """router.experts ``(b, t, k)`` is compared as the reference's ``(tokens, k)``; an expert run on all tokens
    ``(b, t, d)`` is compared on the tokens the router sent to it (zero elsewhere, as the reference's)."""
    monkeypatch.setattr(conv_moe_qwen3.SparseMoE, "forward", _dense_batched_moe)
    res = parity.check_model(conv_moe_qwen3.build, "qwen3_moe", **FAST)
    assert res.passed, res.verdict()
    status = {n.name: n.status for n in res.nodes}
    assert status["model.layers.0.mlp.router.experts"] == status["model.layers.0.mlp.experts.3"] == "ok"
    judged = [n for n in res.nodes if n.kind == "expert" and n.status != "untapped"]
    assert len(judged) >= 4 and all(n.status == "ok" for n in judged)


# --- rows of one tensor partly fused with others, vectors stacked as rows, a vector kept 1 + w in another shape


def test_rows_fused_with_others_and_held_apart_and_stacked_vectors_are_each_placed():
    """A per-head [query | gate] q_proj whose query rows ours fuses with k and v (its gate rows in a parameter of
    their own), a LayerNorm's weight and bias stacked as one (2, hidden) tensor, and a grouped norm's vector kept
    1 + w as (streams, hidden): every checkpoint tensor placed, no gap."""
    from parity.build.coverage import FUSED_PART, OFFSET, ROWS

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n, 8, generator=g) for n in (16, 4, 4))  # q: 2 heads of [query (4) | gate (4)]
    ln_w, ln_b, hc = torch.randn(8, generator=g), torch.randn(8, generator=g), torch.randn(12, generator=g)
    query = torch.cat([q[0:4], q[8:12]])
    gate = torch.cat([q[4:8], q[12:16]])
    model = nn.Module()
    model.w_qkv = nn.Parameter(torch.cat([query, k, v]).T.contiguous())  # kept input-major
    model.w_gate = nn.Parameter(gate.clone())
    model.ln = nn.Parameter(torch.stack([ln_w, ln_b]))
    model.gain = nn.Parameter((1 + hc).view(3, 4))
    state = {"q.weight": q, "k.weight": k, "v.weight": v, "ln.weight": ln_w, "ln.bias": ln_b, "hc.weight": hc}
    cov = loader_coverage(model, state)
    assert cov.ok, cov.gaps
    how = {(param, s.key): s.how for param, held in cov.sources.items() for s in held}
    assert how["w_qkv", "q.weight"] == FUSED_PART and how["w_gate", "q.weight"] == "part"
    assert how["w_qkv", "k.weight"] == ROWS and how["ln", "ln.bias"] == ROWS and how["gain", "hc.weight"] == OFFSET
    fused = next(s for s in cov.sources["w_qkv"] if s.key == "q.weight")
    assert fused.key_rows == (0, 1, 2, 3, 8, 9, 10, 11) and fused.rows == tuple(range(8))
    # the gate rows left out of ours: a gap naming them
    del model.w_gate
    assert any("8 of 16 rows copied into no parameter" in gap for gap in loader_coverage(model, state).gaps)


def test_a_reference_rewriting_its_weights_on_its_first_forward_is_settled_with_the_originals_kept():
    """RWKV's kind: a module dividing its weight in place the first time it runs (eval mode). ``settle`` runs it
    once, keeps what it wrote, and returns each tensor as it was; a module that writes nothing returns {}."""
    from parity.build.settle import settle

    class Rescaling(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(10, 4)
            self.out = nn.Linear(4, 4)
            self.done = False

        def forward(self, input_ids, use_cache=False):
            if not self.done:
                with torch.no_grad():
                    self.out.weight.div_(2)
                self.done = True
            return self.out(self.emb(input_ids))

    model = Rescaling().eval()
    before = model.out.weight.detach().clone()
    state = dict(model.state_dict())
    originals = settle(model, state, 10)
    assert set(originals) == {"out.weight"} and torch.equal(originals["out.weight"], before)
    assert torch.equal(model.out.weight, before / 2)
    assert settle(model, state, 10) == {}  # the rewrite happens once


# --- vectors stacked or fused the ways a one-forward port holds them (Apertus 1.5's, set 43)


def test_gains_stacked_over_layers_and_biases_fused_then_stacked_are_rows_of_ours():
    """Every layer's two norm gains as one ``(layers, 2, hidden)`` tensor, and each layer's q, k and v biases fused
    end to end and stacked ``(layers, q + k + v)``: each checkpoint vector is rows of ours (the flattened leading
    axes; the elements of the flattened tensor), no gap and nothing read as computed at load; a bias out of order is
    still found where it is, one missing is a gap."""
    gains = {f"layers.{i}.{n}.weight": torch.randn(8) for i in range(3) for n in ("attn_norm", "mlp_norm")}
    biases = {f"layers.{i}.{p}.bias": torch.randn(w) for i in range(3) for p, w in (("q", 8), ("k", 4), ("v", 4))}
    model = nn.Module()
    model.gains = nn.Parameter(
        torch.stack([torch.stack([gains[f"layers.{i}.attn_norm.weight"], gains[f"layers.{i}.mlp_norm.weight"]])
                     for i in range(3)])
    )  # fmt: skip
    model.b_qkv = nn.Parameter(
        torch.stack([torch.cat([biases[f"layers.{i}.{p}.bias"] for p in ("q", "k", "v")]) for i in range(3)])
    )
    cov = loader_coverage(model, {**gains, **biases})
    assert cov.ok and not cov.derived, cov
    mlp = cov.sources["gains"][[s.key for s in cov.sources["gains"]].index("layers.1.mlp_norm.weight")]
    assert mlp.rows == (3,) and mlp.row_axes(3) == ([0, 1], [2])
    k = cov.sources["b_qkv"][[s.key for s in cov.sources["b_qkv"]].index("layers.1.k.bias")]
    assert k.flat and k.rows == tuple(range(24, 28)) and k.row_axes(2) == ([0, 1], [])
    model.b_qkv = nn.Parameter(model.b_qkv.detach()[:, :12].contiguous())  # v's biases left out
    assert not loader_coverage(model, {**gains, **biases}).ok


def test_matrices_stacked_as_stored_and_gains_stacked_as_one_plus_w_are_rows_of_ours():
    """Every layer's square projection stacked as the checkpoint stores it, ``(layers, out, in)`` (no transpose: its
    rows are the stack's last-axis rows), and every layer's norm gains kept as ``1 + w`` rows of one ``(layers, 2,
    hidden)`` table (Gemma's convention, sets 48-49): each key placed, none computed at load or left unwritten."""
    weights = {f"layers.{i}.o_proj.weight": torch.randn(8, 8) for i in range(3)}
    gains = {f"layers.{i}.{n}.weight": torch.randn(8) for i in range(3) for n in ("attn_norm", "mlp_norm")}
    model = nn.Module()
    model.wo = nn.Parameter(torch.stack([weights[f"layers.{i}.o_proj.weight"] for i in range(3)]))
    model.gains = nn.Parameter(
        torch.stack([torch.stack([1.0 + gains[f"layers.{i}.{n}.weight"] for n in ("attn_norm", "mlp_norm")])
                     for i in range(3)])
    )  # fmt: skip
    cov = loader_coverage(model, {**weights, **gains})
    assert cov.ok and not cov.derived and not cov.unwritten, cov
    o1 = cov.sources["wo"][[s.key for s in cov.sources["wo"]].index("layers.1.o_proj.weight")]
    assert o1.how == "rows" and o1.rows == tuple(range(8, 16)) and o1.permute == (0, 1, 2)
    mlp = cov.sources["gains"][[s.key for s in cov.sources["gains"]].index("layers.1.mlp_norm.weight")]
    assert mlp.how == "rows" and mlp.rows == (3,) and mlp.offset == 1.0
    assert any("its rows kept as w + 1" in c for c in cov.conversions), cov.conversions


def test_parts_of_per_layer_fused_weights_stacked_are_fused_parts_of_ours():
    """Every layer's fused ``query_key_value`` (rows laid per KV group, ``[q, q, k, v]``) cut at load into q, k and v,
    each stacked over layers and kept input-major, ``(layers, in, out)`` (Falcon's port, set 50): each slab of ours
    holds its layer's rows of that layer's key, every row of every key placed once, nothing unwritten."""
    fused = {f"layers.{i}.query_key_value.weight": torch.randn(12, 8) for i in range(3)}
    groups = [fused[f"layers.{i}.query_key_value.weight"].unflatten(0, (2, 3, 2)) for i in range(3)]  # (kv, q q k.. )
    model = nn.Module()
    model.wq = nn.Parameter(torch.stack([g[:, :1].reshape(4, 8).T for g in groups]))  # (layers, in, q rows)
    model.wk = nn.Parameter(torch.stack([g[:, 1].reshape(4, 8).T for g in groups]))
    model.wv = nn.Parameter(torch.stack([g[:, 2].reshape(4, 8).T for g in groups]))
    cov = loader_coverage(model, fused)
    assert cov.ok and not cov.unwritten and not cov.gaps and not cov.derived, cov
    k1 = cov.sources["wk"][[s.key for s in cov.sources["wk"]].index("layers.1.query_key_value.weight")]
    assert k1.how == "fused part" and k1.permute == (0, 2, 1), k1
    assert k1.rows == tuple(range(4, 8)) and k1.key_rows == (2, 3, 8, 9), k1  # slab 1; each group's k rows
    # a stack whose slabs are no part of any key (a layer's q rows scaled at load) is still left unwritten
    model.wq.data[1] *= 2.0
    assert any(u.startswith("wq") for u in loader_coverage(model, fused).unwritten)


def test_conv1d_weights_stacked_per_layer_output_major_are_rows_of_ours():
    """GPT-1's Conv1D ``c_attn`` weights, ``(in, 3 * out)`` per layer, stacked as ``(layers, 3, heads, head_dim, in)``
    (each layer's transpose, its output features split): each key's columns are one slab's rows of ours. A stack of
    other tensors' transposes across the first axis (two (experts, hidden) tables kept as (experts, 2, hidden)) is
    not read so."""
    keys = {f"h.{i}.attn.c_attn.weight": torch.randn(8, 24) for i in range(3)}
    model = nn.Module()
    model.w_qkv = nn.Parameter(torch.stack([keys[f"h.{i}.attn.c_attn.weight"].T.reshape(3, 2, 4, 8) for i in range(3)]))
    cov = loader_coverage(model, keys)
    assert cov.ok and not cov.unwritten and not cov.derived, cov
    h1 = cov.sources["w_qkv"][[s.key for s in cov.sources["w_qkv"]].index("h.1.attn.c_attn.weight")]
    assert h1.how == "rows" and h1.transposed and h1.rows == tuple(range(24, 48)), h1
    tables = {"down_embed": torch.randn(6, 8), "up_embed": torch.randn(6, 8)}
    mem = nn.Module()
    mem.mem = nn.Parameter(torch.stack([tables["down_embed"], tables["up_embed"]], dim=1))  # (experts, 2, hidden)
    assert not any(s.transposed for s in loader_coverage(mem, tables).sources.get("mem", []))


def test_a_tensor_computed_in_parts_is_compared_on_its_part():
    """One head (or one tensor-parallel rank's heads) of a node ours computes in parts is compared there, the rest
    not judged; a part whose values differ still fails; ours' tokens flattened sequence first are read batch first."""
    from parity.compare.metrics import MISMATCH, OK
    from parity.compare.results import _part_of_reference, _sequence_first, compare_node, in_reference_layout
    from parity.compare.tolerances import Tolerances
    from parity.model.pair import NodeSpec

    ref = torch.randn(1, 4, 6, 8)
    moved, how = _part_of_reference(ref[:, 2:3, :, :].reshape(6, 8), ref, (1, 6))
    assert torch.equal(moved, ref) and "2:3 of 4 along the reference's axis 1" in how
    wrong, _ = _part_of_reference(ref[:, 2:3].reshape(6, 8) * 1.01, ref, (1, 6))
    spec = NodeSpec("layers.0.attn.q_rot", "", layer=0, kind="q_rot")
    tolerances = Tolerances(atol=1e-6, rtol=0.0)
    assert compare_node(spec, 0, moved, ref, tolerances).status == OK
    assert compare_node(spec, 0, wrong, ref, tolerances).status == MISMATCH
    assert _part_of_reference(torch.randn(6, 8), ref, (1, 6)) is None  # no part of the reference's
    normed = torch.randn(1, 24, 4, 16)  # (batch, seq, heads, head_dim): a q_norm's output, one rank's two heads
    assert "2:4 of 4 along the reference's axis 2" in _part_of_reference(normed[:, :, 2:4], normed, (1, 24))[1]
    # a decode step's tokens are no part: of a projection (batch, seq, features), of a router's (tokens, experts)
    projection, router = torch.randn(2, 24, 96), torch.randn(48, 8)
    assert _part_of_reference(projection[:, 0], projection, (2, 24)) is None
    assert _part_of_reference(router[[0, 24]], router, (2, 24)) is None
    assert _part_of_reference(router[22:24], router, (2, 24)) is None
    # an expert's product on the tokens routed to it is no part of its features: its rows are placed on them
    expert = NodeSpec("model.layers.0.mlp.experts.3", "param:experts.3.w2", layer=0, kind="expert", match_layout=True)
    routed = torch.zeros(24, 8)
    routed[2:4] = torch.randn(2, 8)
    assert in_reference_layout(expert, routed[2:4], routed)[1] == ""
    tokens = torch.randn(2, 5, 3)  # (batch, seq, features)
    seq_first = tokens.transpose(0, 1).reshape(10, 3)
    assert torch.equal(_sequence_first(seq_first, torch.zeros(2, 5, dtype=torch.bool)), tokens.reshape(10, 3))
    assert _sequence_first(seq_first, torch.zeros(1, 10, dtype=torch.bool)) is None
