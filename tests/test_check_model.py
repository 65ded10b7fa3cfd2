"""parity.check_model: three user models written independently of reference_pairs/ (tests/user_models/,
each in its own style and loader convention) are aligned to the reference by the weights they hold,
pass clean, and have an injected bug located at the right node with the right hint kind, in chained
and isolated mode."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import parity
import parity.build
from parity.cli import main
from parity.user.check_model import build_user_pair

USER_MODELS = Path(__file__).parent / "user_models"
sys.path.insert(0, str(USER_MODELS))

import book_olmo3  # noqa: E402  (book style: trf_blocks, att.W_query, copying loader)
import litgpt_llama  # noqa: E402  (litgpt style: transformer.h, fused qkv, load_state_dict)
import meta_tiny_aya  # noqa: E402  (Meta style: layers.i.attention.wq, complex RoPE, assigning loader)

MODELS = {
    "book_olmo3": (book_olmo3, "olmo3:yarn"),
    "litgpt_llama": (litgpt_llama, "llama3"),
    "meta_tiny_aya": (meta_tiny_aya, "tiny_aya"),
}
#: functional nodes each model neither taps nor computes where parity reads them (none: what it does not
#: tap, parity reads from the functions its attention calls)
UNTAPPED_KINDS = {
    "book_olmo3": set(),
    "litgpt_llama": set(),
    "meta_tiny_aya": set(),
}


@pytest.mark.parametrize("name", MODELS)
def test_user_model_passes_chained_and_isolated(name):
    module, reference = MODELS[name]
    res = parity.check_model(module.build, reference, mode="both")
    assert res.passed, res.verdict()
    assert res.first_isolated_mismatch is None
    untapped = {n.kind for n in res.nodes if n.status == "untapped"}
    assert untapped == UNTAPPED_KINDS[name]
    assert all(n.status in ("ok", "untapped") for n in res.nodes)
    assert all(row.ours is not None for row in res.alignment)  # every reference node found a place
    assert res.coverage.ok, res.coverage.gaps


def rows(res) -> dict[str, parity.user.check_model.Aligned]:
    return {r.node: r for r in res.alignment}


def test_book_model_aligns_by_copied_weights_and_taps():
    res = parity.check_model(book_olmo3.build, "olmo3:yarn")
    a = rows(res)
    assert (
        a["model.layers.3.self_attn.q_proj"].ours == "trf_blocks.3.att.W_query"
        and a["model.layers.3.self_attn.q_proj"].how == "weights"
    )
    assert "copy" in a["model.layers.3.self_attn.q_proj"].detail  # a copying loader, found by value
    assert a["model.layers.3.post_attention_layernorm"].ours == "trf_blocks.3.norm1"  # norms by their weight vectors
    assert a["model.layers.3.mlp@input"].ours == "trf_blocks.3.ff@input"  # containers through their children
    assert a["model.layers.3"].ours == "trf_blocks.3"
    assert a["model.layers.3.self_attn.q_rot"].ours == "tap:trf_blocks.3.att.q_rot"
    assert a["lm_head"].ours == "out_head"


def test_litgpt_fused_qkv_is_compared_through_its_rows_and_the_tied_head_is_found():
    res = parity.check_model(litgpt_llama.build, "llama3", mode="both")
    a = rows(res)
    for proj in ("q_proj", "k_proj", "v_proj"):
        row = a[f"model.layers.1.self_attn.{proj}"]
        assert row.ours == "transformer.h.1.attn.qkv" and row.how == "fused rows"
    assert a["lm_head"].ours == "lm_head" and a["model.embed_tokens"].ours == "transformer.wte"
    conversions = " ".join(res.coverage.conversions)
    assert "model.layers.1.self_attn.k_proj.weight: rows 64..95 of transformer.h.1.attn.qkv.weight" in conversions
    assert any("one Parameter" in t for t in res.coverage.tied)


def test_fused_rows_in_any_order_are_found(monkeypatch):
    """litgpt's real layout interleaves q, k, v per query group; rows are matched by value, not position."""
    original = litgpt_llama.convert_hf_checkpoint

    def interleaved(sd, config):
        out = original(sd, config)
        for key in [k for k in out if k.endswith("attn.qkv.weight")]:
            out[key] = out[key].flip(0)  # any permutation of rows
        return out

    monkeypatch.setattr(litgpt_llama, "convert_hf_checkpoint", interleaved)
    res = parity.check_model(litgpt_llama.build, "llama3")
    assert rows(res)["model.layers.0.self_attn.q_proj"].how == "fused rows"
    assert res.coverage.ok
    # the forward still splits [q; k; v] by position, so q_proj itself agrees (rows) but the rotation input does not
    assert res.first_mismatch.name == "model.layers.0.self_attn.q_rot"


def test_book_olmo3_with_yarn_on_every_layer_is_found_at_layer0_q_rot(monkeypatch):
    """Transformers 5 puts YaRN on full_attention layers only; this user applies it everywhere."""
    correct = book_olmo3.compute_rope_params
    monkeypatch.setattr(book_olmo3, "compute_rope_params", lambda cfg, layer_type: correct(cfg, "full_attention"))
    res = parity.check_model(book_olmo3.build, "olmo3:yarn", mode="both")
    for bad in (res.first_mismatch, res.first_isolated_mismatch):
        assert bad.name == "model.layers.0.self_attn.q_rot"
        assert bad.hint.kind == "rope_layer_type"
        assert "full_attention" in bad.hint.text and "1.20794" in bad.hint.text


def test_litgpt_without_llama3_scaling_is_found_at_layer0_q_rot(monkeypatch):
    monkeypatch.setattr(litgpt_llama, "llama3_adjust_inv_freq", lambda inv_freq, adj: inv_freq)
    res = parity.check_model(litgpt_llama.build, "llama3", mode="both")
    for bad in (res.first_mismatch, res.first_isolated_mismatch):
        assert bad.name == "model.layers.0.self_attn.q_rot" and bad.hint.kind == "rope_scaling"


def test_meta_tiny_aya_rotating_its_nope_layer_is_found_at_that_layers_q_rot(monkeypatch):
    init = meta_tiny_aya.Attention.__init__

    def rope_everywhere(self, args, layer_id):
        init(self, args, layer_id)
        self.use_rope = True

    monkeypatch.setattr(meta_tiny_aya.Attention, "__init__", rope_everywhere)
    res = parity.check_model(meta_tiny_aya.build, "tiny_aya", mode="both")
    for bad in (res.first_mismatch, res.first_isolated_mismatch):
        assert bad.name == "model.layers.3.self_attn.q_rot" and bad.hint.kind == "rope_unexpected"
    isolated = [n.name for n in res.isolated if n.failed]
    assert isolated and all(n.startswith("model.layers.3.self_attn.") for n in isolated)


def test_a_tap_whose_sequence_length_equals_the_head_count_is_read_as_declared(monkeypatch):
    """(batch, seq, heads, head_dim) and (batch, heads, seq, head_dim) have one shape when seq = heads
    (the tiny config has 4 query heads): a declared layout is compared as declared; an undeclared one
    as (batch, heads, seq, head_dim), which fails a (batch, seq, heads, head_dim) tap with a hint that
    names the fix, unless the tap showed its layout on an earlier call of another length."""
    declared = parity.check_model(meta_tiny_aya.build, "tiny_aya", seq_len=4, mode="both")
    assert declared.passed, declared.verdict()
    assert next(n for n in declared.nodes if n.name == "model.layers.0.self_attn.q_rot").status == "ok"

    tap = parity.tap
    monkeypatch.setattr(meta_tiny_aya.parity, "tap", lambda t, name, layout=None: tap(t, name))
    undeclared = parity.check_model(meta_tiny_aya.build, "tiny_aya", seq_len=4)
    bad = undeclared.first_mismatch
    assert bad.name == "model.layers.0.self_attn.q_rot" and bad.hint.kind == "tap_layout"
    assert "layout='bshd'" in bad.hint.text
    # any other length is read from the shape; after one, the same pair reads seq_len = heads alike
    pair = build_user_pair(meta_tiny_aya.build, "tiny_aya")
    assert parity.check(pair, seq_len=5).passed
    assert parity.check(pair, seq_len=4).passed

    # a wrong declaration is compared as declared (q: heads and positions swap places), or refused
    # where the shape cannot hold it (k has 2 heads, not 4 positions)
    wrong_q = lambda t, name, layout=None: tap(t, name, layout="bhsd" if name == "q_rot" else "bshd")
    monkeypatch.setattr(meta_tiny_aya.parity, "tap", wrong_q)
    wrong = parity.check_model(meta_tiny_aya.build, "tiny_aya", seq_len=4)
    assert (
        wrong.first_mismatch.name == "model.layers.0.self_attn.q_rot" and wrong.first_mismatch.hint.kind == "tap_layout"
    )
    monkeypatch.setattr(meta_tiny_aya.parity, "tap", lambda t, name, layout=None: tap(t, name, layout="bhsd"))
    with pytest.raises(
        parity.ParityError, match=r"'k_rot', layout='bhsd'\): shape \(1, 4, 2, 8\) does not fit bhsd with 2 heads"
    ):
        parity.check_model(meta_tiny_aya.build, "tiny_aya", seq_len=4)
    monkeypatch.setattr(meta_tiny_aya.parity, "tap", lambda t, name, layout=None: tap(t, name, layout="sbhd"))
    with pytest.raises(parity.ParityError, match="layout must be one of bhsd, bshd, bsf"):
        parity.check_model(meta_tiny_aya.build, "tiny_aya", seq_len=4)


def test_node_map_overrides_the_alignment():
    """No context tap in the litgpt model: compare it as the input of the output projection instead."""
    res = parity.check_model(
        litgpt_llama.build, "llama3", node_map={"model.layers.0.self_attn.context": "transformer.h.0.attn.proj@input"}
    )
    row = rows(res)["model.layers.0.self_attn.context"]
    assert row.how == "override"
    assert next(n for n in res.nodes if n.name == row.node).status == "ok"


def test_reference_given_as_a_checkpoint_folder_or_a_model(tmp_path):
    from reference_pairs.llama3 import build_pair

    reference = build_pair("tiny").reference
    reference.save_pretrained(tmp_path / "ckpt")
    for ref in (tmp_path / "ckpt", reference, reference.config):
        res = parity.check_model(litgpt_llama.build, ref)
        assert res.passed, (type(ref).__name__, res.verdict())


# --- bad input: one line naming the problem


def test_build_that_raises_is_bad_input():
    def build(state_dict, hf_config):
        raise KeyError("model.norm.weight")

    with pytest.raises(
        parity.ParityError, match=r"build .*build\(state_dict, hf_config\) raised KeyError: model.norm.weight"
    ):
        parity.check_model(build, "llama3")


def test_build_returning_something_else_is_bad_input():
    with pytest.raises(parity.ParityError, match=r"returned dict, not a torch\.nn\.Module"):
        parity.check_model(lambda sd, cfg: {}, "llama3")


def test_a_reference_tensor_left_unused_is_named():
    def build(state_dict, hf_config):
        model = litgpt_llama.build(state_dict, hf_config)
        model.transformer.ln_f.weight = nn.Parameter(torch.ones_like(model.transformer.ln_f.weight))
        return model

    with pytest.raises(
        parity.ParityError,
        match=r"reference tensor\(s\) model\.norm\.weight are in no parameter or buffer of your model.*"
        r"holding only zeros or ones: transformer\.ln_f\.weight",
    ):
        parity.check_model(build, "llama3")


class Flat(nn.Module):
    """Every tensor in one ParameterDict: nothing module-shaped to align."""

    def __init__(self, state_dict):
        super().__init__()
        self.p = nn.ParameterDict({k.replace(".", "_"): nn.Parameter(v.clone()) for k, v in state_dict.items()})

    def forward(self, input_ids, attention_mask=None):
        return self.p["model_embed_tokens_weight"][input_ids]


def test_a_model_of_plain_parameters_is_aligned_by_the_ops_reading_them():
    """Every tensor in one ParameterDict (Granite-style user code computes everything in functions): the
    nodes are the ops reading each weight; the ones this forward never reads stay untapped, and the
    verdict says how many."""
    res = parity.check_model(lambda sd, cfg: Flat(sd), "llama3")
    assert not res.passed
    assert "34 of 36 reference nodes untapped" in res.verdict(), res.verdict()
    assert {a.how for a in res.alignment if a.node.endswith(("q_proj", "down_proj", "embed_tokens"))} == {"functional"}


def test_an_unalignable_model_says_what_could_not_be_aligned_and_why():
    class Empty(nn.Module):  # holds the weights in no parameter at all: nothing can be aligned
        def __init__(self, state_dict):
            super().__init__()
            self.register_buffer("table", state_dict["model.embed_tokens.weight"].clone(), persistent=False)

        def forward(self, input_ids, attention_mask=None):
            return self.table[input_ids]

    with pytest.raises(parity.ParityError, match=r"model.layers.0.self_attn.q_proj.weight"):
        parity.check_model(lambda sd, cfg: Empty(sd), "llama3")


# --- CLI and pytest


def test_cli_check_ours_and_align(tmp_path, capsys):
    spec = f"{USER_MODELS / 'litgpt_llama.py'}:build"
    assert (
        main(["check", "--ours", spec, "--reference", "llama3", "--report-dir", str(tmp_path), "--format", "json"]) == 0
    )
    out = capsys.readouterr().out
    assert "PASS: all 36 nodes agree" in out and "untapped" not in out  # sdpa's arguments give the rest
    (folder,) = [p for p in tmp_path.iterdir() if not p.name.startswith(".")]
    result = json.loads((folder / "result.json").read_text())
    assert result["counts"] == {"ok": 36}
    assert main(["align", "--ours", spec, "--reference", "llama3"]) == 0
    out = capsys.readouterr().out
    assert (
        "transformer.h.0.attn.qkv" in out
        and "fused rows" in out
        and "36 aligned (10 expect a parity.tap call), 0 unaligned" in out
    )


@pytest.mark.parametrize(
    "argv, message",
    [
        (["check", "--ours", "nosuchmodule_xyz:build"], "--ours: cannot import nosuchmodule_xyz: ModuleNotFoundError"),
        (["check", "--ours", "no_colon"], "must be module:function or path/to/file.py:function"),
        (["check", "--ours", f"{USER_MODELS / 'litgpt_llama.py'}:nope"], "has no attribute 'nope'"),
        (
            ["check", "--ours", f"{USER_MODELS / 'litgpt_llama.py'}:build", "--reference", "nosuch"],
            "unknown family 'nosuch'",
        ),
        (
            ["check", "--ours", f"{USER_MODELS / 'litgpt_llama.py'}:build", "--config", "tiny"],
            "--config does not apply with --ours",
        ),
        (["check"], "name a family"),
    ],
)
def test_cli_bad_user_model_input_exit_2(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err


def test_parity_model_fixture(parity_model):
    parity.assert_parity(parity_model(meta_tiny_aya.build, "tiny_aya", mode="both"))


def test_assert_bit_exact_holds_our_pairs_to_the_last_bit_and_a_user_model_to_its_tolerance():
    """A model in another rounding order passes at float32 tolerance but is not bit-exact; our pair is."""
    res = parity.check_model(litgpt_llama.build, "llama3")
    assert parity.assert_parity(res) is res
    assert any((n.max_abs or 0.0) > 0 for n in res.nodes)
    with pytest.raises(AssertionError, match="not bit-exact at"):
        parity.assert_bit_exact(res)
    from parity.model.registry import get_family

    exact = parity.assert_bit_exact(parity.build.build_pair(get_family("llama3")))
    assert all(n.max_abs == 0.0 and n.atol == 0.0 for n in exact.nodes)


# --- what forward returns is judged, not only the modules' outputs


class _Returning(nn.Module):
    """A correct model whose forward returns something else than its logits (every module agrees)."""

    def __init__(self, inner: nn.Module, kind: str):
        super().__init__()
        self.inner, self.kind = inner, kind

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        logits = self.inner(input_ids, attention_mask=attention_mask)
        return {
            "zeros": torch.zeros_like(logits),
            "doubled": logits * 2,
            "none": None,
            "hidden-first": (logits[..., :8], logits),
            "transposed": logits.transpose(0, 1),
            "logits-first": (logits, "a cache"),
        }[self.kind]


@pytest.mark.parametrize("kind", ["zeros", "doubled", "none", "hidden-first", "transposed"])
def test_a_wrong_returned_value_fails_at_the_logits_node_though_every_module_agrees(kind):
    res = parity.check_model(lambda sd, cfg: _Returning(litgpt_llama.build(sd, cfg), kind), "llama3", batch_size=2)
    assert not res.passed, res.verdict()
    bad = res.first_mismatch
    assert bad.name == "logits" and bad.index == len(res.nodes) - 1  # after every module
    assert all(n.status in ("ok", "untapped") for n in res.nodes if n.name != "logits")
    assert bad.status == {"none": "missing", "hidden-first": "shape", "transposed": "shape"}.get(kind, "mismatch")


def test_a_tuple_whose_first_item_is_the_logits_passes():
    res = parity.check_model(lambda sd, cfg: _Returning(litgpt_llama.build(sd, cfg), "logits-first"), "llama3")
    assert res.passed, res.verdict()


@pytest.mark.parametrize("family", ["olmo3", "llama3"])
def test_every_family_compares_what_its_forward_returns(family):
    from parity.model.registry import get_family

    pair = parity.build.build_pair(get_family(family))
    assert pair.nodes[-1].name == "logits" and pair.nodes[-1].ours == "" and pair.nodes[-1].reference_path == ""
    pair.ours.forward = lambda *a, _f=pair.ours.forward, **k: _f(*a, **k) * 2
    res = parity.check(pair)
    assert res.first_mismatch.name == "logits"


@pytest.mark.parametrize("where", ["build", "forward"])
@pytest.mark.parametrize("exit_with", [SystemExit(0), SystemExit(3), KeyboardInterrupt()])
def test_user_code_that_exits_is_one_line_and_a_nonzero_exit(where, exit_with, tmp_path, capsys):
    module = tmp_path / "exiting.py"
    module.write_text(
        f"import sys\nsys.path.insert(0, {str(USER_MODELS)!r})\nimport litgpt_llama\n\n"
        + f"def leave():\n    raise {exit_with!r}\n\n"
        + "def build(sd, cfg):\n"
        + (
            "    leave()\n"
            if where == "build"
            else "    model = litgpt_llama.build(sd, cfg)\n    model.forward = lambda *a, **k: leave()\n    return model\n"
        )
    )
    code = main(["check", "--ours", f"{module}:build", "--reference", "llama3", "--report-dir", str(tmp_path / "r")])
    out = capsys.readouterr()
    assert code == 2, out
    text = " ".join((out.out + out.err).split())
    assert ("build " if where == "build" else "forward") in text and type(exit_with).__name__ in text
    assert "Traceback" not in out.out + out.err
