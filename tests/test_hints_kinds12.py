"""Hints the twelfth held-back set prompted, each read with the fault on ours and on the reference (the user
models that first showed them, ``tests/test_heldout12_faults.py``, run the fault on ours only): a gated
MLP's activation applied otherwise, a factor folded into the RoPE tables that misses the pass-through dims,
an attention sink's logit scaled like a score, the key padding mask moved by a position, YaRN read as
linear scaling or with its ramp reversed, a per-layer coefficient left in the scores, and the loader
conventions behind the set's correct models (gate/up de-interleaved where the family interleaves them,
experts fused input-major, a bias permuted with its rows, a table row zeroed)."""

from __future__ import annotations

import math

import pytest
import torch

from parity.build.coverage import ROWS, STRIDED, loader_coverage
from parity.compare.results import compare_node
from parity.compare.tolerances import Tolerances
from parity.diagnose.elementwise import glu_form
from parity.diagnose.evidence import Evidence
from parity.diagnose.masks import mask_shifted
from parity.diagnose.scales import channel_ratio, softmax_sink, softmax_temperature
from parity.model.derive import derive_facts
from parity.model.pair import NodeSpec
from parity.record.trace import Trace

SIDES = ("ours", "the reference")
STEM = "model.layers.1.self_attn"
NEG = torch.finfo(torch.float32).min


def _facts(**kw):
    from transformers import LlamaConfig

    config = dict(vocab_size=64, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=32)
    return derive_facts(LlamaConfig(**{**config, **kw}))


def _evidence(name, faulty, correct, side, ours_trace=None, ref_trace=None, mask=None, facts=None, positions=None):
    """The evidence at ``name`` with the faulty tensor on ``side`` and the correct one on the other."""
    ours, ref = (faulty, correct) if side == "ours" else (correct, faulty)
    facts = facts or _facts()
    layer, kind = facts.locate(name)
    result = compare_node(NodeSpec(name, name, layer=layer, kind=kind), 0, ours, ref, Tolerances())
    ref_trace = ref_trace if ref_trace is not None else Trace(tensors={name: ref})
    ours_trace = ours_trace if ours_trace is not None else Trace(tensors={name: ours})
    return Evidence(result, ours, ref, ours_trace, ref_trace, facts, positions, mask)


@pytest.mark.parametrize("side", SIDES)
def test_a_gated_mlp_with_the_activation_of_the_product(side):
    """GLM-4's SwiGLU written ``silu(gate * up)`` for ``silu(gate) * up``: the down projection's input is
    read against the reference's fused gate_up output's halves. Once no hint at all."""
    g = torch.Generator().manual_seed(0)
    gate_up = torch.randn(1, 10, 64, generator=g)
    gate, up = gate_up.chunk(2, -1)
    correct, faulty = torch.nn.functional.silu(gate) * up, torch.nn.functional.silu(gate * up)
    w = torch.randn(16, 32, generator=g)
    name = "model.layers.1.mlp.down_proj"
    x_ours, x_ref = (faulty, correct) if side == "ours" else (correct, faulty)
    ref_trace = Trace(tensors={"model.layers.1.mlp.gate_up_proj": gate_up, name: x_ref @ w.T}, inputs={name: x_ref})
    ours_trace = Trace(tensors={name: x_ours @ w.T}, inputs={name: x_ours})
    e = _evidence(name, faulty @ w.T, correct @ w.T, side, ours_trace, ref_trace)
    hint = glu_form(e)
    assert hint is not None and hint.kind == "activation", hint
    product, reference = "silu(gate * up) (the activation of the product)", "silu(gate) * up"
    assert hint.evidence == (
        {"ours": product, "reference": reference} if side == "ours" else {"ours": reference, "reference": product}
    )


@pytest.mark.parametrize("side", SIDES)
def test_a_scale_folded_into_the_rope_tables_misses_the_pass_through_dims(side):
    """GLM-4 rotates half of each head: the softmax scale folded into q's cos/sin scales the rotated 8 dims
    only. Once "a per-channel weight difference (a norm weight ...)"."""
    facts = _facts(
        head_dim=16, rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
    )
    q = torch.randn(1, 4, 10, 16, generator=torch.Generator().manual_seed(1)) + 3.0  # no value near 0
    faulty = torch.cat([q[..., :8] * 0.25, q[..., 8:]], -1)
    hint = channel_ratio(_evidence(f"{STEM}.q_rot", faulty, q, side, facts=facts))
    assert hint is not None and hint.kind == "scale", hint
    factor = 0.25 if side == "ours" else 4.0
    assert abs(hint.evidence["factor"] / factor - 1) < 1e-6 and hint.evidence["rotary_dim"] == 8, hint
    assert "on the 8 rotated dims of each head and agrees on the other 8" in hint.text, hint


def _sink_probs(scores: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """GPT-OSS's probabilities: a softmax over the keys and one sink logit per head, the sink's column dropped."""
    b, h, q, _ = scores.shape
    causal = torch.ones(q, q, dtype=torch.bool).tril()
    logits = torch.cat([scores.masked_fill(~causal, NEG), sinks.view(1, h, 1, 1).expand(b, h, q, 1)], -1)
    return torch.softmax(logits.double(), -1)[..., :-1].float()


@pytest.mark.parametrize("side", SIDES)
def test_a_sink_logit_scaled_like_a_score(side):
    """The sink multiplied by 1/sqrt(head_dim) as if it were q.k: each side's sink read per head from the
    reference's scores; one is the other's times 0.25. Once "a normalisation applied on one side only"."""
    g = torch.Generator().manual_seed(2)
    scores, sinks = torch.randn(1, 4, 10, 10, generator=g), torch.randn(4, generator=g) + 2.0
    correct, faulty = _sink_probs(scores, sinks), _sink_probs(scores, sinks * 0.25)
    ref_scores = scores
    e = _evidence(
        f"{STEM}.probs", faulty, correct, side, ref_trace=Trace(tensors={f"{STEM}.scores": ref_scores}),
    )  # fmt: skip
    hint = softmax_sink(e)
    assert hint is not None and hint.kind == "softmax_sink", hint
    factor = 0.25 if side == "ours" else 4.0
    assert abs(hint.evidence["factor"] / factor - 1) < 1e-3, hint


@pytest.mark.parametrize("side", SIDES)
def test_the_key_padding_mask_moved_by_one(side):
    """A key padding vector padded on the left for a sink's extra column: the padded row masks the keys one
    position later, a real key masked and a padding key not. Once "the padding mask not applied"."""
    scores = torch.randn(2, 4, 10, 10, generator=torch.Generator().manual_seed(3))
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[0, :3] = 0
    causal = torch.ones(10, 10, dtype=torch.bool).tril()

    def probs(padding: torch.Tensor) -> torch.Tensor:
        allowed = causal[None, None] & ~padding[:, None, None, :]
        allowed = allowed | torch.eye(10, dtype=torch.bool)[None, None] & ~mask.bool()[:, None, :, None]
        return torch.softmax(scores.masked_fill(~allowed, NEG), -1)

    pad = mask == 0
    moved = torch.zeros_like(pad)
    moved[:, 1:] = pad[:, :-1]
    hint = mask_shifted(_evidence(f"{STEM}.probs", probs(moved), probs(pad), side, mask=mask))
    assert hint is not None and hint.kind == "padding", hint
    assert hint.evidence == {"side": side, "shift": 1, "rows": [0]}, hint


def _yarn_facts():
    from transformers import GptOssConfig

    return derive_facts(
        GptOssConfig(
            vocab_size=64, hidden_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4,
            head_dim=16, num_local_experts=4, num_experts_per_tok=2, layer_types=["full_attention"],
            rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0,
                             "original_max_position_embeddings": 1024, "beta_fast": 32.0, "beta_slow": 1.0,
                             "truncate": False},
        )
    )  # fmt: skip


@pytest.mark.parametrize("side", SIDES)
@pytest.mark.parametrize("variant", ["linear", "inverted"])
def test_yarn_read_as_linear_or_with_its_ramp_reversed(side, variant):
    """rope_type yarn treated as linear interpolation (every frequency / factor), or its ramp used the wrong
    way round: the rotation read back from q before and after RoPE names the variant. Once "RoPE
    frequencies, scaling or offset" and no hint."""
    from parity.diagnose.rope import rope_fit
    from parity.diagnose.rope_fit import _yarn_variants, rotate

    facts = _yarn_facts()
    rope = facts.layer(0).rope
    labels = dict(_yarn_variants(rope))
    label = next(k for k in labels if (variant == "linear") == k.startswith("linear"))
    other = type(rope)(**{**rope.__dict__, "inv_freq": labels[label]})
    q = torch.randn(1, 4, 12, 16, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    positions = torch.arange(12)[None]
    correct, faulty = rotate(q, rope, positions).float(), rotate(q, other, positions).float()
    name = "model.layers.0.self_attn.q_rot"
    ref_trace = Trace(tensors={"model.layers.0.self_attn.q_proj": q.transpose(1, 2).flatten(-2).float()})
    e = _evidence(name, faulty, correct, side, ref_trace=ref_trace, facts=facts, positions=positions)
    hint = rope_fit(e)
    assert hint is not None and hint.kind == "rope_scaling", hint
    assert f"{side} rotates like {label}" in hint.text, hint


@pytest.mark.parametrize("side", SIDES)
def test_a_per_layer_coefficient_left_in_the_scores(side):
    """Megatron's apply_query_key_layer_scaling ported halfway: q divided by the layer number, never
    multiplied back. In layer 1 the scores are the reference's times 1/2, named as 1 / (layer index + 1)."""
    g = torch.Generator().manual_seed(5)
    q, k = torch.randn(1, 4, 10, 16, generator=g), torch.randn(1, 4, 10, 16, generator=g)
    causal = torch.ones(10, 10, dtype=torch.bool).tril()
    scores = (q @ k.transpose(-1, -2)) * 0.25
    correct = torch.softmax(scores.masked_fill(~causal, NEG), -1)
    faulty = torch.softmax((scores * 0.5).masked_fill(~causal, NEG), -1)
    tensors = {f"{STEM}.q_rot": q, f"{STEM}.k_rot": k}
    ref_scores = scores if side == "ours" else scores * 0.5  # the reference's own scores, faulty on its side
    e = _evidence(
        f"{STEM}.probs",
        faulty,
        correct,
        side,
        Trace(tensors=dict(tensors)),
        Trace(tensors={**tensors, f"{STEM}.scores": ref_scores}),
    )
    hint = softmax_temperature(e)
    assert hint is not None and hint.kind == "attention_scale", hint
    expected = "1 / (layer index + 1) = 1/2" if side == "ours" else "layer index + 1 = 2"
    assert expected in hint.text, hint


# --- loader conventions behind the set's correct models ------------------------------------------------


def _experts(e: int = 4, h: int = 8, i: int = 6) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(6)
    return {
        "experts.gate_up_proj": torch.randn(e, h, 2 * i, generator=g),
        "experts.gate_up_proj_bias": torch.randn(e, 2 * i, generator=g),
    }


def test_gate_and_up_de_interleaved_are_the_checkpoints_parts_where_the_family_interleaves_them():
    """GPT-OSS's experts hold gate at [..., 0::2] and up at [..., 1::2]: a port keeping them apart holds every
    other slice of each tensor. Accepted where the family interleaves them (its facts say so); refused
    elsewhere, with that reading named (Mixtral's stacked [gate; up] read as pairs is a loader bug)."""
    sd = _experts()
    model = torch.nn.Module()
    model.wg = torch.nn.Parameter(sd["experts.gate_up_proj"][..., 0::2].clone())
    model.wu = torch.nn.Parameter(sd["experts.gate_up_proj"][..., 1::2].clone())
    model.bg = torch.nn.Parameter(sd["experts.gate_up_proj_bias"][..., 0::2].clone())
    model.bu = torch.nn.Parameter(sd["experts.gate_up_proj_bias"][..., 1::2].clone())
    accepted = loader_coverage(model, sd, copies_break_ties=False, interleaved=True)
    assert accepted.ok and not accepted.unused, accepted
    assert {s.how for n in ("wg", "wu", "bg", "bu") for s in accepted.sources[n]} == {STRIDED}
    assert accepted.sources["wu"][0].part == (2, 1, 2)
    refused = loader_coverage(model, sd, copies_break_ties=False)
    assert "experts.gate_up_proj" in refused.unused
    assert any("read as interleaved pairs" in u for u in refused.unwritten), refused.unwritten
    model.bu = torch.nn.Parameter(sd["experts.gate_up_proj_bias"][..., 0::2].clone())  # one slice twice
    twice = loader_coverage(model, sd, copies_break_ties=False, interleaved=True)
    assert not twice.ok


def test_experts_fused_and_kept_input_major_are_rows_of_both_checkpoint_tensors():
    """DBRX's w1 and v1 ``(E * I, H)`` held as one ``(E, H, 2I)`` (each expert's w1 and v1 rows, transposed):
    rows of both keys with its last two axes exchanged. Once refused."""
    e, i, h = 4, 3, 8
    g = torch.Generator().manual_seed(7)
    sd = {"w1": torch.randn(e * i, h, generator=g), "v1": torch.randn(e * i, h, generator=g)}
    model = torch.nn.Module()
    model.w13 = torch.nn.Parameter(
        torch.cat((sd["w1"].view(e, i, h), sd["v1"].view(e, i, h)), 1).transpose(1, 2).clone()
    )
    cov = loader_coverage(model, sd, copies_break_ties=False)
    assert cov.ok and not cov.unused, cov
    assert {s.how for s in cov.sources["w13"]} == {ROWS} and cov.sources["w13"][0].permute == (0, 2, 1)


def test_a_bias_permuted_with_its_rows_follows_its_weight():
    """GLM-4's q rows and bias permuted per head at load (interleaved pairs to halves): the weight's rows
    reordered, and the bias the same way. Once a crash (a 1-D tensor's last two axes exchanged) and then a
    refusal."""
    g = torch.Generator().manual_seed(8)
    sd = {"q.weight": torch.randn(8, 4, generator=g), "q.bias": torch.randn(8, generator=g)}
    perm = torch.tensor([0, 2, 1, 3, 4, 6, 5, 7])
    model = torch.nn.Module()
    model.wq = torch.nn.Parameter(sd["q.weight"][perm].t().clone())
    model.bq = torch.nn.Parameter(sd["q.bias"][perm].clone())
    cov = loader_coverage(model, sd, copies_break_ties=False)
    assert cov.ok and not cov.unused, cov


def test_a_table_row_zeroed_at_load_is_a_named_gap():
    """An embedding row zeroed at load (a padding_idx row where that id is real text): a gap naming the key
    and the row, not a refusal in every convention."""
    g = torch.Generator().manual_seed(9)
    sd = {"embed.weight": torch.randn(16, 4, generator=g)}
    model = torch.nn.Module()
    table = sd["embed.weight"].clone()
    table[5] = 0
    model.emb = torch.nn.Parameter(table)
    cov = loader_coverage(model, sd, copies_break_ties=False)
    assert not cov.unused and not cov.ok
    assert cov.gaps == [
        "embed.weight: copied into emb with row(s) 5 zeroed where the checkpoint's are not (a padding_idx row "
        "zeroed at load, while that token id is real text)"
    ]


def test_the_sink_after_the_softmax_is_judged_with_the_references_row_sums():
    """A softmax without the sink whose output is rescaled by the sink's share after (as kernels with sinks
    do) is GPT-OSS's attention: its probabilities are the reference's rows each divided by their sum, judged
    so; the same probabilities with nothing rescaled after are not (a sink dropped)."""
    from parity.compare.results import rescaled_by_sink

    g = torch.Generator().manual_seed(10)
    scores, sinks = torch.randn(1, 4, 10, 10, generator=g), torch.randn(4, generator=g)
    ref = _sink_probs(scores, sinks)
    ours = ref / ref.sum(-1, keepdim=True)
    name = f"{STEM}.probs"
    result = compare_node(NodeSpec(name, name, layer=1, kind="probs"), 0, ours, ref, Tolerances())
    judged, mass = rescaled_by_sink(result, ours, ref, None)
    assert result.status == "mismatch" and judged is not None and judged.status == "ok", judged
    v = torch.randn(1, 4, 10, 16, generator=g)
    ctx_ours, ctx_ref = (ours @ v).transpose(1, 2).flatten(-2), (ref @ v).transpose(1, 2).flatten(-2)
    spec = NodeSpec(f"{STEM}.context", f"{STEM}.context", layer=1, kind="context")
    context = compare_node(spec, 1, ctx_ours, ctx_ref, Tolerances())
    assert rescaled_by_sink(context, ctx_ours, ctx_ref, mass)[0] is not None
    other = compare_node(spec, 1, ctx_ours * 1.01, ctx_ref, Tolerances())
    assert rescaled_by_sink(other, ctx_ours * 1.01, ctx_ref, mass)[0] is None
    assert math.isclose(float(mass.max()), float(ref.sum(-1).max()), rel_tol=1e-6)


@pytest.mark.parametrize("side", SIDES)
def test_every_token_of_a_row_rotated_at_its_batch_index(side):
    """A seq-first RoPE cache sliced with the batch axis (``cache[:x.shape[0]]`` on batch-first tensors): every
    token of row b turns by position b. Read back per row as one position; a batch of one (position 0
    everywhere) stays "no rotation", the simpler reading."""
    from parity.diagnose.rope import rope_fit
    from parity.diagnose.rope_fit import rotate

    facts = _facts(num_hidden_layers=1)
    rope = facts.layer(0).rope
    q = torch.randn(2, 4, 12, 16, generator=torch.Generator().manual_seed(11), dtype=torch.float64)
    positions = torch.arange(12)[None].expand(2, 12)
    correct = rotate(q, rope, positions).float()
    faulty = rotate(q, rope, torch.arange(2)[:, None].expand(2, 12)).float()
    ref_trace = Trace(tensors={"model.layers.0.self_attn.q_proj": q.transpose(1, 2).flatten(-2).float()})
    name = "model.layers.0.self_attn.q_rot"
    hint = rope_fit(_evidence(name, faulty, correct, side, ref_trace=ref_trace, facts=facts, positions=positions))
    assert hint is not None and hint.kind == "position_offset", hint
    assert hint.evidence["constant_positions"] == [0, 1] and hint.evidence["side"] == side, hint
    assert f"likely positions read from another axis: {side} rotates every token of batch row b" in hint.text


@pytest.mark.parametrize("side", SIDES)
def test_mla_parts_concatenated_in_the_other_order_names_the_side_that_did(side):
    """DeepSeek builds each head as cat(nope, rope) (the rotated dims last, unlike partial-rotary families):
    the side whose q is cat(rope, nope) is named, wherever the fault sits (the family's order, a fact of
    the architecture, tells which side differs from it)."""
    from transformers import DeepseekV3Config

    from parity.diagnose.wiring import last_dim_permutation

    facts = derive_facts(
        DeepseekV3Config(
            vocab_size=64, hidden_size=64, num_hidden_layers=1, num_attention_heads=4, q_lora_rank=32,
            kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
        )
    )  # fmt: skip
    g = torch.Generator().manual_seed(12)
    nope, rope = torch.randn(1, 4, 10, 16, generator=g), torch.randn(1, 4, 10, 8, generator=g)
    correct, faulty = torch.cat([nope, rope], -1), torch.cat([rope, nope], -1)
    hint = last_dim_permutation(_evidence("model.layers.0.self_attn.q_rot", faulty, correct, side, facts=facts))
    assert hint is not None and hint.kind == "qkv_layout", hint
    assert hint.evidence["side"] == side, hint
    assert f"q's parts concatenated in the other order in {side}" in hint.text
    assert "cat(rope, nope) where" in hint.text, hint


def _differential(lam: float, scale: float, width: int | None = None):
    """A DiffLlama block's traced probabilities and values (4 query heads, 2 KV heads of 16), and its output
    projection's input for ``lam`` and ``scale`` (the norm over ``width`` features at a time, or the pair's)."""
    g = torch.Generator().manual_seed(13)
    b, h, kv, s, d = 1, 4, 2, 10, 16
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    probs = torch.softmax(torch.randn(b, h, s, s, generator=g).masked_fill(~causal, NEG), -1)
    v = torch.randn(b, s, kv * d, generator=g)
    heads = v.view(b, s, kv, d).transpose(1, 2)
    outs = [(probs @ p.repeat(1, 2, 1, 1).repeat_interleave(h // kv, 1)).transpose(1, 2) for p in heads.chunk(2, 1)]
    o1, o2 = torch.cat(outs, -1).chunk(2, 2)
    x = o1 - lam * o2
    if width is not None:
        x = x.unflatten(-1, (-1, width))
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)
    return probs, v, (scale * x).reshape(b, s, -1)


@pytest.mark.parametrize("side", SIDES)
def test_differential_attentions_lambda_read_back_from_the_output_projections_input(side):
    """DiffLlama's lambda_init left out of lambda on one side: lambda is read back from each side's o_proj
    input (the context agrees) and the side that left it out is named. Once no hint at all."""
    from parity.diagnose.differential import after_context, lambda_init

    facts = _facts(num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5)
    init = lambda_init(1)
    probs, v, right = _differential(-1.5, 1 - init)
    _, _, wrong = _differential(-1.5 - init, 1 - init)
    name = f"{STEM}.o_proj"
    x_ours, x_ref = (wrong, right) if side == "ours" else (right, wrong)
    w = torch.randn(64, 64, generator=torch.Generator().manual_seed(14))
    ref_trace = Trace(tensors={f"{STEM}.probs": probs, f"{STEM}.v_proj": v, name: x_ref @ w.T}, inputs={name: x_ref})
    ours_trace = Trace(tensors={name: x_ours @ w.T}, inputs={name: x_ours})
    ok = compare_node(NodeSpec(f"{STEM}.context", f"{STEM}.context", layer=1, kind="context"), 0, v, v, Tolerances())
    ours_trace.results[f"{STEM}.context"] = ok
    hint = after_context(_evidence(name, wrong @ w.T, right @ w.T, side, ours_trace, ref_trace, facts=facts))
    assert hint is not None and hint.kind == "differential_attention", hint
    assert f"{side} leaves lambda_init ({init:.4g}) out of lambda" in hint.text, hint


def test_differential_attention_normed_over_each_head_dim_is_named():
    """The sub-layer norm taken over each head_dim (16) where DiffLlama norms each pair's 32 features."""
    from parity.diagnose.differential import after_context

    facts = _facts(num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5)
    probs, v, right = _differential(-1.5, 0.8)
    _, _, wrong = _differential(-1.5, 0.8, width=16)
    name = f"{STEM}.o_proj"
    ref_trace = Trace(tensors={f"{STEM}.probs": probs, f"{STEM}.v_proj": v, name: right}, inputs={name: right})
    ours_trace = Trace(tensors={name: wrong}, inputs={name: wrong})
    ours_trace.results[f"{STEM}.context"] = compare_node(
        NodeSpec(f"{STEM}.context", f"{STEM}.context", layer=1, kind="context"), 0, v, v, Tolerances()
    )
    hint = after_context(_evidence(name, wrong, right, "ours", ours_trace, ref_trace, facts=facts))
    assert hint is not None and hint.kind == "differential_attention", hint
    assert "the norm taken over each head_dim (16) alone, not over the pair's 32 features" in hint.text, hint


@pytest.mark.parametrize("side", SIDES)
def test_rows_permuted_before_a_per_head_norm_are_read_at_its_input(side):
    """q rows permuted at load (interleaved pairs) where the reference keeps them, its per-head norm's weight
    in the reference's order: the norm's output is no permutation of the reference's, its input is."""
    from parity.diagnose.wiring import last_dim_permutation

    g = torch.Generator().manual_seed(15)
    x = torch.randn(1, 10, 4, 16, generator=g)
    w = 1 + 0.5 * torch.randn(16, generator=g)
    perm = torch.cat([torch.arange(0, 16, 2), torch.arange(1, 16, 2)])

    def norm(t):
        return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + 1e-6) * w

    name = f"{STEM}.q_norm"
    x_ours, x_ref = (x[..., perm], x) if side == "ours" else (x, x[..., perm])
    ours_trace = Trace(tensors={name: norm(x_ours)}, inputs={name: x_ours})
    ref_trace = Trace(tensors={name: norm(x_ref)}, inputs={name: x_ref})
    faulty, correct = norm(x[..., perm]), norm(x)
    hint = last_dim_permutation(_evidence(name, faulty, correct, side, ours_trace, ref_trace))
    assert hint is not None and hint.kind == "weight_permutation" and hint.evidence["at"] == "input", hint
    assert "likely a permutation of weight rows before q_norm" in hint.text, hint
