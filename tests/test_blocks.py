"""The shared building blocks against the Transformers classes they claim to match, bit for bit,
in float32 and bfloat16 — above all the variants no built-in family uses yet ((1 + w) RMSNorm,
LayerNorm with bias, GELU-tanh MLPs, soft-cap, output gate, partial rotary, the sandwich layout).
Transformers modules are instantiated directly here (tests may import Transformers; models may not)."""

from __future__ import annotations

from functools import partial

import pytest
import torch
from torch import nn

from reference_pairs.common.attention import GroupedQueryAttention, causal_mask, soft_cap
from reference_pairs.common.blocks import ParallelBlock, PostNormBlock, PreNormBlock, SandwichBlock
from reference_pairs.common.decoder import DecoderModel, TokenEmbedding
from reference_pairs.common.layer_types import FULL, SLIDING
from reference_pairs.common.mlp import MLP, GatedMLP, gelu_tanh_formula
from reference_pairs.common.norms import LayerNorm, RMSNorm
from reference_pairs.common.rope import rope_cos_sin, rope_init

DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
SEQ = 9


def randomize(module: nn.Module, seed: int = 0) -> nn.Module:
    """Every parameter redrawn (norm weights near their neutral value, others small), so a wrong
    formula (``w`` for ``1 + w``, a missing bias) shows."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if (p.dim() == 1 and "norm" in name) or "ln_" in name:
                p.copy_(p + 0.1 * noise)  # ones stay near one, zeros near zero
            elif p.dim() == 1:
                p.copy_(0.02 * noise)
            else:
                p.copy_(noise * p.shape[-1] ** -0.5)
    return module


def transplant(ours: nn.Module, theirs: nn.Module, renames: dict[str, str], transpose: tuple[str, ...] = ()) -> None:
    """Load ``theirs``' parameters into ``ours``: key substrings renamed, listed keys transposed
    (Conv1D), every key of both used (strict). A transposed weight is assigned as a view of theirs,
    as the GPT-2 loader assigns it: ``nn.Linear`` then multiplies by the same ``(in, out)`` memory
    Conv1D's ``addmm`` reads (a packed copy of the transpose takes another BLAS kernel, which rounds
    otherwise on some CPUs). The rest is copied."""
    state = {}
    views = set()
    for key, value in theirs.state_dict().items():
        if key.endswith("embed_scale"):
            continue
        transposed = any(key.startswith(t) for t in transpose) and value.dim() == 2
        for old, new in renames.items():
            key = key.replace(old, new)
        state[key] = value.t() if transposed else value
        if transposed:
            views.add(key)
    ours.load_state_dict({k: v for k, v in state.items() if k not in views}, strict=False)
    for key in views:
        module, _, name = key.rpartition(".")
        setattr(ours.get_submodule(module), name, nn.Parameter(state[key], requires_grad=False))
    missing = set(ours.state_dict()) - set(state)
    assert not missing, f"transplant left {sorted(missing)} unwritten"


def inputs(shape, dtype, seed=1) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def additive_mask(seq_len: int, dtype: torch.dtype, window: int | None = None) -> torch.Tensor:
    """The eager additive mask ``(1, 1, q, k)``: 0 where allowed, the dtype's lowest value elsewhere."""
    allowed = causal_mask(seq_len, window)
    return torch.zeros(seq_len, seq_len, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)[None, None]


def half_split_tables(params: dict, head_dim: int, dtype: torch.dtype):
    """Our tables ``(seq, rotary_dim // 2)`` in ``dtype`` and the reference's ``(1, seq, rotary_dim)``."""
    inv_freq, factor = rope_init(params, head_dim)
    cos, sin = (t.to(dtype) for t in rope_cos_sin(inv_freq, SEQ, factor))
    return (cos, sin), (torch.cat([cos, cos], -1)[None], torch.cat([sin, sin], -1)[None])


ATTENTION_NAMES = {"q_proj": "W_query", "k_proj": "W_key", "v_proj": "W_value", "o_proj": "out_proj"}


# --- norms ------------------------------------------------------------------------------------


@DTYPES
@pytest.mark.parametrize(
    "reference, options",
    [
        ("olmo3.modeling_olmo3.Olmo3RMSNorm", {}),
        ("llama.modeling_llama.LlamaRMSNorm", {"cast_first": True}),
        ("qwen3.modeling_qwen3.Qwen3RMSNorm", {"cast_first": True}),
        ("gemma3.modeling_gemma3.Gemma3RMSNorm", {"unit_offset": True}),
        ("qwen3_5.modeling_qwen3_5.Qwen3_5RMSNorm", {"unit_offset": True}),
    ],
    ids=["olmo3", "llama", "qwen3", "gemma3", "qwen3_5"],
)
def test_rmsnorm_variants_match_their_reference_class(reference, options, dtype):
    import importlib

    module, cls = reference.rsplit(".", 1)
    theirs = getattr(importlib.import_module(f"transformers.models.{module}"), cls)(48, eps=1e-6)
    ours = RMSNorm(48, eps=1e-6, **options)
    assert torch.equal(ours.weight, theirs.weight)  # same initial value: ones, or zeros for 1 + w
    theirs = randomize(theirs).to(dtype)
    transplant(ours, theirs, {})
    ours = ours.to(dtype)
    x = inputs((2, 5, 48), dtype) * 3
    with torch.no_grad():
        assert torch.equal(ours(x), theirs(x))


def test_rmsnorm_rounding_orders_differ_in_bfloat16():
    """The options are not cosmetic: the three scales round differently in bf16."""
    x = inputs((4, 16, 64), torch.bfloat16) * 3
    w = 1.0 + 0.1 * inputs((64,), torch.float32, seed=2)
    default, cast_first, offset = RMSNorm(64), RMSNorm(64, cast_first=True), RMSNorm(64, unit_offset=True)
    with torch.no_grad():
        default.weight.copy_(w), cast_first.weight.copy_(w), offset.weight.copy_(w - 1.0)
        default, cast_first = default.to(torch.bfloat16), cast_first.to(torch.bfloat16)
        assert not torch.equal(default(x), cast_first(x))
        x_hat = x.double() / x.double().pow(2).mean(-1, keepdim=True).add(1e-6).sqrt()
        expected = (x_hat * w.double()).to(torch.bfloat16).double()  # (1 + (w - 1)) x_hat, to bf16 precision
        torch.testing.assert_close(offset(x).double(), expected, atol=0.02, rtol=0.02)
        offset.weight.zero_()
        torch.testing.assert_close(offset(x.float()), x_hat.float(), atol=1e-5, rtol=1e-5)  # zero init: 1 + 0


@DTYPES
def test_layernorm_without_bias_matches_cohere(dtype):
    from transformers.models.cohere2.modeling_cohere2 import Cohere2LayerNorm

    theirs = randomize(Cohere2LayerNorm(48, eps=1e-5)).to(dtype)
    ours = LayerNorm(48, eps=1e-5)
    transplant(ours, theirs, {})
    x = inputs((2, 5, 48), dtype) + 2.0
    with torch.no_grad():
        assert torch.equal(ours.to(dtype)(x), theirs(x))


@DTYPES
def test_layernorm_with_bias_fused_is_nn_layernorm(dtype):
    """GPT-2's ``ln_1``/``ln_2``/``ln_f`` are ``nn.LayerNorm`` with bias."""
    theirs = randomize(nn.LayerNorm(48, eps=1e-5)).to(dtype)
    ours = LayerNorm(48, eps=1e-5, bias=True, fused=True)
    transplant(ours, theirs, {})
    x = inputs((2, 5, 48), dtype) + 2.0
    with torch.no_grad():
        assert torch.equal(ours.to(dtype)(x), theirs(x))


def test_layernorm_with_bias_in_float32_is_the_formula():
    norm = randomize(LayerNorm(32, eps=1e-5, bias=True))
    x = inputs((3, 32), torch.float32) * 2 + 1
    mu, var = x.double().mean(-1, keepdim=True), x.double().var(-1, unbiased=False, keepdim=True)
    expected = (x.double() - mu) / (var + 1e-5).sqrt() * norm.weight.double() + norm.bias.double()
    with torch.no_grad():
        torch.testing.assert_close(norm(x).double(), expected, atol=1e-5, rtol=1e-5)
    assert norm.bias.abs().sum() > 0  # the bias is there and not all zeros


# --- MLPs -------------------------------------------------------------------------------------


@DTYPES
@pytest.mark.parametrize("act", ["silu", "gelu_pytorch_tanh"])
def test_gated_mlp_matches_gemma3_and_llama_mlp(act, dtype):
    from transformers import Gemma3TextConfig, LlamaConfig
    from transformers.models.gemma3.modeling_gemma3 import Gemma3MLP
    from transformers.models.llama.modeling_llama import LlamaMLP

    if act == "silu":
        theirs = LlamaMLP(LlamaConfig(hidden_size=32, intermediate_size=80, hidden_act="silu"))
    else:
        theirs = Gemma3MLP(Gemma3TextConfig(hidden_size=32, intermediate_size=80, hidden_activation=act))
    theirs = randomize(theirs).to(dtype)
    ours = GatedMLP(32, 80, activation=act)
    transplant(ours, theirs, {"gate_proj": "fc1", "up_proj": "fc2", "down_proj": "fc3"})
    x = inputs((2, 5, 32), dtype) * 2
    with torch.no_grad():
        assert torch.equal(ours.to(dtype)(x), theirs(x))


@DTYPES
def test_plain_gelu_mlp_matches_gpt2(dtype):
    from transformers import GPT2Config
    from transformers.models.gpt2.modeling_gpt2 import GPT2MLP

    theirs = randomize(GPT2MLP(128, GPT2Config(n_embd=32, activation_function="gelu_new"))).eval().to(dtype)
    ours = MLP(32, 128, activation="gelu_new")
    transplant(ours, theirs, {"c_fc": "fc1", "c_proj": "fc2"}, transpose=("c_fc", "c_proj"))
    x = inputs((2, 5, 32), dtype) * 2
    with torch.no_grad():
        torch.testing.assert_close(ours.to(dtype)(x), theirs(x), atol=0, rtol=0)


def test_gelu_new_is_the_tanh_formula_not_the_fused_kernel():
    x = torch.linspace(-6, 6, 10_001)
    expected = 0.5 * x.double() * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (x.double() + 0.044715 * x.double() ** 3)))
    torch.testing.assert_close(gelu_tanh_formula(x).double(), expected, atol=1e-6, rtol=1e-6)
    assert not torch.equal(gelu_tanh_formula(x), nn.functional.gelu(x, approximate="tanh"))  # why both exist


def test_unknown_activation_is_refused():
    with pytest.raises(ValueError, match="activation 'relu2' is not supported"):
        GatedMLP(8, 16, activation="relu2")


# --- attention ----------------------------------------------------------------------------------


def capture(module: nn.Module, names: list[str]) -> dict[str, torch.Tensor]:
    out = {}
    for name in names:
        module.get_submodule(name).register_forward_hook(lambda m, i, o, name=name: out.__setitem__(name, o))
    return out


@DTYPES
@pytest.mark.parametrize("window", [None, 4])
def test_soft_capped_scaled_attention_matches_gemma2(dtype, window):
    """Soft-cap 2.0 (scores reach well past it), scale ``query_pre_attn_scalar**-0.5`` with a scalar
    unlike head_dim, GQA, a sliding window: ``Gemma2Attention``."""
    from transformers import Gemma2Config
    from transformers.models.gemma2.modeling_gemma2 import Gemma2Attention

    layer_type = SLIDING if window else FULL
    config = Gemma2Config(
        hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        query_pre_attn_scalar=7,
        attn_logit_softcapping=2.0,
        sliding_window=window or 4096,
        num_hidden_layers=1,
        layer_types=[layer_type],
    )
    config._attn_implementation = "eager"
    theirs = randomize(Gemma2Attention(config, 0)).to(dtype)
    ours = GroupedQueryAttention(32, 4, 2, 16, scale=7**-0.5, softcap=2.0, sliding_window=window)
    transplant(ours, theirs, ATTENTION_NAMES)
    ours = ours.to(dtype)
    (cos, sin), ref_tables = half_split_tables({"rope_type": "default", "rope_theta": 10_000.0}, 16, dtype)
    x = inputs((2, SEQ, 32), dtype) * 4
    taps = capture(ours, ["scores", "probs"])
    with torch.no_grad():
        ref_out, ref_probs = theirs(x, ref_tables, additive_mask(SEQ, dtype, window))
        assert torch.equal(ours(x, cos, sin), ref_out)
    assert torch.equal(taps["probs"], ref_probs)
    assert taps["scores"].abs().max() > 2.0  # before the cap, so the cap mattered
    assert taps["scores"].shape == (2, 4, SEQ, SEQ)


@DTYPES
def test_per_head_unit_offset_qk_norm_matches_gemma3_attention(dtype):
    from transformers import Gemma3TextConfig
    from transformers.models.gemma3.modeling_gemma3 import Gemma3Attention

    config = Gemma3TextConfig(
        hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=16,
        query_pre_attn_scalar=24,
        num_hidden_layers=1,
        layer_types=[FULL],
    )
    config._attn_implementation = "eager"
    theirs = randomize(Gemma3Attention(config, 0)).to(dtype)
    norm = partial(RMSNorm, eps=config.rms_norm_eps, unit_offset=True)
    ours = GroupedQueryAttention(32, 4, 1, 16, scale=24**-0.5, qk_norm="head", norm=norm)
    transplant(ours, theirs, ATTENTION_NAMES)
    ours = ours.to(dtype)
    (cos, sin), ref_tables = half_split_tables({"rope_type": "linear", "rope_theta": 1e6, "factor": 8.0}, 16, dtype)
    x = inputs((1, SEQ, 32), dtype)
    with torch.no_grad():
        ref_out, _ = theirs(x, ref_tables, additive_mask(SEQ, dtype))
        assert torch.equal(ours(x, cos, sin), ref_out)


@DTYPES
def test_output_gate_and_partial_rotary_match_qwen3_5_attention(dtype):
    """``q_proj`` twice as wide, split per head into query and gate; context times sigmoid(gate);
    (1 + w) per-head Q/K norm; a quarter of each head rotated (``Qwen3_5Attention``)."""
    from transformers import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5Attention

    config = Qwen3_5TextConfig(
        hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_hidden_layers=1
    )
    config._attn_implementation = "eager"
    theirs = randomize(Qwen3_5Attention(config, 0)).to(dtype)
    norm = partial(RMSNorm, eps=config.rms_norm_eps, unit_offset=True)
    ours = GroupedQueryAttention(32, 4, 2, 16, qk_norm="head", norm=norm, output_gate=True)
    assert ours.W_query.weight.shape == (2 * 4 * 16, 32)
    transplant(ours, theirs, ATTENTION_NAMES)
    ours = ours.to(dtype)
    params = {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25}
    (cos, sin), ref_tables = half_split_tables(params, 16, dtype)
    assert cos.shape == (SEQ, 2)  # 4 of 16 dims rotate
    x = inputs((2, SEQ, 32), dtype)
    taps = capture(ours, ["gate", "context", "q_rot", "W_query"])
    with torch.no_grad():
        ref_out, _ = theirs(x, ref_tables, additive_mask(SEQ, dtype))
        assert torch.equal(ours(x, cos, sin), ref_out)
    gate = taps["W_query"].unflatten(-1, (4, 32))[..., 16:].flatten(-2)  # second half of each head
    assert torch.equal(taps["gate"], gate) and taps["gate"].shape == taps["context"].shape == (2, SEQ, 64)


def test_output_gate_multiplies_the_context_by_sigmoid_gate():
    att = randomize(GroupedQueryAttention(16, 2, 2, 8, output_gate=True))
    taps = capture(att, ["gate", "context"])
    x = inputs((1, 5, 16), torch.float32)
    with torch.no_grad():
        out = att(x)
        expected = att.out_proj(taps["context"] * torch.sigmoid(taps["gate"]))
    torch.testing.assert_close(out, expected, atol=0, rtol=0)


def test_scores_tap_is_scaled_qk_before_cap_and_mask():
    att = randomize(GroupedQueryAttention(16, 4, 2, 8, scale=0.3, softcap=1.0, sliding_window=3))
    taps = capture(att, ["q_rot", "k_rot", "scores", "probs"])
    x = inputs((2, 6, 16), torch.float32) * 3
    cos, sin = rope_cos_sin(rope_init({"rope_type": "default", "rope_theta": 100.0}, 8)[0], 6)
    with torch.no_grad():
        att(x, cos, sin)
    k = taps["k_rot"].repeat_interleave(2, dim=1)
    torch.testing.assert_close(taps["scores"], taps["q_rot"] @ k.transpose(2, 3) * 0.3, atol=0, rtol=0)
    assert taps["scores"].abs().max() > 1.0  # uncapped
    assert torch.all(taps["scores"][..., 0, 1:] != 0)  # unmasked: the future is still there
    capped = soft_cap(taps["scores"], 1.0).masked_fill(~causal_mask(6, 3), torch.finfo(torch.float32).min)
    torch.testing.assert_close(taps["probs"], torch.softmax(capped, -1), atol=0, rtol=0)


def test_soft_cap_is_cap_tanh_x_over_cap():
    x = torch.linspace(-100, 100, 1001)
    torch.testing.assert_close(soft_cap(x, 30.0), 30.0 * torch.tanh(x / 30.0))
    assert soft_cap(x, 30.0).abs().max() < 30.0


def test_layer_without_rope_leaves_q_and_k_unrotated():
    att = randomize(GroupedQueryAttention(16, 2, 1, 8))
    taps = capture(att, ["W_query", "q_rot"])
    with torch.no_grad():
        att(inputs((1, 5, 16), torch.float32))
    assert torch.equal(taps["q_rot"], taps["W_query"].unflatten(-1, (2, 8)).transpose(1, 2))


def test_fused_qkv_is_the_three_projections_side_by_side():
    """``fused_qkv``: one ``W_qkv`` whose rows are W_query's, W_key's and W_value's, in that order (GQA
    widths too); the same attention as three projections holding those rows, and no output gate."""
    fused = randomize(GroupedQueryAttention(16, 4, 2, 8, fused_qkv=True, bias=True))
    split = GroupedQueryAttention(16, 4, 2, 8, bias=True)
    weights, biases = fused.W_qkv.weight.split([32, 16, 16]), fused.W_qkv.bias.split([32, 16, 16])
    state = {}
    for name, w, b in zip(("W_query", "W_key", "W_value"), weights, biases):
        state |= {f"{name}.weight": w, f"{name}.bias": b}
    split.load_state_dict({**state, "out_proj.weight": fused.out_proj.weight, "out_proj.bias": fused.out_proj.bias})
    x = inputs((2, 6, 16), torch.float32)
    cos, sin = rope_cos_sin(rope_init({"rope_type": "default", "rope_theta": 100.0}, 8)[0], 6)
    with torch.no_grad():
        torch.testing.assert_close(fused(x, cos, sin), split(x, cos, sin), atol=0, rtol=0)
    assert not hasattr(fused, "W_query")
    with pytest.raises(ValueError, match="fused_qkv with an output gate"):
        GroupedQueryAttention(16, 4, 2, 8, fused_qkv=True, output_gate=True)


# --- block layouts ------------------------------------------------------------------------------


def gemma3_config(**kw):
    from transformers import Gemma3TextConfig

    config = Gemma3TextConfig(
        hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        intermediate_size=64,
        query_pre_attn_scalar=16,
        sliding_window=4,
        num_hidden_layers=1,
        layer_types=[SLIDING],
        **kw,
    )
    config._attn_implementation = "eager"
    return config


@DTYPES
def test_sandwich_block_matches_gemma3_decoder_layer(dtype):
    """Four (1 + w) norms around GQA (per-head Q/K norm, query_pre_attn_scalar, window) and a GeGLU MLP."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3DecoderLayer

    config = gemma3_config()
    theirs = randomize(Gemma3DecoderLayer(config, 0)).to(dtype)
    norm = partial(RMSNorm, eps=config.rms_norm_eps, unit_offset=True)
    att = GroupedQueryAttention(32, 4, 2, 8, scale=16**-0.5, qk_norm="head", norm=norm, sliding_window=4)
    block = SandwichBlock(att, GatedMLP(32, 64, activation="gelu_pytorch_tanh"), partial(norm, 32), SLIDING)
    renames = {
        "self_attn.": "att.",
        **ATTENTION_NAMES,
        "mlp.gate_proj": "ff.fc1",
        "mlp.up_proj": "ff.fc2",
        "mlp.down_proj": "ff.fc3",
    }
    transplant(block, theirs, renames)
    block = block.to(dtype)
    (cos, sin), ref_tables = half_split_tables({"rope_type": "default", "rope_theta": 10_000.0}, 8, dtype)
    x = inputs((2, SEQ, 32), dtype) * 2
    with torch.no_grad():
        ref = theirs(x, ref_tables, additive_mask(SEQ, dtype, 4))
        assert torch.equal(block(x, cos, sin), ref)


@DTYPES
def test_pre_norm_layernorm_gelu_block_matches_gpt2_block(dtype):
    """LayerNorm with bias, MHA with biases, no RoPE, GELU MLP. (GPT-2's softmax runs in the activation
    dtype; torch's float32 softmax rounded once to it gives the same bits.)"""
    from transformers import GPT2Config
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    config = GPT2Config(n_embd=32, n_head=4, n_layer=1, n_positions=64, activation_function="gelu_new")
    config._attn_implementation = "eager"
    theirs = randomize(GPT2Block(config, 0)).eval().to(dtype)
    att = GroupedQueryAttention(32, 4, 4, 8, bias=True)
    block = PreNormBlock(att, MLP(32, 128, activation="gelu_new"), partial(LayerNorm, 32, bias=True, fused=True))
    state = {}
    for key, value in theirs.state_dict().items():
        if ("attn.bias" in key and value.dim() > 1) or "masked_bias" in key:
            continue
        if key.startswith("attn.c_attn."):  # fused q, k, v (Conv1D: (in, out))
            for name, part in zip(("W_query", "W_key", "W_value"), value.split(32, dim=-1)):
                state[f"att.{name}.{key.rsplit('.', 1)[1]}"] = part.t().contiguous() if part.dim() == 2 else part
            continue
        renamed = key.replace("ln_1", "norm1").replace("ln_2", "norm2").replace("attn.c_proj", "att.out_proj")
        renamed = renamed.replace("mlp.c_fc", "ff.fc1").replace("mlp.c_proj", "ff.fc2")
        state[renamed] = value.t().contiguous() if value.dim() == 2 else value
    block.load_state_dict(state, strict=True)
    block = block.to(dtype)
    x = inputs((2, SEQ, 32), dtype)
    with torch.no_grad():
        ref = theirs(x, attention_mask=additive_mask(SEQ, dtype))
        ref = ref[0] if isinstance(ref, tuple) else ref
        torch.testing.assert_close(block(x), ref, atol=0, rtol=0)


class Branch(nn.Module):
    """A stand-in branch with a recognisable formula: ``scale * x + shift`` (attention signature optional)."""

    def __init__(self, scale: float, shift: float):
        super().__init__()
        self.scale, self.shift, self.head_dim = scale, shift, 8

    def forward(self, x, cos=None, sin=None, padding_mask=None, cache=None):
        return self.scale * x + self.shift


class Doubling(nn.Module):
    def forward(self, x):
        return 2 * x


@pytest.mark.parametrize(
    "block_cls, expected",
    [
        (PreNormBlock, lambda x: (lambda h: h + 5 * (2 * h) - 1)(x + 3 * (2 * x) + 1)),
        (PostNormBlock, lambda x: (lambda h: h + 2 * (5 * h - 1))(x + 2 * (3 * x + 1))),
        (SandwichBlock, lambda x: (lambda h: h + 2 * (5 * (2 * h) - 1))(x + 2 * (3 * (2 * x) + 1))),
        (ParallelBlock, lambda x: x + (3 * (2 * x) + 1) + (5 * (2 * x) - 1)),
    ],
    ids=["pre-norm", "post-norm", "sandwich", "parallel"],
)
def test_block_layouts_put_the_norms_where_the_formula_says(block_cls, expected):
    """Norm = doubling, attention = 3x + 1, FFN = 5x - 1: each layout's formula gives a distinct number."""
    block = block_cls(Branch(3.0, 1.0), Branch(5.0, -1.0), Doubling)
    x = torch.tensor([[[0.5, -1.0]]])
    torch.testing.assert_close(block(x), expected(x))


# --- the skeleton ---------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_embedding_scale_rounds_like_gemma3(dtype):
    from transformers.models.gemma3.modeling_gemma3 import Gemma3TextScaledWordEmbedding

    theirs = randomize(Gemma3TextScaledWordEmbedding(50, 40, padding_idx=0, embed_scale=40**0.5)).to(dtype)
    ours = TokenEmbedding(50, 40, scale=40**0.5)
    transplant(ours, theirs, {})
    ids = torch.randint(0, 50, (2, 7), generator=torch.Generator().manual_seed(0))
    assert torch.equal(ours.to(dtype)(ids), theirs(ids))


class TinyDecoder(DecoderModel):
    """Every skeleton option at once: scaled embedding, learned positions, logit scale, soft-cap,
    per-layer-type RoPE (one type without), a sandwich block with a gated, partially rotated attention."""

    def __init__(self, cfg):
        def block(layer_type):
            norm = partial(RMSNorm, eps=1e-6, unit_offset=True, dtype=cfg["dtype"])
            att = GroupedQueryAttention(16, 2, 1, 8, qk_norm="head", norm=norm, output_gate=True, dtype=cfg["dtype"])
            return SandwichBlock(att, GatedMLP(16, 32, dtype=cfg["dtype"]), partial(norm, 16), layer_type)

        super().__init__(
            cfg,
            [block(t) for t in cfg["layer_types"]],
            LayerNorm(16, bias=True, dtype=cfg["dtype"]),
            emb_scale=4.0,
            learned_positions=True,
            logit_scale=0.5,
            final_softcap=3.0,
        )

    def rope_parameters(self):
        return {SLIDING: {"rope_type": "default", "rope_theta": 100.0, "partial_rotary_factor": 0.5}, FULL: None}


TINY_CFG = dict(
    vocab_size=30,
    emb_dim=16,
    n_layers=2,
    context_length=12,
    tie_word_embeddings=True,
    layer_types=[SLIDING, FULL],
    dtype=torch.float32,
)


def test_skeleton_builds_on_meta_without_buffers_and_ties_the_head():
    with torch.device("meta"):
        model = TinyDecoder(TINY_CFG)
    assert list(model.buffers()) == []
    assert model.out_head.weight is model.tok_emb.weight
    assert model.pos_emb.weight.shape == (12, 16) and model.blocks[0].att.W_query.weight.shape == (32, 16)


def test_skeleton_forward_is_the_formula():
    model = randomize(TinyDecoder(TINY_CFG))
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    with torch.no_grad():
        logits = model(ids)
        x = model.tok_emb.weight[ids] * 4.0 + model.pos_emb.weight[:8]
        tables = model.rope_tables(8, x.device, x.dtype)
        assert tables[FULL] == (None, None) and tables[SLIDING][0].shape == (8, 2)  # 4 of 8 dims rotate
        for block in model.blocks:
            x = block(x, *tables[block.layer_type])
        expected = 3.0 * torch.tanh(model.out_head(model.final_norm(x)) * 0.5 / 3.0)
    torch.testing.assert_close(logits, expected, atol=0, rtol=0)
    assert logits.abs().max() < 3.0


def test_skeleton_refuses_a_rope_it_cannot_compute_at_construction():
    class Bad(TinyDecoder):
        def rope_parameters(self):
            return {SLIDING: {"rope_type": "dynamic", "rope_theta": 100.0, "factor": 2.0}, FULL: None}

    with pytest.raises(ValueError, match="rope_type 'dynamic' is not supported"):
        Bad(TINY_CFG)
    with pytest.raises(ValueError, match="layer_types has 2 entries for n_layers=3"):
        TinyDecoder({**TINY_CFG, "n_layers": 3})
