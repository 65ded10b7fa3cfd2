"""The semantic run (parity.run.semantic): a user's model that is not bit-exact is judged in float64
first, where a difference of formula keeps its size and rounding is near 1e-15, then in its own dtype
within 10x the reference's own error.

What a user relies on: a model that differs from Transformers only by the order of its roundings
passes in float32 and bfloat16; an eps of 1e-5 instead of 1e-6 (a post-norm, a per-head q/k norm) is
found at its norm with a norm_eps hint, although it moves the logits by less than the default
tolerances would see; the float64 run is float64 on both sides (tables a model derives are derived in
float64 too), or it says why not.
"""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest
import torch

import parity
from parity.run.float64 import Float64Mode, float64_state_dict
from parity.util.rounding import rounded

sys.path.insert(0, str(Path(__file__).parent / "user_models"))

import book_olmo3  # (a copying loader, norms and RoPE in float32 like the book)
import conv_gemma3_scale  # (norm scales kept as 1 + w, embedding scaled outside its module)
import conv_meta_llama  # (Meta's permuted q/k and complex RoPE: never bit-exact)


@pytest.fixture
def gemma_bug():
    """Set ``conv_gemma3_scale.BUG`` for one test."""

    def set_bug(bug):
        conv_gemma3_scale.BUG = bug

    yield set_bug
    conv_gemma3_scale.BUG = None


def rule_of(res) -> str:
    return next(n for n in res.notes if n.startswith("semantic run:"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_model_that_differs_only_in_rounding_passes(dtype):
    """Meta-style Llama rounds differently (complex RoPE, another matmul order) but computes the same
    formula: the semantic run (the default for a user's model) passes it and says it saw rounding."""
    res = parity.check_model(conv_meta_llama.build, "llama3", dtype=dtype)
    assert res.passed, res.verdict()
    assert "both models rebuilt in float64" in rule_of(res)
    assert any(n.startswith("rounding: ") for n in res.notes)
    # the claim is not vacuous: the same model is not bit-exact in this dtype
    exact = parity.check_model(conv_meta_llama.build, "llama3", dtype=dtype, exact=True, semantic=False)
    assert not exact.passed


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_post_norm_eps_of_1e_5_instead_of_1e_6_is_found_at_its_norm(gemma_bug, dtype):
    gemma_bug("post_norm_eps")
    res = parity.check_model(conv_gemma3_scale.build, "gemma3", dtype=dtype, mode="both")
    for bad in (res.first_mismatch, res.first_isolated_mismatch):
        assert bad.name == "model.layers.0.post_attention_layernorm"
        assert bad.tol_source == "semantic"
        assert bad.hint is not None and bad.hint.kind == "norm_eps", bad.hint
        assert (
            abs(bad.hint.evidence["eps_ours"] - 1e-5) < 1e-7 and abs(bad.hint.evidence["eps_reference"] - 1e-6) < 1e-8
        )
    # the fixed default tolerances would not name it: it surfaces downstream, without a hint
    fixed = parity.check_model(conv_gemma3_scale.build, "gemma3", dtype=dtype, semantic=False)
    assert fixed.passed or fixed.first_mismatch.name != "model.layers.0.post_attention_layernorm"


def test_a_per_head_qk_norm_eps_is_found_at_q_norm(monkeypatch):
    original = book_olmo3.build

    def build(state_dict, hf_config):
        model = original(state_dict, hf_config)
        for block in model.trf_blocks:
            block.att.q_norm.eps = 1e-5
        return model

    res = parity.check_model(build, "olmo3:yarn")
    bad = res.first_mismatch
    assert bad.name == "model.layers.0.self_attn.q_norm" and bad.hint.kind == "norm_eps"


def test_a_clean_gemma_with_scales_kept_as_1_plus_w_passes(gemma_bug):
    gemma_bug(None)
    res = parity.check_model(conv_gemma3_scale.build, "gemma3", mode="both")
    assert res.passed, res.verdict()
    assert res.first_isolated_mismatch is None


def test_a_model_given_as_a_module_is_judged_on_float64_copies_and_says_so():
    from parity.build.reference import resolve_reference

    ref, _ = resolve_reference("olmo3:yarn")
    model = book_olmo3.build(ref.state_dict, ref.hf_config)
    res = parity.check_model(model, "olmo3:yarn")
    assert res.passed, res.verdict()
    assert "both models copied in float64" in rule_of(res)
    assert any("float64 copies of both models: ours was given as a module" in n for n in res.notes)


def test_a_build_that_cannot_run_in_float64_falls_back_to_copies_and_says_why():
    def build(state_dict, hf_config):
        if next(iter(state_dict.values())).dtype == torch.float64:
            raise ValueError("only float32 checkpoints")
        return book_olmo3.build(state_dict, hf_config)

    res = parity.check_model(build, "olmo3:yarn")
    assert res.passed, res.verdict()
    assert any(
        "rebuilding it in float64 failed" in n and "raised ValueError: only float32 checkpoints" in n for n in res.notes
    )


def test_a_model_that_stays_float32_when_rebuilt_falls_back_to_copies():
    def build(state_dict, hf_config):
        return book_olmo3.build({k: v.float() for k, v in state_dict.items()}, hf_config)

    # Float64Mode keeps .float() in float64, so this one does rebuild in float64; a model that
    # builds its parameters from numpy float32 does not
    res = parity.check_model(build, "olmo3:yarn")
    assert res.passed and "rebuilt" in rule_of(res)

    def numpy_build(state_dict, hf_config):
        model = book_olmo3.build(state_dict, hf_config)
        weight = model.final_norm.weight.detach().numpy().astype("float32")
        model.final_norm.weight = torch.nn.Parameter(torch.from_numpy(weight))
        return model

    res = parity.check_model(numpy_build, "olmo3:yarn")
    assert any("still holds another dtype (final_norm.weight is float32)" in n for n in res.notes), res.notes


def test_float64_mode_keeps_every_cast_to_a_low_float_in_float64():
    with Float64Mode():
        assert torch.get_default_dtype() == torch.float64
        assert torch.arange(0, 8, 2).float().dtype == torch.float64  # an integer tensor's .float()
        assert torch.ones(2, dtype=torch.float32).dtype == torch.float64
        assert torch.ones(2).to(torch.bfloat16).dtype == torch.float64
        assert torch.softmax(torch.ones(2), -1, dtype=torch.float32).dtype == torch.float64
        assert torch.tensor(0.5).dtype == torch.float64
    assert torch.get_default_dtype() == torch.float32


def test_a_detectors_rounding_through_bfloat16_rounds_inside_the_float64_mode():
    """A diagnosis form that models a narrower dtype (the routing weights "rounded through bfloat16") must round
    although the semantic run's comparison runs inside the mode; the cast after it stays float64 again."""
    x = torch.tensor([1 / 3, 2 / 3, 0.1], dtype=torch.float64)
    expected = x.to(torch.bfloat16).double()
    assert not torch.equal(expected, x)
    with Float64Mode():
        y = rounded(x, torch.bfloat16)
        assert torch.ones(2).to(torch.bfloat16).dtype == torch.float64
    assert y.dtype == torch.float64 and torch.equal(y, expected)


def test_a_float64_state_dict_keeps_ties_and_views():
    w = torch.randn(6, 4)
    sd = {"a": w, "b": w, "q": w[:2], "k": w[2:], "ids": torch.arange(3)}
    out = float64_state_dict(sd)
    assert out["a"].dtype == torch.float64 and out["a"] is not w
    assert out["a"].untyped_storage().data_ptr() == out["b"].untyped_storage().data_ptr()
    assert out["q"].untyped_storage().data_ptr() == out["a"].untyped_storage().data_ptr()
    assert torch.equal(out["k"], w[2:].double()) and out["ids"] is sd["ids"]


def test_semantic_on_the_command_line(capsys, tmp_path):
    from parity.cli import main

    code = main(["check", "olmo3", "--semantic", "--report-dir", str(tmp_path), "--format", "json"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "semantic run: both models copied in float64" in out
    assert main(["check", "olmo3", "--semantic", "--exact"]) == 2
    assert "--semantic sets each node's tolerance itself" in capsys.readouterr().err


def _bf16_norm(self, x):  # RMSNorm without the float32 upcast
    x = x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + self.eps)
    return self.weight * x


def test_a_norm_computed_in_bfloat16_is_rounding_by_this_rule():
    """A limit, stated: a cast that changes only the rounding (a norm in bfloat16 instead of float32)
    computes the same formula in float64; on these widths its error stays within 10x the reference's
    own (about 2x here), so the precision pass counts it as rounding. --exact on a bit-exact pair, or
    a wider model, is what sees it."""

    def build(state_dict, hf_config):
        model = book_olmo3.build(state_dict, hf_config)
        for module in model.modules():
            if isinstance(module, book_olmo3.RMSNorm):
                module.forward = types.MethodType(_bf16_norm, module)
        return model

    res = parity.check_model(build, "olmo3:yarn", dtype=torch.bfloat16)
    assert res.passed
    assert any(n.startswith("rounding: ") for n in res.notes)


def test_a_forward_that_cannot_run_in_float64_is_judged_in_the_run_dtype_and_says_why():
    """An op with no float64 kernel (torch's grouped matmul, a fused kernel) in ours: the semantic run cannot run,
    the check falls back to the run's dtype with its tolerances and says so in one line."""

    class Float32Only(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, in_idx, attention_mask=None):
            if self.inner.tok_emb.weight.dtype == torch.float64:
                raise RuntimeError("Expected mat_a to be Float32, BFloat16 or Float16 matrix, got Double")
            return self.inner(in_idx, attention_mask=attention_mask)

    res = parity.check_model(lambda sd, cfg: Float32Only(book_olmo3.build(sd, cfg)), "olmo3:yarn")
    assert res.passed, res.verdict()
    note = next(n for n in res.notes if n.startswith("the float64 semantic run could not run"))
    assert "got Double" in note and note.endswith("judged in the run's dtype alone")
