"""Fault kinds parity was never shown, in user models written by someone who never read ``parity/``.

``tests/user_models/heldout/`` holds three from-scratch models (Llama 3 with a fused ``wqkv`` and
``w13``, norms whose parameter is ``scale``; Qwen3 with ``Wq/Wk/Wv/Wo``, per-head Q/K norms whose
parameter is ``g`` and taps in ``(b, t, h, d)``; Gemma 3 with a fused qkv, ``(1 + w)`` sandwich norms,
soft-capped logits and a head read as ``x @ embedder.weight.T``), each loaded from a tiny random
checkpoint saved here with ``save_pretrained``. A helper wrote them and 49 realistic bugs as a
held-back evaluation (first verdicts: 59% of hints named the cause, 5 named a wrong one, one false
FAIL); the kinds it found missing became detectors, and this file keeps every verdict: each clean
model passes, summation order alone passes, and each bug is found at its node with the hint kind
that names it. The default run checks chained mode with fixed tolerances; ``-m slow`` every case in
both modes (``mode="both"``) under ``check_model``'s default tolerances (the semantic run).
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

import parity
from parity.util.errors import ParityError

sys.path.insert(0, str(Path(__file__).parent / "user_models" / "heldout"))

import heldout_common as C
import heldout_gemma3
import heldout_llama
import heldout_qwen3

MODELS = {"llama": heldout_llama, "qwen3": heldout_qwen3, "gemma3": heldout_gemma3}
L0 = "model.layers.0"
ATT = f"{L0}.self_attn"

#: (model, bug, first failing node, hint kind): the kind a right hint has
FAULTS = [
    ("llama", "rope_theta_wrong", f"{ATT}.q_rot", "rope_theta"),
    ("llama", "rope_k_only", f"{ATT}.q_rot", "rope_missing"),
    ("llama", "rope_interleaved", f"{ATT}.q_rot", "rope_pairing"),
    ("llama", "rope_sign", f"{ATT}.q_rot", "rope_rotation"),
    ("llama", "rope_freq_exponent", f"{ATT}.q_rot", "rope_frequencies"),  # the arange's step of 2 lost, named
    ("llama", "pos_from_1", f"{ATT}.q_rot", "position_offset"),
    ("llama", "eps_wrong", f"{L0}.input_layernorm", "norm_eps"),
    ("llama", "eps_outside_sqrt", f"{L0}.input_layernorm", "norm_eps"),
    ("llama", "ln_not_rms", f"{L0}.input_layernorm", "norm_kind"),
    ("llama", "llama_1pw", f"{L0}.input_layernorm", "norm_weight_offset"),
    ("llama", "gqa_tile", f"{ATT}.scores", "head_mapping"),
    ("llama", "causal_off_by_one", f"{ATT}.probs", "causal_mask"),
    ("llama", "causal_missing", f"{ATT}.probs", "causal_mask"),
    ("llama", "softmax_wrong_axis", f"{ATT}.probs", "softmax_axis"),
    # dropout after the softmax, before the model's own probs tap: the tap is judged (F.dropout in a function)
    ("llama", "attn_dropout_on", f"{ATT}.probs", "dropout"),
    ("llama", "scale_1_over_d", f"{ATT}.scores", "attention_scale"),
    ("llama", "silu_as_gelu", f"{L0}.mlp.down_proj", "activation"),
    ("llama", "gate_up_swapped", f"{L0}.mlp.down_proj", "swapped_roles"),
    ("llama", "residual_missing", f"{L0}.post_attention_layernorm@input", "residual"),
    ("llama", "residual_twice", f"{L0}.post_attention_layernorm@input", "residual"),
    ("llama", "parallel_block", f"{L0}.post_attention_layernorm@input", "block_layout"),
    ("llama", "final_norm_missing", "model.norm", "missing"),
    ("llama", "tie_missed_random_head", "lm_head", "untied_head"),
    ("llama", "bias_added", f"{ATT}.o_proj", "bias"),
    ("llama", "o_weight_transposed", f"{ATT}.o_proj", "transposed_weight"),
    ("llama", "head_merge_no_transpose", f"{ATT}.o_proj", "head_layout"),
    ("llama", "kv_split_order", f"{ATT}.k_rot", "swapped_roles"),
    ("llama", "extra_embed_scale", f"{L0}.input_layernorm", "scale"),
    ("qwen3", "rope_partial_half", f"{ATT}.q_rot", "rope_partial"),
    ("qwen3", "qk_norm_whole_projection", f"{ATT}.q_norm", "norm_kind"),
    ("qwen3", "qk_norm_whole_in_module", f"{ATT}.q_norm", "norm_kind"),
    ("qwen3", "qk_norm_after_rope", f"{ATT}.q_norm", "norm_placement"),
    ("qwen3", "qk_norm_missing", f"{ATT}.q_norm", "missing"),
    ("qwen3", "qk_norm_weights_swapped", f"{ATT}.q_norm", "swapped_weights"),
    ("qwen3", "scale_from_hidden_over_heads", f"{ATT}.scores", "attention_scale"),
    ("gemma3", "gemma_w_not_1pw", f"{L0}.input_layernorm", "norm_weight_offset"),
    ("gemma3", "embed_scale_missing", "model.embed_tokens", "scale"),
    ("gemma3", "ignore_query_pre_attn_scalar", f"{ATT}.scores", "attention_scale"),
    ("gemma3", "window_off_by_one", f"{ATT}.probs", "sliding_window"),
    ("gemma3", "window_missing", f"{ATT}.probs", "sliding_window"),
    ("gemma3", "window_on_full_layer", "model.layers.1.self_attn.probs", "sliding_window"),
    ("gemma3", "softcap_missing", "logits", "softcap"),
    ("gemma3", "softcap_formula", "logits", "softcap"),
    ("gemma3", "gelu_exact_not_tanh", f"{L0}.mlp.down_proj", "activation"),
    ("gemma3", "global_rope_uses_local_theta", "model.layers.1.self_attn.q_rot", "rope_theta"),
    ("gemma3", "post_norm_after_residual", f"{L0}.post_attention_layernorm", "norm_placement"),
]
#: the kinds the held-back evaluation found unnamed or misnamed: checked in the default run too
NEW = {
    "rope_k_only",
    "softmax_wrong_axis",
    "attn_dropout_on",
    "silu_as_gelu",
    "residual_missing",
    "residual_twice",
    "parallel_block",
    "bias_added",
    "head_merge_no_transpose",
    "kv_split_order",
    "extra_embed_scale",
    "qk_norm_whole_projection",
    "qk_norm_whole_in_module",
    "qk_norm_after_rope",
    "softcap_formula",
    "gelu_exact_not_tanh",
    "post_norm_after_residual",
}
#: the last bug of this set without a hint, named in the sixth session (pre/post-norm read from the order each
#: side ran the layer's nodes: ours' later nodes are not kept, their order is)
FAULTS.append(("llama", "post_norm_instead_of_pre", f"{L0}.input_layernorm", "norm_placement"))


def _randomize(model: torch.nn.Module, norm_center: float) -> None:
    """Weights of realistic spread: embedding rows over three orders of magnitude (so eps matters for
    some tokens), projections ~ 1/sqrt(fan_in), norm weights away from their neutral value."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 2 and "embed" in name:
                p.copy_(torch.randn(p.shape, generator=g))
                scales = torch.logspace(-2.5, 0.5, p.shape[0])[torch.randperm(p.shape[0], generator=g)]
                p.mul_(scales[:, None])
            elif p.ndim == 2:
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[1]))
            else:
                p.copy_(norm_center + 0.3 * torch.randn(p.shape, generator=g))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    import transformers as T

    root = tmp_path_factory.mktemp("heldout")
    configs = {
        "llama": (
            T.LlamaForCausalLM,
            T.LlamaConfig(
                vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=512,
                tie_word_embeddings=True,
            ),
            1.0,
        ),
        "qwen3": (
            T.Qwen3ForCausalLM,
            T.Qwen3Config(
                vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=24, rms_norm_eps=1e-6, rope_theta=1000000.0,
                max_position_embeddings=512, tie_word_embeddings=False,
            ),
            1.0,
        ),
        "gemma3": (
            T.Gemma3ForCausalLM,
            T.Gemma3TextConfig(
                vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=1, head_dim=16, rms_norm_eps=1e-6, query_pre_attn_scalar=32, sliding_window=8,
                layer_types=["sliding_attention", "full_attention"], rope_theta=1000000.0,
                rope_local_base_freq=10000.0, final_logit_softcapping=3.0, max_position_embeddings=512,
                tie_word_embeddings=True, hidden_activation="gelu_pytorch_tanh",
            ),
            0.0,
        ),
    }  # fmt: skip
    out = {}
    for name, (cls, config, norm_center) in configs.items():
        torch.manual_seed(0)
        model = cls(config).eval()
        _randomize(model, norm_center)
        model.save_pretrained(root / name)
        out[name] = root / name
    return out


@pytest.fixture
def bug(request):
    """Sets the one bug the held-out models inject (module state they read), and clears it after."""
    C.BUG, C.SUMORDER = request.param if isinstance(request.param, tuple) else (request.param, False)
    yield C.BUG
    C.BUG, C.SUMORDER = None, False


def check(model: str, checkpoints, dtype=torch.float32, **kw):
    return parity.check_model(MODELS[model].build, reference=str(checkpoints[model]), dtype=dtype, seq_len=24, **kw)


def logits_agree(model: str, checkpoints, dtype) -> bool:
    """The independent check, no parity involved: our logits against Transformers' own (eager), in
    float32 within 1e-5 of their scale; in bfloat16 within 4x the reference's own bfloat16 error
    against its float32 logits (a summation order of its own rounds as much as the reference's)."""
    from transformers import AutoModelForCausalLM

    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(3))

    def logits(d):
        ref = AutoModelForCausalLM.from_pretrained(checkpoints[model], dtype=d, attn_implementation="eager").eval()
        ours = MODELS[model].build({k: v.detach().clone() for k, v in ref.state_dict().items()}, ref.config)
        with torch.no_grad():
            return ours(ids).double(), ref(ids).logits.double()

    ours32, ref32 = logits(torch.float32)
    if dtype == torch.float32:
        return float((ours32 - ref32).abs().max()) <= 1e-5 * float(ref32.abs().max())
    ours16, ref16 = logits(dtype)
    return float((ours16 - ref32).abs().max()) <= 4 * float((ref16 - ref32).abs().max())


@pytest.mark.parametrize("bug", [(None, False), (None, True)], indirect=True, ids=["clean", "summation-order"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("model", list(MODELS))
def test_a_correct_model_passes(model, dtype, bug, checkpoints):
    assert logits_agree(model, checkpoints, dtype)
    res = check(model, checkpoints, dtype, mode="chained")
    assert res.passed, res.verdict()


@pytest.mark.parametrize("bug", ["head_read_through_root_attribute", "clean_embed_prescaled"], indirect=True)
def test_a_head_computed_in_forward_before_a_soft_cap_is_no_false_failure(bug, checkpoints):
    """The tied head read as ``x @ self.head_w.T`` in forward, then soft-capped: the head's product is no
    module's output; lm_head is untapped with the reason, and what forward returns is still compared."""
    assert logits_agree("gemma3", checkpoints, torch.float32)
    res = check("gemma3", checkpoints, mode="chained")
    assert res.passed, res.verdict()
    head = next(a for a in res.alignment if a.node == "lm_head")
    assert head.how == "unaligned" and "soft-caps the logits after it" in head.detail
    assert any(n.name == "logits" and n.status == "ok" for n in res.nodes)


def _located(res, node: str, kind: str, modes=("chained",)) -> None:
    firsts = {"chained": res.first_mismatch, "isolated": res.first_isolated_mismatch}
    for mode in modes:
        bad = firsts[mode]
        assert bad is not None and bad.name == node, (mode, bad.name if bad else None, res.verdict())
        assert bad.hint is not None and bad.hint.kind == kind, (mode, bad.hint)


@pytest.mark.parametrize(
    ("model", "bug", "node", "kind"), [f for f in FAULTS if f[1] in NEW], indirect=["bug"], ids=str
)
def test_a_new_fault_kind_is_found_with_its_hint(model, bug, node, kind, checkpoints):
    _located(check(model, checkpoints, mode="chained", semantic=False), node, kind)


@pytest.mark.slow
@pytest.mark.parametrize(("model", "bug", "node", "kind"), FAULTS, indirect=["bug"], ids=str)
def test_every_held_back_fault_is_found_with_its_hint_in_both_modes(model, bug, node, kind, checkpoints):
    _located(check(model, checkpoints, mode="both"), node, kind, modes=("chained", "isolated"))


@pytest.mark.parametrize("bug", ["q_weight_transposed"], indirect=True)
def test_a_weight_transposed_before_fusing_is_refused_naming_it(bug, checkpoints):
    with pytest.raises(ParityError, match=r"with model\.layers\.0\.self_attn\.q_proj\.weight transposed"):
        check("llama", checkpoints, mode="chained")
