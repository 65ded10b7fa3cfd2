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
    assert [c.words for c, _ in _search(model, x, no_bias) or []] == ["block.bias (offset) left out"]
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
