"""The one-change search (``parity.diagnose.one_change``) on a block of known code, and the facts a reference's
config or modules give that a user's model must be read with (tagged floats, per-layer query heads)."""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F

from parity.diagnose import one_change


class Block(torch.nn.Module):
    """A gated MLP of known source lines: each line below is a site the search may change."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.up = torch.nn.Parameter(torch.randn(16, 8, generator=g))
        self.down = torch.nn.Parameter(torch.randn(8, 16, generator=g))
        self.bias = torch.nn.Parameter(torch.randn(16, generator=g))

    def forward(self, x):
        h = F.linear(x, self.up) + self.bias
        h = F.silu(h)
        return F.linear(h * 0.5, self.down)


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.block = Block()
        self.head = torch.nn.Linear(8, 4)

    def forward(self, x):
        return self.head(self.block(x))


def _line(text: str) -> int:
    source, first = inspect.getsourcelines(Block.forward)
    return first + next(i for i, line in enumerate(source) if text in line)


def _search(model: Model, x: torch.Tensor, target: torch.Tensor):
    with torch.no_grad():
        recorded = model.block(x)
    close = lambda value, t=target: value.shape == t.shape and bool(torch.allclose(value, t, atol=1e-6))
    same = lambda value: bool(torch.allclose(value, recorded, atol=1e-6))
    return one_change.search(model, "block", [one_change.Target("block", "block", close, same)], lambda: model(x))


def test_an_activation_left_out_is_named_with_its_source_line():
    model, x = Model().eval(), torch.randn(3, 8, generator=torch.Generator().manual_seed(1))
    b = model.block
    with torch.no_grad():
        target = F.linear((F.linear(x, b.up) + b.bias) * 0.5, b.down)  # the SiLU left out
    found = _search(model, x, target)
    assert found is not None
    change, at = found[0]
    assert change.words == "silu left out" and at == "block"
    assert f"test_one_change.py:{_line('F.silu(h)')}" in change.where
    hint = one_change.named(found, "block")
    assert hint.kind == "one_change" and "likely silu left out at test_one_change.py" in hint.text


def test_a_parameter_or_a_scalar_left_out_is_named_and_a_weight_changed_is_not():
    model, x = Model().eval(), torch.randn(3, 8, generator=torch.Generator().manual_seed(1))
    b = model.block
    with torch.no_grad():
        no_bias = F.linear(F.silu(F.linear(x, b.up)) * 0.5, b.down)
        no_half = F.linear(F.silu(F.linear(x, b.up) + b.bias), b.down)
        other_weight = F.linear(F.silu(F.linear(x, b.up * 1.01) + b.bias) * 0.5, b.down)
    # the SiLU reading the projection before its bias is the same change said another way: named after the first
    assert [c.words for c, _ in _search(model, x, no_bias) or []] == [
        "block.bias (offset) left out",
        f"silu reading the output of test_one_change.py:{_line('+ self.bias')} (`h = F.linear(x, self.up) + "
        "self.bias`) in place of its own input",
    ]
    # reading silu's output in place of h * 0.5 is the same change said another way: named after the first
    assert next(c.words for c, _ in _search(model, x, no_half) or []) == "the factor 0.5 left out"
    assert _search(model, x, other_weight) is None  # no one change of an operation explains a weight's difference


def test_a_projection_reading_another_variable_is_named_with_the_line_it_read():
    """A mix-up: the down projection reading the pre-activation sum instead of its own input (neither the
    SiLU nor the factor left out alone explains it)."""
    model, x = Model().eval(), torch.randn(3, 8, generator=torch.Generator().manual_seed(1))
    b = model.block
    with torch.no_grad():
        target = F.linear(F.linear(x, b.up) + b.bias, b.down)
    found = _search(model, x, target)
    assert found is not None
    words = [c.words for c, _ in found]
    assert words == [f"linear reading the output of test_one_change.py:{_line('+ self.bias')} (`h = F.linear(x, "
                     "self.up) + self.bias`) in place of its own input"], words  # fmt: skip


class Gated(torch.nn.Module):
    """A fused gate/up projection, a sign, a scale and a causal running sum: the sites of the search's
    structural changes (parts of a split swapped, a factor applied twice, a minus sign, a mask's diagonal)."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(2)
        self.gate_up = torch.nn.Parameter(torch.randn(32, 8, generator=g))
        self.down = torch.nn.Parameter(torch.randn(8, 16, generator=g))

    def forward(self, x):
        gate, up = F.linear(x, self.gate_up).chunk(2, dim=-1)
        h = -F.silu(gate) * up * 1.5
        causal = torch.tril(torch.ones(x.shape[0], x.shape[0]), diagonal=0)
        return F.linear(causal @ h, self.down)


def _gated(x: torch.Tensor, swap=False, twice=False, sign=-1.0, diagonal=0) -> torch.Tensor:
    """:class:`Gated`'s output with one thing written otherwise (the user's side of a fault)."""
    b = Gated()
    gate, up = F.linear(x, b.gate_up).chunk(2, dim=-1)
    if swap:
        gate, up = up, gate
    h = sign * F.silu(gate) * up * (1.5 * 1.5 if twice else 1.5)
    return F.linear(torch.tril(torch.ones(x.shape[0], x.shape[0]), diagonal=diagonal) @ h, b.down)


def _changes_named(model: torch.nn.Module, x: torch.Tensor):
    """``words(target)``: the words of each change to ``model``'s block ``"0"`` after which its output on ``x`` is
    ``target`` (ours' output), none when nothing explains it."""
    with torch.no_grad():
        recorded = model(x)

    def words(target: torch.Tensor) -> list[str]:
        close = lambda value: value.shape == target.shape and bool(torch.allclose(value, target, atol=1e-5))
        same = lambda value: bool(torch.allclose(value, recorded, atol=1e-5))
        found = one_change.search(model, "0", [one_change.Target("0", "0", close, same)], lambda: model(x))
        return [c.words for c, _ in found or []]

    return words


def test_a_split_swapped_a_factor_twice_a_sign_and_a_mask_s_diagonal_are_each_named():
    model, x = torch.nn.Sequential(Gated()).eval(), torch.randn(6, 8, generator=torch.Generator().manual_seed(3))
    words = _changes_named(model, x)

    with torch.no_grad():
        assert words(_gated(x, swap=True)) == ["parts 0 and 1 of this chunk (of 2) swapped"]
        assert words(_gated(x, twice=True))[0] == "the factor 1.5 applied twice"
        assert words(_gated(x, sign=1.0)) == ["the minus sign left out"]
        assert words(_gated(x, diagonal=-1)) == ["tril with diagonal=-1 in place of 0"]
        assert words(_gated(x)) == []  # the same code: nothing to name (the search returns None)


class SwappedGated(Gated):
    """:class:`Gated` with its fused projection read as [up | gate]: the fault on the reference's side."""

    def forward(self, x):
        up, gate = F.linear(x, self.gate_up).chunk(2, dim=-1)
        h = -F.silu(gate) * up * 1.5
        return F.linear(torch.tril(torch.ones(x.shape[0], x.shape[0])) @ h, self.down)


def test_a_split_swapped_in_the_reference_is_named_the_same_way():
    model, x = torch.nn.Sequential(SwappedGated()).eval(), torch.randn(6, 8, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        recorded, target = model(x), _gated(x)
    close = lambda value: value.shape == target.shape and bool(torch.allclose(value, target, atol=1e-5))
    same = lambda value: bool(torch.allclose(value, recorded, atol=1e-5))
    found = one_change.search(model, "0", [one_change.Target("0", "0", close, same)], lambda: model(x))
    assert [c.words for c, _ in found or []] == ["parts 0 and 1 of this chunk (of 2) swapped"]


def test_a_config_float_tagged_by_transformers_is_read_back():
    from parity.build.reference import config_from_raw, decoded_floats

    raw = {"time_step_limit": [0.0, {"__float__": "Infinity"}], "x": {"__float__": "-Infinity"}, "y": [1]}
    assert decoded_floats(raw) == {"time_step_limit": [0.0, float("inf")], "x": float("-inf"), "y": [1]}
    config = config_from_raw(
        {"model_type": "nemotron_h", "time_step_limit": [0.0, {"__float__": "Infinity"}]}, "config.json"
    )
    assert tuple(config.time_step_limit) == (0.0, float("inf"))


def test_per_layer_query_heads_are_read_from_the_reference_s_attention_modules():
    """Laguna's ``num_attention_heads_per_layer``: each layer's q_rot has its own head count."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from parity.model.derive import derive_facts

    config = AutoConfig.for_model(
        "laguna", vocab_size=64, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        num_hidden_layers=2, num_attention_heads_per_layer=[4, 8], intermediate_size=32, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=8, shared_expert_intermediate_size=8,
        mlp_layer_types=["dense", "sparse"], layer_types=["full_attention", "sliding_attention"], sliding_window=4,
    )  # fmt: skip
    facts = derive_facts(config, AutoModelForCausalLM.from_config(config))
    assert [facts.heads_at(i) for i in range(2)] == [4, 8]
    assert facts.heads_at(None) == facts.num_heads == 4


class GatedNorm(torch.nn.Module):
    """An RMSNorm gated by silu(gate) before it normalises (Mamba2's ``norm_before_gate=False``)."""

    def __init__(self, width: int):
        super().__init__()
        self.weight = torch.nn.Parameter(1.0 + 0.3 * torch.randn(width, generator=torch.Generator().manual_seed(4)))

    def forward(self, x, gate=None):
        if gate is not None:
            x = x * F.silu(gate)
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))


class Mixer(torch.nn.Module):
    """Two projections of one input (a and b), a causal depthwise conv, and a gated norm."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(5)
        self.a = torch.nn.Linear(8, 8, bias=False)
        self.b = torch.nn.Linear(8, 8, bias=False)
        self.conv = torch.nn.Conv1d(8, 8, 3, groups=8, padding=2, bias=False)
        for p in self.parameters():
            p.data = torch.randn(p.shape, generator=g)
        self.norm = GatedNorm(8)

    def forward(self, x):  # (seq, 8)
        h = self.conv(self.a(x).T[None])[0, :, : x.shape[0]].T
        return self.norm(h, gate=self.b(x))


def _mixer(x: torch.Tensor, m: Mixer, swap=False, flip=False, after=False, offset=False) -> torch.Tensor:
    """:class:`Mixer`'s output with one thing written otherwise (the user's side of a fault)."""
    a, b = (m.b, m.a) if swap else (m.a, m.b)
    kernel = m.conv.weight.flip(-1) if flip else m.conv.weight
    h = F.conv1d(a(x).T[None], kernel, padding=2, groups=8)[0, :, : x.shape[0]].T
    w = 1 + m.norm.weight if offset else m.norm.weight
    rms = lambda v: v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + 1e-6)
    return w * rms(h) * F.silu(b(x)) if after else w * rms(h * F.silu(b(x)))


def test_weights_swapped_a_flipped_kernel_a_gate_moved_and_a_gain_offset_are_each_named():
    model, x = torch.nn.Sequential(Mixer()).eval(), torch.randn(6, 8, generator=torch.Generator().manual_seed(6))
    words = _changes_named(model, x)

    m = model[0]
    with torch.no_grad():
        assert words(_mixer(x, m)) == []  # the same computation written otherwise: nothing to name
        assert words(_mixer(x, m, swap=True)) == ["the weights of 0.a.weight and 0.b.weight swapped (two projections "
                                                  "of one input)"]  # fmt: skip
        assert words(_mixer(x, m, flip=True)) == ["the conv's kernel read in reverse (its taps flipped)"]
        assert words(_mixer(x, m, after=True)) == [
            "0.norm's gate applied after its normalisation (norm(x) * silu(gate))"
        ]
        assert words(_mixer(x, m, offset=True))[0] == (
            "1 + 0.norm.weight in place of 0.norm.weight (a gain read as an offset from one)"
        )


class Scaled(torch.nn.Module):
    """Scores scaled by 1 / sqrt(16), the width of q k; the config also holds a head_dim of 4 (a rope's)."""

    def forward(self, q, k):
        return torch.softmax(q @ k.T * 0.25, dim=-1)


def test_a_softmax_scale_taken_from_another_config_size_is_named_with_that_field():
    from types import SimpleNamespace

    model = torch.nn.Sequential(Scaled())
    model.config = SimpleNamespace(to_dict=lambda: {"head_dim": 4, "qk_dim": 16, "use_cache": True})
    g = torch.Generator().manual_seed(7)
    q, k = torch.randn(5, 16, generator=g), torch.randn(5, 16, generator=g)
    with torch.no_grad():
        recorded, target = model[0](q, k), torch.softmax(q @ k.T * 0.5, dim=-1)  # ours: 1 / sqrt(head_dim)
    close = lambda value: bool(torch.allclose(value, target, atol=1e-6))
    same = lambda value: bool(torch.allclose(value, recorded, atol=1e-6))
    found = one_change.search(model, "0", [one_change.Target("0", "0", close, same)], lambda: model[0](q, k))
    assert [c.words for c, _ in found or []] == ["the factor 0.25 taken as 1 / sqrt(head_dim = 4) = 0.5"]


def toy_gated_delta_rule(query, key, value, g, beta, initial_state=None, output_final_state=False, order="own"):
    """A Gated DeltaNet scan written for this test (Yang et al. 2024), ``(batch, seq, heads, dim)`` in and out,
    with the step order a port may get wrong: "own" (decay, read, write, output), "after" (the decay after the
    write), "read_first" (the prediction read before the decay)."""
    q = query.float() / query.shape[-1] ** 0.5
    state = torch.zeros(key.shape[0], key.shape[2], key.shape[3], value.shape[3])
    out = []
    for t in range(key.shape[1]):
        decay = g[:, t].exp()[:, :, None, None]
        before = state
        state = state if order == "after" else state * decay
        read = before if order == "read_first" else state
        delta = beta[:, t, :, None] * (value[:, t] - torch.einsum("bhkv,bhk->bhv", read, key[:, t]))
        state = state + torch.einsum("bhk,bhv->bhkv", key[:, t], delta)
        state = state * decay if order == "after" else state
        out.append(torch.einsum("bhkv,bhk->bhv", state, q[:, t]))
    return torch.stack(out, 1), state if output_final_state else None


class DeltaMixer(torch.nn.Module):
    """A linear-attention block calling its scan by name (as Transformers' Gated DeltaNet calls
    ``torch_chunk_gated_delta_rule``); ``order``: the scan's step order on this side."""

    def __init__(self, order: str = "own"):
        super().__init__()
        g = torch.Generator().manual_seed(4)
        self.qkv = torch.nn.Parameter(torch.randn(3 * 2 * 4, 8, generator=g) / 3)
        self.gates = torch.nn.Parameter(torch.randn(2 * 2, 8, generator=g) / 3)
        self.order = order

    def forward(self, x):
        q, k, v = F.linear(x, self.qkv).unflatten(-1, (3, 2, 4)).unbind(2)
        k = F.normalize(k, dim=-1)
        a, b = F.linear(x, self.gates).unflatten(-1, (2, 2)).unbind(2)
        out, _ = toy_gated_delta_rule(q, k, v, g=-F.softplus(a), beta=torch.sigmoid(b), order=self.order)
        return out.flatten(2)


def test_a_delta_rule_s_step_order_is_named_on_either_side():
    x = torch.randn(1, 7, 8, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        after, read_first, own = (DeltaMixer(o)(x) for o in ("after", "read_first", "own"))
    words = _changes_named(torch.nn.Sequential(DeltaMixer()).eval(), x)
    assert words(after) == ["the delta-rule scan with its state read and written before its decay (the state "
                            "decayed after the update)"]  # fmt: skip
    assert words(read_first) == ["the delta-rule scan with its state read for its prediction S^T k before this step's "
                                 "decay"]  # fmt: skip
    assert words(own) == []
    # the fault in the reference: its own scan run in Transformers' order agrees with ours
    assert _changes_named(torch.nn.Sequential(DeltaMixer("after")).eval(), x)(own) == [
        "the delta-rule scan with its state decayed, read, written, then read for the output (Transformers' order)"
    ]


def mamba_selective_scan(hidden_states, dt, A, B, C, D=None, z=None, delta_softplus=False, order="own"):
    """A Mamba selective scan written for this test (Gu and Dao 2023), ``(batch, channels, seq)`` in and out, ``B``
    and ``C`` ``(batch, state, seq)``, with a step a port may get wrong: "zoh" (B discretised by zero-order hold),
    "old_state" (the output read before the write), "d_after_gate" (the skip added after the gate)."""
    dt = F.softplus(dt) if delta_softplus else dt
    h = torch.zeros(hidden_states.shape[0], hidden_states.shape[1], A.shape[1])
    ys = []
    for t in range(hidden_states.shape[2]):
        a = torch.exp(dt[:, :, t, None] * A)
        b = (a - 1) / A * B[:, None, :, t] if order == "zoh" else dt[:, :, t, None] * B[:, None, :, t]
        new = a * h + b * hidden_states[:, :, t, None]
        ys.append(torch.einsum("bcn,bn->bc", h if order == "old_state" else new, C[:, :, t]))
        h = new
    y = torch.stack(ys, -1)
    if order == "d_after_gate":
        return y * F.silu(z) + D[:, None] * hidden_states
    return (y + D[:, None] * hidden_states) * F.silu(z)


class SelectiveMixer(torch.nn.Module):
    """A Mamba mixer calling its scan by name (as Transformers' Jamba calls ``mamba_selective_scan``)."""

    def __init__(self, order: str = "own"):
        super().__init__()
        g = torch.Generator().manual_seed(6)
        self.in_proj = torch.nn.Parameter(torch.randn(2 * 6, 8, generator=g) / 3)
        self.x_proj = torch.nn.Parameter(torch.randn(6 + 2 * 3, 6, generator=g) / 3)
        self.A_log = torch.nn.Parameter(torch.rand(6, 3, generator=g))
        self.D = torch.nn.Parameter(torch.randn(6, generator=g))
        self.order = order

    def forward(self, x):
        u, z = F.linear(x, self.in_proj).transpose(1, 2).chunk(2, dim=1)
        dt, B, C = F.linear(u.transpose(1, 2), self.x_proj).split([6, 3, 3], dim=-1)
        A = -torch.exp(self.A_log)
        y = mamba_selective_scan(
            u, dt.transpose(1, 2), A, B.transpose(1, 2), C.transpose(1, 2), self.D, z, True, order=self.order
        )
        return y.transpose(1, 2)


def test_a_selective_scan_s_discretisation_and_step_order_are_named_on_either_side():
    x = torch.randn(1, 7, 8, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        zoh, old_state, d_after_gate, own = (SelectiveMixer(o)(x) for o in ("zoh", "old_state", "d_after_gate", "own"))
    words = _changes_named(torch.nn.Sequential(SelectiveMixer()).eval(), x)
    assert words(zoh) == ["the selective scan with its state written (exp(dt A) - 1) / A B x (B discretised by "
                          "zero-order hold, not Mamba's dt B)"]  # fmt: skip
    assert words(old_state) == ["the selective scan with its state read for the output C h before this step's write"]
    assert words(d_after_gate) == ["the selective scan with its state read with the skip D x added after the output "
                                   "gate silu(z), not before it"]  # fmt: skip
    assert words(own) == []
    # the fault in the reference: its own scan run in Mamba's order agrees with ours
    assert _changes_named(torch.nn.Sequential(SelectiveMixer("zoh")).eval(), x)(own) == [
        "the selective scan with its state decayed, written dt B x, then read for the output C h, D x added before "
        "the gate (Transformers' order)"
    ]


class HyperMix(torch.nn.Module):
    """Two mixes of 3 residual streams ``(batch, seq, 3, 8)`` by a per-token square matrix (hyper-connections),
    each through its transpose (``transposed``) or as it is."""

    def __init__(self, transposed: bool = True):
        super().__init__()
        self.mix = torch.nn.Parameter(torch.randn(9, 24, generator=torch.Generator().manual_seed(8)) / 3)
        self.transposed = transposed

    def forward(self, x):
        comb = torch.softmax(F.linear(x.flatten(-2), self.mix).unflatten(-1, (3, 3)), -1)  # (batch, seq, 3, 3)
        first = comb.transpose(-1, -2) if self.transposed else comb
        h = torch.matmul(first, x)
        second = comb.transpose(-1, -2) if self.transposed else comb
        return torch.matmul(second, torch.tanh(h))


def test_a_square_matrix_s_transpose_is_named_on_either_side_at_both_uses():
    x = torch.randn(1, 5, 3, 8, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        plain, transposed = HyperMix(transposed=False)(x), HyperMix()(x)
    # both uses differ: only the change made at both lines together explains ours
    words = _changes_named(torch.nn.Sequential(HyperMix()).eval(), x)
    assert words(plain)[0] == "the transpose of a square matrix left out (used as it is)"
    assert words(transposed) == []
    # the fault in the reference: it mixes without the transpose
    assert _changes_named(torch.nn.Sequential(HyperMix(transposed=False)).eval(), x)(transposed)[0] == (
        "a square matrix computed in the forward read transposed (its transpose where it is meant)"
    )


class Router(torch.nn.Module):
    """A top-k router renormalising its chosen weights in place, a fused per-head [q | gate] projection viewed per
    head, a square expert weight, a config float (a bound) and a norm gated after it: the sites of the search's
    layout and routing changes."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(8)
        self.router = torch.nn.Parameter(torch.randn(4, 8, generator=g))
        self.qg = torch.nn.Parameter(torch.randn(16, 8, generator=g))
        self.expert = torch.nn.Parameter(torch.randn(8, 8, generator=g))
        self.norm = torch.nn.RMSNorm(8, eps=1e-6)
        self.bound = -3.0

    def forward(self, x):  # (tokens, 8)
        top = torch.topk(F.linear(x, self.router).softmax(-1), 2, dim=-1).values
        top /= top.sum(-1, keepdim=True)
        q, gate = (t.flatten(1) for t in x.matmul(self.qg.T).view(x.shape[0], 2, 8).chunk(2, -1))
        h = self.norm(q @ self.expert) * torch.sigmoid(gate)
        return h * top[:, :1] * torch.sigmoid(self.bound * x) + top.sum(-1, keepdim=True)


def _router(x: torch.Tensor, m: Router, unnormed=False, blocks=False, every=False, transposed=False,
            default=False, gate_first=False) -> torch.Tensor:  # fmt: skip
    """:class:`Router`'s output with one thing written otherwise (the user's side of a fault)."""
    probs = F.linear(x, m.router).softmax(-1)
    top = torch.topk(probs, 4 if every else 2, dim=-1).values
    top = top if unnormed else top / top.sum(-1, keepdim=True)
    flat = x.matmul(m.qg.T)
    q, gate = (flat[:, :8], flat[:, 8:]) if blocks else (t.flatten(1) for t in flat.view(-1, 2, 8).chunk(2, -1))
    y = q @ (m.expert.T if transposed else m.expert)
    h = m.norm(y * torch.sigmoid(gate)) if gate_first else m.norm(y) * torch.sigmoid(gate)
    return h * top[:, :1] * torch.sigmoid((-5.0 if default else -3.0) * x) + top.sum(-1, keepdim=True)


def test_routing_layout_and_config_changes_are_each_named():
    from types import SimpleNamespace

    class Config(SimpleNamespace):
        def __init__(self, bound=-5.0):
            super().__init__(bound=bound)

        def to_dict(self):
            return {"bound": self.bound}

    model, x = torch.nn.Sequential(Router()).eval(), torch.randn(5, 8, generator=torch.Generator().manual_seed(9))
    model.config = Config(-3.0)
    words = _changes_named(model, x)
    m = model[0]
    with torch.no_grad():
        assert words(_router(x, m)) == []
        assert words(_router(x, m, unnormed=True))[0].startswith("the broadcast divisor of shape (5, 1) left out")
        assert words(_router(x, m, blocks=True))[0].startswith("this fused output read as 2 whole blocks")
        assert words(_router(x, m, every=True))[0] == "topk over every one of the 4 entries (no selection: every "\
            "expert kept)"  # fmt: skip
        assert words(_router(x, m, transposed=True))[0] == "0.expert read transposed (a square weight's last two " \
            "axes swapped at load)"  # fmt: skip
        assert words(_router(x, m, default=True)) == ["config.bound (-3) read as its default -5"]
        assert words(_router(x, m, gate_first=True))[0] == (
            "the gate applied before 0.norm's normalisation (norm(x * g)), not after (norm(x) * g)"
        )


class GateFirst(Router):
    """:class:`Router` with its gate applied before the norm: the fault on the reference's side."""

    def forward(self, x):
        top = torch.topk(F.linear(x, self.router).softmax(-1), 2, dim=-1).values
        top /= top.sum(-1, keepdim=True)
        q, gate = (t.flatten(1) for t in x.matmul(self.qg.T).view(x.shape[0], 2, 8).chunk(2, -1))
        h = self.norm((q @ self.expert) * torch.sigmoid(gate))
        return h * top[:, :1] * torch.sigmoid(self.bound * x) + top.sum(-1, keepdim=True)


def test_a_gate_moved_before_a_norm_in_the_reference_is_named_too():
    model, x = torch.nn.Sequential(GateFirst()).eval(), torch.randn(5, 8, generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        target = _router(x, model[0])  # ours: the gate after the norm
    assert _changes_named(model, x)(target)[0] == (
        "0.norm's input gate (operand 1 of the product it reads) applied after its normalisation (norm(x) * g), not "
        "before (norm(x * g))"
    )


class Gates(torch.nn.Module):
    """RecurrentGemma-like gates: two per-head products of one input with a bias view each (``baddbmm``), a decay
    ``-8 * softplus``, and a bias added to a rate: the sites of the search's sign and parameter changes."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(10)
        self.w_in, self.w_rec = (torch.nn.Parameter(torch.randn(2, 4, 4, generator=g)) for _ in range(2))
        self.b_in, self.b_rec = (torch.nn.Parameter(torch.randn(2, 4, generator=g)) for _ in range(2))
        self.lam = torch.nn.Parameter(torch.randn(8, generator=g))
        self.dt_bias = torch.nn.Parameter(torch.randn(8, generator=g))

    def forward(self, x):  # (tokens, 8)
        heads = x.reshape(-1, 2, 4).transpose(0, 1)
        gate_in = torch.sigmoid(torch.baddbmm(self.b_in[:, None, :], heads, self.w_in).transpose(0, 1).reshape(-1, 8))
        gate_rec = torch.sigmoid(
            torch.baddbmm(self.b_rec[:, None, :], heads, self.w_rec).transpose(0, 1).reshape(-1, 8)
        )
        decay = torch.exp(-8.0 * gate_rec * F.softplus(self.lam))
        rate = x + self.dt_bias[None, :]
        return gate_in * decay * rate


def _gates(x, m: Gates, swap=False, sign=False, small=False, twice=False) -> torch.Tensor:
    """:class:`Gates`' output with one thing written otherwise (the user's side of a fault)."""
    (w_in, b_in), (w_rec, b_rec) = (
        ((m.w_rec, m.b_rec), (m.w_in, m.b_in)) if swap else ((m.w_in, m.b_in), (m.w_rec, m.b_rec))
    )
    heads = x.reshape(-1, 2, 4).transpose(0, 1)
    gate_in = torch.sigmoid((heads @ w_in + b_in[:, None, :]).transpose(0, 1).reshape(-1, 8))
    gate_rec = torch.sigmoid((heads @ w_rec + b_rec[:, None, :]).transpose(0, 1).reshape(-1, 8))
    decay = torch.exp((-1.0 if small else -8.0) * gate_rec * F.softplus(-m.lam if sign else m.lam))
    return gate_in * decay * (x + m.dt_bias * (2 if twice else 1))


def test_gates_swapped_with_their_bias_views_a_sign_a_constant_s_size_and_a_bias_twice_are_named():
    model, x = torch.nn.Sequential(Gates()).eval(), torch.randn(6, 8, generator=torch.Generator().manual_seed(11))
    words = _changes_named(model, x)
    m = model[0]
    with torch.no_grad():
        assert words(_gates(x, m)) == []
        assert words(_gates(x, m, swap=True))[0] == "the parameters 0.b_in / 0.b_rec and 0.w_in / 0.w_rec swapped " \
            "(two products of one input)"  # fmt: skip
        assert words(_gates(x, m, sign=True))[0] == "softplus of the negated input"
        assert words(_gates(x, m, small=True))[0] == "the factor -8 left out, its sign kept (-1)"
        assert words(_gates(x, m, twice=True))[0] == "0.dt_bias (offset) added twice"


class CellBackend(torch.nn.Module):
    """An mLSTM cell module (as xLSTM's backend: its kernel bound at init), reading its output after each step's
    write (Transformers' cell) or before it (a port's off-by-one, written here)."""

    def __init__(self, read_first: bool):
        super().__init__()
        self.read_first = read_first

    def forward(self, query, key, value, igate, fgate):
        from transformers.models.xlstm import modeling_xlstm

        if self.read_first:
            return _read_first(query, key, value, igate, fgate)
        return modeling_xlstm.mlstm_recurrent_sequence_native(query, key, value, igate, fgate, eps=1e-6)


def _read_first(query, key, value, igate, fgate):
    """The stabilised mLSTM step by step, the output read before each step's write."""
    q = query * query.shape[-1] ** -0.5
    C = torch.zeros(*query.shape[:2], query.shape[-1], value.shape[-1])
    n, m = torch.zeros(*query.shape[:2], query.shape[-1]), torch.zeros(query.shape[:2])
    out = []
    for t in range(query.shape[2]):
        num = torch.einsum("bhd,bhdv->bhv", q[:, :, t], C)
        den = torch.maximum(torch.einsum("bhd,bhd->bh", q[:, :, t], n).abs(), torch.exp(-m)) + 1e-6
        out.append(num / den[..., None])
        log_f = F.logsigmoid(fgate[:, :, t])
        m_new = torch.maximum(log_f + m, igate[:, :, t])
        f_act, i_act = torch.exp(log_f + m - m_new), torch.exp(igate[:, :, t] - m_new)
        written = torch.einsum("bhd,bhv->bhdv", key[:, :, t], value[:, :, t])
        C = f_act[..., None, None] * C + i_act[..., None, None] * written
        n, m = f_act[..., None] * n + i_act[..., None] * key[:, :, t], m_new
    return torch.stack(out, 2)


class CellLayer(torch.nn.Module):
    """Projections to q, k, v ``(batch, 2 heads, seq, 4)`` and two gates ``(batch, 2 heads, seq)``, then the cell."""

    def __init__(self, read_first: bool = False):
        super().__init__()
        self.proj = torch.nn.Parameter(torch.randn(28, 8, generator=torch.Generator().manual_seed(9)) / 3)
        self.backend = CellBackend(read_first)

    def forward(self, x):
        qkv, gates = F.linear(x, self.proj).split([24, 4], -1)
        q, k, v = qkv.unflatten(-1, (3, 2, 4)).permute(2, 0, 3, 1, 4).unbind(0)
        i, f = (3 * g for g in gates.unflatten(-1, (2, 2)).permute(2, 0, 3, 1).unbind(0))
        return self.backend(query=q, key=k, value=v, igate=i, fgate=f).transpose(1, 2).flatten(2)


def test_an_mlstm_cell_s_read_order_is_named_on_either_side():
    x = torch.randn(1, 6, 8, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        read_first, own = CellLayer(read_first=True)(x), CellLayer()(x)
    assert _changes_named(torch.nn.Sequential(CellLayer()).eval(), x)(read_first) == [
        "the mLSTM cell with its output read before this step's write"
    ]
    # the fault in the reference's cell: Transformers' own cell in its place agrees with ours
    assert _changes_named(torch.nn.Sequential(CellLayer(read_first=True)).eval(), x)(own)[0].startswith(
        "the mLSTM cell with an exp input gate, a sigmoid forget gate"
    )


class Selecting(torch.nn.Module):
    """Picks 2 of 8 features per token (``select``) and mixes the picked ones back into the stream."""

    def __init__(self, seed: int):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.score = torch.nn.Parameter(torch.randn(8, 8, generator=g))
        self.value = torch.nn.Parameter(torch.randn(8, 8, generator=g) / 3)

    def select(self, x: torch.Tensor) -> torch.Tensor:
        return torch.topk(F.linear(x, self.score), 2, dim=-1).indices

    def forward(self, x: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        return torch.tanh(torch.gather(F.linear(x, self.value), -1, chosen).sum(-1, keepdim=True)) * x


class SharingLayer(torch.nn.Module):
    """A layer choosing its own features ("full") or reusing the ones handed on to it ("shared"), GLM-MoE-DSA's
    indexer pattern."""

    def __init__(self, seed: int, shared: bool):
        super().__init__()
        self.mix, self.shared = Selecting(seed), shared

    def forward(self, x: torch.Tensor, prev_chosen: torch.Tensor | None = None):
        chosen = prev_chosen if self.shared and prev_chosen is not None else self.mix.select(x)
        return x + self.mix(x, chosen), chosen


class Sharing(torch.nn.Module):
    """Four layers, full and shared in turn; ``stale``: a shared layer reuses the FIRST full layer's choice instead
    of the latest one."""

    def __init__(self, stale: bool = False):
        super().__init__()
        self.layers = torch.nn.ModuleList(SharingLayer(i, shared=i % 2 == 1) for i in range(4))
        self.stale = stale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        first = chosen = None
        for layer in self.layers:
            handed = first if self.stale and layer.shared else chosen
            x, chosen = layer(x, prev_chosen=handed)
            first = chosen if first is None else first
        return x


def _layer_3_output(model: Sharing, x: torch.Tensor) -> torch.Tensor:
    kept: list[torch.Tensor] = []
    hook = model.layers[3].mix.register_forward_hook(lambda _m, _a, out: kept.append(out))
    with torch.no_grad():
        model(x)
    hook.remove()
    return kept[0]


def _handed_words(reference: Sharing, ours: Sharing, x: torch.Tensor) -> list[str]:
    ours.load_state_dict(reference.state_dict())
    theirs, recorded = _layer_3_output(ours, x), _layer_3_output(reference, x)
    assert not torch.allclose(theirs, recorded, atol=1e-4)  # the fault shows at layer 3
    close = lambda value: bool(torch.allclose(value, theirs, atol=1e-6))
    same = lambda value: bool(torch.allclose(value, recorded, atol=1e-6))
    target = one_change.Target("layers.3.mix", "layers.3.mix", close, same)
    found = one_change.search(reference, "layers.3.mix", [target], lambda: reference(x), scope="layers.3")
    assert found is not None
    assert found[0][0].where.endswith(
        "(`def forward(self, x: torch.Tensor, prev_chosen: torch.Tensor | None = None):`)"
    )
    return [c.words for c, _ in found]


def test_a_value_handed_on_from_another_layer_is_named_on_either_side():
    """Layer 3 (shared) reads the choice layer 2 made; the stale side reads layer 0's: re-running the reference's
    layer 3 with that argument taken from what layer 0 returned (ours stale) or layer 2 returned (the reference
    stale) makes the sides agree."""
    x = torch.randn(1, 6, 8, generator=torch.Generator().manual_seed(4))
    assert _handed_words(Sharing(), Sharing(stale=True), x)[0].startswith(
        "layers.3's `prev_chosen` given the value layers.0's call returned (its output 1)"
    )
    assert _handed_words(Sharing(stale=True), Sharing(), x)[0].startswith(
        "layers.3's `prev_chosen` given the value layers.2's call returned (its output 1)"
    )
