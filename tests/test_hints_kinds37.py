"""Hints and readings the thirty-seventh held-back set prompted (``tests/test_heldout37_faults.py`` runs the user
models, faults on ours): two parts concatenated in the other order and a branch added to the residual stream, each
read with the fault on ours and on the reference; the one-change search over a Mamba-like block of known code (a
helper module's call lines told apart, a mean over another axis, a broadcast product's factor left out, a bias moved
after its activation per head, interleaved rows read as blocks, a causal window one step late, an additive mask
remade, another eps field of the config); a latent attention's rope-tail order settled by the values."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from parity.compare.results import compare_node
from parity.compare.tolerances import Tolerances
from parity.diagnose import one_change
from parity.diagnose.evidence import Evidence
from parity.diagnose.residual import input_source
from parity.diagnose.wiring import last_dim_permutation
from parity.model.derive import derive_facts
from parity.model.pair import NodeSpec
from parity.record.trace import Trace
from parity.user.align import Layout

SIDES = ("ours", "the reference")
SEQ, HIDDEN = 10, 32


def _facts():
    from transformers import LlamaConfig

    return derive_facts(
        LlamaConfig(
            vocab_size=64, hidden_size=HIDDEN, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2
        )
    )


def _evidence(name, ours, ref, ours_trace=None, ref_trace=None) -> Evidence:
    facts = _facts()
    layer, kind = facts.locate(name)
    result = compare_node(NodeSpec(name, name, layer=layer, kind=kind), 0, ours, ref, Tolerances())
    ours_trace = ours_trace if ours_trace is not None else Trace()
    ref_trace = ref_trace if ref_trace is not None else Trace()
    ours_trace.tensors[name], ref_trace.tensors[name] = ours, ref
    return Evidence(result, ours, ref, ours_trace, ref_trace, facts)


def _randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("side", SIDES)
def test_two_parts_concatenated_in_the_other_order_are_named(side):
    """Zamba's ``cat(hidden, embeddings)`` built as ``cat(embeddings, hidden)``: at a node, the values are the other
    side's with its two blocks of features in the other order, whichever side built it so (a rotation of the
    features, which a weight permutation in general is not)."""
    a, b = _randn(1, SEQ, 24, seed=1), _randn(1, SEQ, 40, seed=2)
    right, wrong = torch.cat([a, b], -1), torch.cat([b, a], -1)
    ours, ref = (wrong, right) if side == "ours" else (right, wrong)
    hint = last_dim_permutation(_evidence("model.layers.0.self_attn.q_proj", ours, ref))
    assert hint is not None and hint.kind == "concat_order", hint
    first = 40 if side == "ours" else 24  # ours holds the reference's last part first
    assert f"holds the reference's last {first} features first, then its first {64 - first}" in hint.text
    # any other permutation stays a weight permutation
    shuffled = right[..., torch.randperm(64, generator=torch.Generator().manual_seed(3))]
    hint = last_dim_permutation(_evidence("model.layers.0.self_attn.q_proj", shuffled, right))
    assert hint is not None and hint.kind == "weight_permutation", hint


@pytest.mark.parametrize("side", SIDES)
def test_a_norms_input_concatenated_in_the_other_order_is_named_at_its_input(side):
    """A.X-K2's q_gate_proj reading ``cat(q_compressed, q_resid)`` for ``cat(q_resid, q_compressed)``: the node's
    output is no permutation of the other's (its weight is applied after), its input is the rotation."""
    name = "model.layers.0.input_layernorm"
    x = _randn(1, SEQ, HIDDEN, seed=4)
    swapped = torch.cat([x[..., 12:], x[..., :12]], -1)
    w = 1 + _randn(HIDDEN, seed=5)
    norm = lambda t: t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + 1e-6) * w
    ours_in, ref_in = (swapped, x) if side == "ours" else (x, swapped)
    ours_trace, ref_trace = Trace(), Trace()
    ours_trace.inputs[name], ref_trace.inputs[name] = ours_in, ref_in
    hint = last_dim_permutation(_evidence(name, norm(ours_in), norm(ref_in), ours_trace, ref_trace))
    assert hint is not None and hint.kind == "concat_order", hint
    assert "input_layernorm's input holds the reference's last" in hint.text


@pytest.mark.parametrize("side", SIDES)
def test_a_branch_added_to_the_residual_stream_as_well_is_named(side):
    """Zamba's hybrid layer feeds its transformer branch (``linear``) into the Mamba layer's input only; a port adding
    it to the residual stream too holds the stream plus that branch at the next layer's norm (either side)."""
    name = "model.layers.2.input_layernorm"
    stream, branch = _randn(1, SEQ, HIDDEN, seed=6), _randn(1, SEQ, HIDDEN, seed=7)
    ours_in, ref_in = (stream + branch, stream) if side == "ours" else (stream, stream + branch)
    ref_trace, ours_trace = Trace(), Trace()
    ref_trace.tensors["model.layers.1.mlp.down_proj"] = branch  # the branch, a node of the layer before
    ours_trace.tensors["model.layers.1.mlp.down_proj"] = branch  # which ours computes too
    ref_trace.tensors["model.layers.1.post_attention_layernorm"] = _randn(1, SEQ, HIDDEN, seed=8)
    ours_trace.inputs[name], ref_trace.inputs[name] = ours_in, ref_in
    w = 1 + _randn(HIDDEN, seed=9)
    norm = lambda t: t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + 1e-6) * w
    hint = input_source(_evidence(name, norm(ours_in), norm(ref_in), ours_trace, ref_trace))
    assert hint is not None and hint.kind == "residual", hint
    whose, other = ("ours'", "the reference's") if side == "ours" else ("the reference's", "ours'")
    assert f"{whose} input to input_layernorm is {other} plus model.layers.1.mlp.down_proj" in hint.text
    if side == "the reference":  # a branch ours never computed is a module missing in ours: the never-read hints'
        del ours_trace.tensors["model.layers.1.mlp.down_proj"]
        assert input_source(_evidence(name, norm(ours_in), norm(ref_in), ours_trace, ref_trace)) is None


class Norm(torch.nn.Module):
    """A weightless RMS norm over the last axis, one module per input (FalconMamba's b_layernorm and c_layernorm)."""

    eps = 1e-2

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


class Mixer(torch.nn.Module):
    """A selective-scan-like block of known source lines (Mamba's shapes: ``(batch, channels, seq)``), each line a
    site the search may change; ``fault`` names the change its forward makes (the target's, not the reference's)."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.in_proj = torch.nn.Parameter(torch.randn(16, 8, generator=g) / 3)
        self.conv = torch.nn.Parameter(torch.randn(8, 1, 3, generator=g))
        self.bias = torch.nn.Parameter(torch.randn(2, 4, generator=g))
        self.x_proj = torch.nn.Parameter(torch.randn(16, 8, generator=g) / 3)
        self.u_norm, self.b_norm, self.c_norm = Norm(), Norm(), Norm()
        self.fault = ""

    def forward(self, x, mask):
        b, seq, _ = x.shape
        h = F.linear(x, self.in_proj).transpose(1, 2)
        if self.fault == "halves":
            u, z = h.chunk(2, dim=1)
        else:
            u, z = (t.squeeze(2) for t in h.view(b, -1, 2, seq).chunk(2, dim=2))
        conv = F.conv1d(u, self.conv, padding=2, groups=8)
        u = F.silu(conv[..., 1 : seq + 1] if self.fault == "late" else conv[..., :seq])
        if self.fault == "norm after":  # the norm moved across the product: over x_proj's 16 output features
            B, C = self.u_norm(F.linear(u.transpose(1, 2), self.x_proj)).chunk(2, dim=-1)
        else:
            B, C = F.linear(self.u_norm(u.transpose(1, 2)), self.x_proj).chunk(2, dim=-1)
        if self.fault == "axis":
            B, C = (t.transpose(1, 2) for t in (self.b_norm(B.transpose(1, 2)), self.c_norm(C.transpose(1, 2))))
        else:
            B = self.b_norm(B)
            C = self.c_norm(C)
        dt = []
        for head in range(2):
            d = u[:, head * 4 : (head + 1) * 4]
            if self.fault == "bias after":
                d = F.softplus(d) + self.bias[head][..., None]
            else:
                d = d + self.bias[head][..., None]
                d = F.softplus(d)
            dt.append(d)
        dt = torch.cat(dt, 1)
        dB = B[:, None] if self.fault == "factor" else dt[:, :, :, None] * B[:, None]
        scores = B @ C.transpose(1, 2)
        scores = scores + mask
        y = (dB.sum(-1) * z).transpose(1, 2) + scores.softmax(-1) @ C
        return y


class Toy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.mixer = Mixer()
        self.head = torch.nn.Linear(8, 4)

    def forward(self, x, mask):
        return self.head(self.mixer(x, mask))


def _search_for(fault: str, mask_fault: str = ""):
    """The search's first change on the toy's code, after which its mixer agrees with the mixer run with ``fault`` (or
    with ``mask_fault``: its mask remade as a port builds it)."""
    model = Toy().eval()
    x = torch.randn(2, 6, 8, generator=torch.Generator().manual_seed(1))
    low = torch.finfo(torch.float32).min
    causal = torch.zeros(6, 6).masked_fill(torch.ones(6, 6, dtype=torch.bool).triu(1), low)
    mask = causal.expand(2, 6, 6).clone()
    mask[1, :, :2] = low  # row 1 left-padded by two
    target_mask = {
        "diagonal": mask.masked_fill(torch.eye(6, dtype=torch.bool), low),
        "padding": causal.expand(2, 6, 6),
    }.get(mask_fault, mask)
    with torch.no_grad():
        model.mixer.fault = fault
        target = model.mixer(x, target_mask)
        model.mixer.fault = ""
        recorded = model.mixer(x, mask)
    close = lambda value: value.shape == target.shape and bool(torch.allclose(value, target, atol=1e-5))
    same = lambda value: bool(torch.allclose(value, recorded, atol=1e-5))
    found = one_change.search(
        model, "mixer", [one_change.Target("mixer", "mixer", close, same)], lambda: model(x, mask)
    )
    assert found is not None, fault or mask_fault
    return found[0][0]


@pytest.mark.parametrize(
    ("fault", "mask_fault", "words"),
    [
        ("halves", "", "axis 1's rows read as 2 contiguous blocks in place of interleaved"),
        ("late", "", "axis 2's slice [:6] taken one step later ([1:7] of 8"),
        ("axis", "", "the mean over axis 1 (of 6) in place of the last (of 8)"),
        ("norm after", "", "mixer.u_norm's normalisation applied to the output of the product reading it"),
        ("bias after", "", "mixer.bias added after the softplus instead of to its input"),
        ("factor", "", "left out of this broadcast product (the one of shape (2, 1, 6, 8) alone)"),
        ("", "diagonal", "the mask's diagonal masked as well (a query kept from its own key"),
        ("", "padding", "the mask's padding left out (the causal part alone"),
    ],
)
def test_the_search_names_a_change_of_a_mamba_like_blocks_code(fault, mask_fault, words):
    change = _search_for(fault, mask_fault)
    assert words in change.words, change.words


def test_a_helper_modules_calls_are_told_apart_by_the_lines_calling_the_module():
    """The norm's mean sits on one line of ``Norm.forward`` for its three instances: the change is tried per line
    calling the module (B's norm, C's norm) and, here, on B's and C's together (not u's)."""
    change = _search_for("axis")
    lines = [s.caller for s in (change.site, change.also) if s is not None]
    assert len(lines) == 2 and all(line is not None and line[0].endswith("test_hints_kinds37.py") for line in lines)


def test_another_eps_field_of_the_config_read_for_one_is_a_change():
    """FalconMamba's B/C/dt norms built with ``layer_norm_epsilon`` where the config's ``mixer_rms_eps`` is meant."""
    from transformers import FalconMambaConfig

    model = torch.nn.Module()
    model.config = FalconMambaConfig(mixer_rms_eps=1e-2, layer_norm_epsilon=1e-5)
    defaults = one_change._config_defaults(model)
    site = one_change.Site("add", "model.py", 1, None, "scalar")
    x = torch.rand(3, 4)
    words = [c.words for c in one_change._default_read(site, torch.add, (x, 1e-2), defaults)]
    assert "config.layer_norm_epsilon (1e-05) used in place of config.mixer_rms_eps (0.01)" in words


def test_a_latent_rope_tails_order_is_settled_by_the_values():
    """A latent attention's key rope tail: the weights say pair order (the checkpoint's interleaved rows), a port
    rotating as Transformers does keeps the reference's halves. The guess offers the reference's order as its
    alternative, which, once it agrees, holds for the node's later calls and its inverse."""
    dims = tuple(range(4)) + (4, 6, 8, 10, 5, 7, 9, 11)
    layout = Layout("k_rot", 1, 12, dims=dims, guessed=True)
    raw = _randn(1, 1, 5, 12, seed=10)
    seen = layout(raw)
    assert torch.equal(seen, raw[..., list(dims)])
    other = layout.alternative(seen)
    assert other is not None and torch.equal(other, raw)
    layout.take_alternative()
    assert torch.equal(layout(raw), raw) and layout.alternative(raw) is None
    assert torch.equal(layout.inverse(raw, raw), raw)
    assert Layout("k_rot", 1, 12, dims=dims).alternative(seen) is None  # a layout the weights settle: no guess
