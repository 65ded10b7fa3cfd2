"""The name map's vocabulary (parity/golden/dumps.py): writes of one name, size names, reshape, permute,
slice, select, scale, nodes a runtime cannot produce, and one-line errors for a map that is wrong.
No model runs here: map_dump is fed small tensors."""

from __future__ import annotations

import json

import pytest
import torch

from parity.golden.dumps import NameMap, apply_ops, map_dump, read_dump_info, read_name_map, write_dump_info
from parity.util.errors import ParityError

SHAPES = {
    "model.layers.0.self_attn.q_proj": (1, 3, 8),
    "model.layers.0.self_attn.q_rot": (1, 2, 3, 4),
    "model.layers.1.self_attn.q_rot": (1, 2, 3, 4),
    "model.layers.0.self_attn.scores": (1, 2, 3, 3),
    "model.layers.0.post_feedforward_layernorm": (1, 3, 8),
    "model.layers.1.post_feedforward_layernorm": (1, 3, 8),
    "model.norm": (1, 3, 8),
}
SIZES = {"batch": 1, "seq": 3, "heads": 2, "kv_heads": 2, "head_dim": 4, "hidden": 8, "attention_scale": 0.5}


def interleave(x: torch.Tensor) -> torch.Tensor:
    """(seq, heads, head_dim) in HF's half-split order -> llama.cpp's interleaved pairs."""
    s, h, d = x.shape
    return x.reshape(s, h, 2, d // 2).transpose(2, 3).reshape(s, h, d)


def test_writes_of_one_name_are_told_apart_and_each_has_its_layout():
    """llama.cpp's Qcur-0 is written three times: #0 the projection, #last the rotated result."""
    q_proj = torch.randn(3, 8)
    q_rot = torch.randn(2, 3, 4)  # (heads, seq, head_dim), the node's layout
    dump = {
        "Qcur-0": q_proj,
        "Qcur-0#1": q_proj.reshape(3, 2, 4),
        "Qcur-0#2": interleave(q_rot.transpose(0, 1)),  # (seq, heads, head_dim), interleaved
    }
    rules = read_name_map(
        {
            "Qcur-{i}#0": "model.layers.{i}.self_attn.q_proj",
            "Qcur-{i}#last": {
                "node": "model.layers.{i}.self_attn.q_rot",
                "ops": [{"reshape": [0, 0, -1, 2]}, {"permute": [1, 0, 3, 2]}, {"reshape": [0, 0, "head_dim"]}],
            },
        }
    )
    tensors, keys, notes = map_dump(dump, rules.rules, SHAPES, SIZES)
    assert keys == {"model.layers.0.self_attn.q_proj": "Qcur-0", "model.layers.0.self_attn.q_rot": "Qcur-0#2"}
    assert torch.equal(tensors["model.layers.0.self_attn.q_proj"], q_proj[None])  # batch restored
    assert torch.equal(tensors["model.layers.0.self_attn.q_rot"], q_rot[None])
    assert notes == ["2 dump tensor(s) had no batch axis (Qcur-0, Qcur-0#2); read as batch 1"]


def test_a_name_without_a_layer_index_is_read_one_write_per_layer():
    first, second = torch.randn(3, 8), torch.randn(3, 8)
    rules = read_name_map({"ffn_post_norm#{i}": "model.layers.{i}.post_feedforward_layernorm"})
    tensors, keys, _ = map_dump({"ffn_post_norm": first, "ffn_post_norm#1": second}, rules.rules, SHAPES, SIZES)
    assert torch.equal(tensors["model.layers.1.post_feedforward_layernorm"][0], second)
    assert keys["model.layers.0.post_feedforward_layernorm"] == "ffn_post_norm"
    # what a missing node is looked for under
    assert rules.rules[0].runtime_name("model.layers.1.post_feedforward_layernorm") == "ffn_post_norm#1"


def test_a_name_written_several_times_must_say_which_write():
    rules = read_name_map({"Qcur-{i}": "model.layers.{i}.self_attn.q_proj"})
    with pytest.raises(ParityError, match=r"dump name 'Qcur-0' was written 2 times .*Qcur-\{i\}#last"):
        map_dump({"Qcur-0": torch.zeros(3, 8), "Qcur-0#1": torch.zeros(3, 8)}, rules.rules, SHAPES, SIZES)


def test_slice_scale_select_and_a_token_axis_of_several_sequences():
    kq = torch.randn(2, 3, 256)  # (heads, seq, cache slots): unscaled, 256 slots
    rules = read_name_map(
        {
            "kq-{i}": {
                "node": "model.layers.{i}.self_attn.scores",
                "ops": [{"slice": [-1, 0, "seq"]}, {"scale": "attention_scale"}],
            }
        }
    )
    tensors, _, _ = map_dump({"kq-0": kq}, rules.rules, SHAPES, SIZES)
    assert torch.equal(tensors["model.layers.0.self_attn.scores"][0], kq[..., :3] * 0.5)
    flat = torch.randn(2 * 3, 8)  # two sequences of 3 tokens on one token axis
    rule = read_name_map({"x": {"node": "n", "ops": [{"reshape": ["batch", "seq", -1]}]}}).rules[0]
    assert torch.equal(apply_ops(flat, rule, "x", {"batch": 2, "seq": 3}), flat.reshape(2, 3, 8))
    rule = read_name_map({"x": {"node": "n", "ops": [{"select": [0, 1]}, {"scale": 2}]}}).rules[0]
    assert torch.equal(apply_ops(flat.reshape(2, 3, 8), rule, "x"), flat.reshape(2, 3, 8)[1] * 2)


def test_the_older_permute_and_reshape_fields_still_work():
    rules = read_name_map({"q": {"node": "model.layers.0.self_attn.q_rot", "permute": [1, 0, 2]}})
    x = torch.randn(3, 2, 4)
    tensors, _, _ = map_dump({"q": x}, rules.rules, SHAPES, SIZES)
    assert torch.equal(tensors["model.layers.0.self_attn.q_rot"][0], x.permute(1, 0, 2))


def test_unavailable_nodes_and_notes_in_a_map_and_in_a_dump_description(tmp_path):
    rules = read_name_map(
        {"@unavailable": {"*.scores": "fused attention"}, "@notes": ["an f16 cache"], "@about": "a comment", "a": "b"}
    )
    assert rules.unavailable_reason("model.layers.3.self_attn.scores") == "fused attention"
    assert rules.unavailable_reason("model.norm") is None and rules.notes == ("an f16 cache",)
    write_dump_info(
        tmp_path, runtime="rt 1.0", name_map={"x": "model.norm"}, unavailable={"*.probs": "fused"}, notes=["n"]
    )
    info = read_dump_info(tmp_path)
    assert info.runtime == "rt 1.0" and info.unavailable == {"*.probs": "fused"} and info.notes == ("n",)
    assert isinstance(info.name_map, NameMap) and info.name_map.rules[0].node == "model.norm"
    assert read_dump_info(tmp_path / "nothing-here").runtime is None


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        (
            {"a": {"node": "n", "ops": [{"twist": 1}]}},
            "ops[0]: unknown op 'twist' (known: reshape, permute, slice, select, scale)",
        ),
        ({"a": {"node": "n", "ops": [{"permute": [0, 0]}]}}, "ops[0]: permute takes an order of the axes, got [0, 0]"),
        ({"a": {"node": "n", "ops": [{"reshape": [-1, -1]}]}}, "reshape [-1, -1] has more than one -1"),
        ({"a": {"node": "n", "ops": [{"reshape": ["tokens"]}]}}, "reshape takes a list of sizes"),
        ({"a": {"node": "n", "ops": [{"slice": [0, 1]}]}}, "slice takes [axis, start, stop]"),
        ({"a": {"node": "n", "ops": [{"scale": "twice"}]}}, "scale takes a number or attention_scale"),
        ({"a": {"node": "n", "ops": [{"reshape": [1], "permute": [0]}]}}, "must be one object with one key"),
        ({"a": {"node": "n", "ops": [], "permute": [0]}}, "give the layout as ops, or as permute/reshape, not both"),
        ({"a-{i}": "model.layers.{i}.x", "a-{i}#{i}": "y"}, "gives the layer twice"),
        ({"a": "model.layers.{i}.x"}, "whose {i} the runtime name does not give"),
        ({"a#2#last": "n"}, "a write is #N, #last or #{i} at the end of the name"),
        ({"@sometimes": {}}, "unknown reserved key '@sometimes'"),
        ({"@unavailable": {"x": 1}}, "must map node names or globs to the reason"),
        ({"a": {"node": "n", "colour": 1}}, "unknown field(s) colour"),
    ],
)
def test_a_wrong_map_is_one_line_naming_the_entry(entry, message):
    with pytest.raises(ParityError) as e:
        read_name_map(entry)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_an_op_that_does_not_fit_the_tensor_names_entry_step_and_shape():
    rule = read_name_map({"kq-0": {"node": "n", "ops": [{"slice": [-1, 0, 300]}]}}).rules[0]
    with pytest.raises(
        ParityError, match=r"entry 'kq-0' cannot apply slice \[-1, 0, 300\] \(step 1\) .* shape \(2, 3, 256\)"
    ):
        apply_ops(torch.zeros(2, 3, 256), rule, "kq-0")


def test_the_llama_cpp_maps_are_valid_name_maps():
    from parity.runtimes.llama_cpp import name_map, names

    table = names()
    assert {"llama", "qwen3", "olmo2", "gemma3"} <= set(table["maps"])
    for arch in table["maps"]:
        rules = read_name_map(name_map(arch))
        nodes = {r.node for r in rules.rules}
        assert "model.layers.{i}.self_attn.q_rot" in nodes and "model.embed_tokens" in nodes, arch
    assert json.dumps(name_map("llama")).count("Qcur") == 2  # the projection (#0) and the rotated result (#last)
    with pytest.raises(ParityError, match=r"no llama\.cpp name map for GGUF architecture 'mamba'"):
        name_map("mamba")
