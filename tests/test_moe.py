"""The engine's and the shared blocks' mixture-of-experts parts, family-free: the MoE block against
Transformers' own, fused tensors split into views (and loader coverage of the slices), output items
as nodes (``path#n``), integer nodes compared exactly (status ``choice``), per-layer experts in the
facts and the node map, the expert capture, and the hints that read them."""

from __future__ import annotations

import torch
from torch import nn

from parity.build.coverage import loader_coverage
from parity.compare.metrics import CHOICE, OK, choice_margins
from parity.compare.results import compare_node
from parity.compare.tolerances import Tolerances
from parity.diagnose.evidence import Evidence
from parity.diagnose.moe import choice, row_normalisation
from parity.diagnose.profile import error_profile
from parity.model.derive import derive_facts
from parity.model.family import Node, NodeMap
from parity.model.pair import NodeSpec
from parity.model.weights import Split, apply_weight_table, parameter_storages
from parity.record.hooks import recording, split_path
from parity.record.trace import Trace
from parity.util.errors import LoaderError
from reference_pairs.common.mlp import GatedMLP
from reference_pairs.common.moe import SparseMoE


def moe_config(**kw):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        **{
            **dict(
                hidden_size=32,
                intermediate_size=48,
                moe_intermediate_size=16,
                num_hidden_layers=4,
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=8,
                num_experts=16,
                num_experts_per_tok=8,
                norm_topk_prob=True,
                vocab_size=64,
            ),
            **kw,
        }
    )


# --- the block, against Transformers' own


def _block_pair(dtype, norm_topk_prob=True):
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    config = moe_config(norm_topk_prob=norm_topk_prob)
    config._experts_implementation = "eager"  # the experts class's own loop: the reference math
    gen = torch.Generator().manual_seed(0)
    ref = Qwen3MoeSparseMoeBlock(config).to(dtype)
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)
    ours = SparseMoE(32, 16, 16, 8, norm_topk_prob=norm_topk_prob, dtype=dtype)
    sd = {"gate.weight": ref.gate.weight, "gate_up": ref.experts.gate_up_proj, "down": ref.experts.down_proj}
    apply_weight_table(
        ours,
        sd,
        {
            "gate.weight": "gate.weight",
            "gate_up": Split(("experts.{e}.fc1.weight", "experts.{e}.fc2.weight")),
            "down": Split(("experts.{e}.fc3.weight",)),
        },
    )
    return ours, ref


def test_sparse_moe_is_bit_identical_to_transformers_eager_experts():
    """Top-8 of 16 in float32 and bfloat16: the same experts, weights and sums, in the same order."""
    for dtype in (torch.float32, torch.bfloat16):
        for norm_topk_prob in (True, False):
            ours, ref = _block_pair(dtype, norm_topk_prob)
            x = torch.randn(3, 7, 32, generator=torch.Generator().manual_seed(1)).to(dtype)
            with torch.no_grad():
                assert torch.equal(ours(x), ref(x)), (dtype, norm_topk_prob)


def test_fused_gate_up_is_the_same_function():
    mlp = GatedMLP(32, 16, fused_gate_up=True)
    plain = GatedMLP(32, 16)
    plain.load_state_dict(mlp.state_dict())
    x = torch.randn(5, 32)
    with torch.no_grad():
        torch.testing.assert_close(mlp(x), plain(x))
        gate, up = nn.functional.linear(x, torch.cat([mlp.fc1.weight, mlp.fc2.weight])).chunk(2, -1)
        assert torch.equal(mlp(x), mlp.fc3(nn.functional.silu(gate) * up))
    assert "fused_gate_up" in repr(mlp)


# --- Split: one fused tensor, several parameters of ours, as views


class _Fused(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.k = nn.Linear(4, 3, bias=False), nn.Linear(4, 3, bias=False)


def test_split_without_experts_assigns_views_and_coverage_sees_every_element_once():
    model = _Fused()
    qk = torch.randn(6, 4)
    assert apply_weight_table(model, {"qk": qk}, {"qk": Split(("q.weight", "k.weight"))}) == {
        "qk": "q.weight .. k.weight (2 views)"
    }
    assert (
        torch.equal(model.k.weight, qk[3:])
        and model.k.weight.untyped_storage().data_ptr() == qk.untyped_storage().data_ptr()
    )
    built = parameter_storages(model)
    cov = loader_coverage(model, {"qk": qk}, built=built)
    assert cov.ok and [s.region for s in cov.sources["k.weight"]] == ["[3:6, :]"]
    model.q.weight, model.k.weight = model.k.weight, model.q.weight  # a swap is no coverage gap: the nodes judge it
    assert loader_coverage(model, {"qk": qk}, built=built).ok


def test_split_that_does_not_cut_evenly_is_one_shape_error():
    model = _Fused()
    try:
        apply_weight_table(model, {"qk": torch.zeros(7, 4)}, {"qk": Split(("q.weight", "k.weight"))})
    except LoaderError as e:
        assert "shape mismatch for qk: checkpoint (7, 4): cannot cut (7, 4) into 2 equal parts along dim 0" in str(e)
        assert "never written" not in str(e)
    else:
        raise AssertionError("no LoaderError")


# --- output items as nodes, integer nodes compared exactly


class _Router(nn.Module):
    def forward(self, x):
        return x * 2, x.argmax(-1, keepdim=True), x.sum(-1)


def test_a_path_may_name_an_output_item():
    assert split_path("a.b#2") == ("a.b", False, 2) and split_path("a.b@input") == ("a.b", True, None)
    assert split_path("a.b") == ("a.b", False, None)
    model = nn.Sequential(_Router())
    x = torch.randn(3, 5)
    with recording(model, [("whole", "0"), ("chosen", "0#1"), ("total", "0#2")]) as trace:
        model(x)
    assert torch.equal(trace.tensors["whole"], x * 2) and torch.equal(
        trace.tensors["chosen"], x.argmax(-1, keepdim=True)
    )
    assert torch.equal(trace.tensors["total"], x.sum(-1))
    substitute = Trace(tensors={"chosen": torch.zeros(3, 1, dtype=torch.int64)})
    with recording(model, [("chosen", "0#1")], substitute=substitute):
        out = model(x)
    assert torch.equal(out[1], torch.zeros(3, 1, dtype=torch.int64)) and torch.equal(out[0], x * 2)


def test_integer_nodes_are_compared_exactly():
    spec = NodeSpec("r.experts", "r.experts", chosen_from="r.gate")
    chosen = torch.tensor([[0, 1], [2, 3], [1, 0]])
    same = compare_node(spec, 0, chosen.clone(), chosen, Tolerances(atol=1.0))
    assert same.status == OK and same.max_abs == 0.0 and same.passed
    scores = torch.tensor([[3.0, 2.0, 1.0, 0.0], [0.0, 2.0 - 1e-7, 2.5, 2.0], [2.0, 3.0, 0.0, 1.0]])
    other = torch.tensor([[0, 1], [2, 1], [0, 1]])
    res = compare_node(spec, 0, other, chosen, Tolerances(atol=1.0), scores=scores)
    assert res.status == CHOICE and res.failed and res.max_abs is None
    assert res.detail.startswith(
        "2 of 3 rows choose differently (rows 1, 2); 1 of them the same values in another order"
    )
    found = choice_margins(other, chosen, scores)
    assert found["rows"] == [1, 2] and found["same_set"] == [2]
    assert (
        found["margins"][0] < 1e-6 and found["margins"][1] == 1.0
    )  # row 1: a near-tie between experts 3 and 1 (row 2: a swap)


def test_choice_hint_tells_a_near_tie_from_a_real_difference():
    scores = torch.tensor([[0.0, 2.0 - 1e-7, 2.5, 2.0]])
    ref, ours = torch.tensor([[2, 3]]), torch.tensor([[2, 1]])
    trace_ref = Trace(tensors={"g": scores, "c": ref})
    result = compare_node(NodeSpec("c", "c", chosen_from="g"), 0, ours, ref, Tolerances(), scores=scores)
    e = Evidence(
        result, ours, ref, Trace(tensors={"c": ours}), trace_ref, derive_facts(moe_config()), torch.arange(1)[None]
    )
    hint = choice(e, NodeSpec("c", "c", chosen_from="g"))
    assert hint.kind == "routing" and "near-ties" in hint.text and "(row 0, position 0)" in hint.text
    far = torch.tensor([[0.0, 1.0, 5.0, 4.0]])
    e = Evidence(result, ours, ref, Trace(), Trace(tensors={"g": far}), derive_facts(moe_config()))
    assert "not a near-tie" in choice(e, NodeSpec("c", "c", chosen_from="g")).text


def test_renormalised_rows_are_named():
    probs = torch.tensor([[0.5, 0.2], [0.3, 0.1], [0.6, 0.3]])
    renormalised = probs / probs.sum(-1, keepdim=True)
    result = compare_node(NodeSpec("w", "w"), 0, renormalised, probs, Tolerances())
    hint = row_normalisation(Evidence(result, renormalised, probs, Trace(), Trace(), derive_facts(moe_config())))
    assert (
        hint.kind == "renormalisation"
        and hint.evidence["ours_sums_to_one"]
        and not hint.evidence["reference_sums_to_one"]
    )
    constant = probs * 2  # one factor everywhere is a scale, not a normalisation
    assert row_normalisation(Evidence(result, constant, probs, Trace(), Trace(), derive_facts(moe_config()))) is None


def test_error_profile_of_a_token_major_node_is_by_token():
    ours, ref = torch.zeros(6, 4), torch.zeros(6, 4)
    ours[4, 1] = 1.0
    assert error_profile(ours, ref, "expert")["by_position"] == [0, 0, 0, 0, 1.0, 0]


# --- facts and node map


def test_facts_know_which_layers_are_sparse():
    facts = derive_facts(moe_config(decoder_sparse_step=2, mlp_only_layers=[3]))
    assert [(layer.num_experts, layer.experts_per_token) for layer in facts.layers] == [(0, 0), (16, 8), (0, 0), (0, 0)]
    from transformers import MixtralConfig

    mixtral = derive_facts(MixtralConfig(num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2))
    assert [layer.sparse for layer in mixtral.layers] == [True, True]  # generic: every layer of a MoE config


def test_node_map_expands_experts_on_sparse_layers_only():
    nodes = NodeMap(
        per_layer=[
            Node("model.layers.{i}.mlp.experts.{e}", "blocks.{i}.ff.experts.{e}", sparse=True, kind="expert"),
            Node("model.layers.{i}.mlp.down_proj", "blocks.{i}.ff.fc3", sparse=False),
            Node(
                "model.layers.{i}.mlp.router.experts",
                "blocks.{i}.ff.router.experts",
                reference="model.layers.{i}.mlp.gate#2",
                sparse=True,
                chosen_from="model.layers.{i}.mlp.gate",
            ),
        ]
    ).expand(derive_facts(moe_config(num_experts=3, num_experts_per_tok=2, mlp_only_layers=[0, 2])))
    names = [n.name for n in nodes]
    assert names[:2] == ["model.layers.0.mlp.down_proj", "model.layers.1.mlp.experts.0"]
    assert names.count("model.layers.3.mlp.experts.2") == 1 and "model.layers.2.mlp.experts.0" not in names
    router = next(n for n in nodes if n.name == "model.layers.1.mlp.router.experts")
    assert router.reference == "model.layers.1.mlp.gate#2" and router.chosen_from == "model.layers.1.mlp.gate"


# --- the expert capture


def test_each_expert_node_is_the_references_own_expert_on_its_tokens():
    import parity
    from reference_pairs.qwen3_moe import build_pair

    pair = build_pair("tiny-moe")
    res = parity.check(pair)
    assert pair.reference.config._experts_implementation == "parity_eager"
    from parity.run.plan import plan
    from parity.run.stages import trace_reference

    trace = trace_reference(pair, plan(pair))
    experts = pair.reference.model.layers[0].mlp.experts
    chosen = trace.tensors["model.layers.0.mlp.router.experts"]
    x = trace.extras["model.layers.0.mlp.experts.0"].x
    for e in range(8):
        out = trace.tensors[f"model.layers.0.mlp.experts.{e}"]
        routed = (chosen == e).any(-1)
        assert not out[~routed].any()  # zero on the tokens routed elsewhere
        # the tokens in the eager loop's order (by top-k slot, then token): a row of a matrix product
        # may round otherwise at another place in the matrix (a CPU kernel's edge rows), so the same
        # rows in another order are another computation
        _, tokens = torch.where((chosen == e).T)
        gate, up = nn.functional.linear(x[tokens], experts.gate_up_proj[e]).chunk(2, -1)
        expected = torch.zeros_like(out).index_add_(
            0, tokens, nn.functional.linear(experts.act_fn(gate) * up, experts.down_proj[e])
        )
        assert torch.equal(out, expected)
    assert res.passed


def test_checkpoint_conversion_merges_per_expert_tensors_into_the_models_layout():
    from transformers import Qwen3MoeForCausalLM

    from parity.build.builder import model_naming

    config = moe_config(num_experts=3, num_experts_per_tok=2, num_hidden_layers=1)
    gate = [torch.randn(16, 32) for _ in range(3)]
    up = [torch.randn(16, 32) for _ in range(3)]
    sd = {
        f"model.layers.0.mlp.experts.{e}.{name}.weight": t[e]
        for e in range(3)
        for name, t in (("gate_proj", gate), ("up_proj", up))
    }
    sd["model.norm.weight"] = norm = torch.ones(32)
    out, notes = model_naming(Qwen3MoeForCausalLM, config, sd)
    assert torch.equal(
        out["model.layers.0.mlp.experts.gate_up_proj"], torch.stack([torch.cat([g, u]) for g, u in zip(gate, up)])
    )
    assert out["model.norm.weight"] is norm and len(notes) == 1 and "(6 tensors): merged into" in notes[0]


def test_a_recording_reads_no_earlier_recordings_expert_rows():
    """The tokens a MoE block gathered are one recording's own: an expert's output recorded by a later recording (a
    model whose MoE parity reads no routing of) is not masked by an earlier one's last choices (a decode step's two
    tokens zeroed a later model's expert row)."""
    from parity.record import routing

    stale = routing._ROWS.set((torch.arange(2), 2, torch.tensor([[0], [3]])))  # an earlier run's last choices
    try:
        expert = routing.ExpertRows(expert=3)
        out = torch.ones(2, 4)
        assert torch.equal(expert(out), torch.tensor([[0.0] * 4, [1.0] * 4]))  # what the stale rows did
        model = nn.Sequential(nn.Linear(4, 4))
        with recording(model, [("out", "0")], transforms={"out": expert}) as trace:
            model(out)
        assert torch.equal(trace.tensors["out"], model(out).detach())
        assert routing._ROWS.get() is not None  # the caller's own value is back after the recording
    finally:
        routing._ROWS.reset(stale)
