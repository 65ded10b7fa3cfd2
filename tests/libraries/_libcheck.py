"""Shared driver for the public-library tests (tests/libraries/test_*.py): not glue itself.

Each library's glue (``glue_<library>.py``) holds what a user writes to check that library's model:
``build_<family>(state_dict, hf_config) -> nn.Module`` made with the library's own HF-conversion code,
between ``# --- glue: <name> ---`` markers (``shared`` counts towards every family). This module makes
the tiny random references, checks a verdict independently of parity (plain forward hooks on the
decoder layers of both models and a logits comparison), and counts the glue lines.

A missing library skips its tests with the reason, unless ``PARITY_REQUIRE_LIBS=1`` (set by
``.ci/run``), where it fails them: CI never counts a skip as a pass.
"""

from __future__ import annotations

import importlib
import os
import re
from pathlib import Path

import pytest
import torch
import transformers

import parity

REQUIRE_ENV = "PARITY_REQUIRE_LIBS"
HERE = Path(__file__).resolve().parent
LOGITS_ATOL = 1e-4  # fp32, logits of scale ~1: a correct port agrees to ~1e-6
SEQ_LEN = 16


def require(module: str):
    """Import ``module`` or skip (fail under ``PARITY_REQUIRE_LIBS=1``) saying how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        msg = (
            f"{module} is not importable ({exc}); install the libraries as .ci/run does: pip install -e '.[libs]', "
            "then pip install --no-deps litgpt==0.5.13 llms-from-scratch==1.0.19"
        )
        if os.environ.get(REQUIRE_ENV) == "1":
            pytest.fail(f"{REQUIRE_ENV}=1 and {msg}", pytrace=False)
        pytest.skip(msg)


def tiny_config(family: str, **overrides) -> transformers.PretrainedConfig:
    """The tiny fp32 Transformers config each library is checked on (real structure, toy widths)."""
    common = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
    default_rope = lambda theta: dict(rope_type="default", rope_theta=theta)
    no_special = dict(pad_token_id=None, bos_token_id=None, eos_token_id=None)
    if family == "gpt2":
        kw = dict(vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_positions=128, **no_special)
        cfg: transformers.PretrainedConfig = transformers.GPT2Config(**kw)
    elif family == "llama2":
        cfg = transformers.LlamaConfig(
            **common, num_key_value_heads=4, max_position_embeddings=128, rms_norm_eps=1e-5,
            tie_word_embeddings=False, rope_parameters=default_rope(10000.0),
        )  # fmt: skip
    elif family == "llama3":
        cfg = transformers.LlamaConfig(
            **common, num_key_value_heads=2, max_position_embeddings=16384, rms_norm_eps=1e-5,
            tie_word_embeddings=True,
            rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=32.0, low_freq_factor=1.0,
                                 high_freq_factor=4.0, original_max_position_embeddings=8192),
        )  # fmt: skip
    elif family == "mistral":
        cfg = transformers.MistralConfig(
            **common, num_key_value_heads=2, head_dim=16, max_position_embeddings=128, rms_norm_eps=1e-5,
            sliding_window=5, tie_word_embeddings=False, rope_parameters=default_rope(10000.0),
        )  # fmt: skip
    elif family == "qwen2":
        cfg = transformers.Qwen2Config(
            **common, num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6,
            tie_word_embeddings=True, rope_parameters=default_rope(1000000.0),
        )  # fmt: skip
    elif family == "qwen3":
        cfg = transformers.Qwen3Config(
            **common, num_key_value_heads=2, head_dim=32, max_position_embeddings=128, rms_norm_eps=1e-6,
            tie_word_embeddings=False, rope_parameters=default_rope(1000000.0),
        )  # fmt: skip
    elif family == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(
            **common, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=128, rms_norm_eps=1e-6,
            tie_word_embeddings=False, rope_parameters=default_rope(1000000.0),
        )  # fmt: skip
    elif family == "gemma3":
        cfg = transformers.Gemma3TextConfig(
            **common, num_key_value_heads=1, head_dim=16, query_pre_attn_scalar=16, max_position_embeddings=128,
            rms_norm_eps=1e-6, sliding_window=4, layer_types=["sliding_attention", "full_attention"],
        )  # fmt: skip
    elif family == "olmo3":
        cfg = transformers.Olmo3Config(
            **{**common, "num_hidden_layers": 4}, num_key_value_heads=2, max_position_embeddings=128,
            rms_norm_eps=1e-6, sliding_window=4, tie_word_embeddings=False, **no_special,
        )  # fmt: skip
    else:
        raise ValueError(f"no tiny config for family {family!r}")
    for key, value in overrides.items():
        setattr(cfg, key, value)
    return cfg


def make_reference(hf_config: transformers.PretrainedConfig, directory: Path, seed: int = 0) -> Path:
    """Save a random fp32 Transformers model to ``directory``; 1-D parameters (norm weights, biases)
    are moved away from their init (ones/zeros) so that norm and bias bugs are visible."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:
                p.add_(0.2 * torch.randn_like(p))
    model.save_pretrained(directory)
    return directory


def _layer_outputs(model: torch.nn.Module, layers, ids: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """``(logits (batch, seq, vocab), [hidden (batch, seq, d_model) after each decoder layer])``,
    read with plain forward hooks."""
    seen: list[torch.Tensor] = []

    def hook(_module, _args, output):
        seen.append((output[0] if isinstance(output, tuple) else output).detach().float())

    handles = [layer.register_forward_hook(hook) for layer in layers]
    try:
        with torch.no_grad():
            out = model(ids)
    finally:
        for h in handles:
            h.remove()
    logits = out.logits if hasattr(out, "logits") else out[0] if isinstance(out, (tuple, list)) else out
    return logits.detach().float(), seen


def independent(build, ref_dir: Path, layers_of, seq_len: int = SEQ_LEN, seed: int = 1) -> dict:
    """Compare the library model with Transformers without parity: ``logits_max_abs``, ``ref_scale``
    and ``first_layer`` (index of the first decoder layer whose output differs by more than
    ``LOGITS_ATOL``, or None). ``layers_of(model)`` lists the library model's decoder layers."""
    ref = transformers.AutoModelForCausalLM.from_pretrained(ref_dir, dtype=torch.float32).eval()
    ours = build({k: v.detach().clone() for k, v in ref.state_dict().items()}, ref.config).eval()
    ids = torch.randint(
        0, ref.config.get_text_config().vocab_size, (2, seq_len), generator=torch.Generator().manual_seed(seed)
    )
    ref_layers = ref.transformer.h if hasattr(ref, "transformer") else ref.model.layers
    a_logits, a_layers = _layer_outputs(ours, layers_of(ours), ids)
    b_logits, b_layers = _layer_outputs(ref, ref_layers, ids)
    assert a_logits.shape == b_logits.shape and len(a_layers) == len(b_layers)
    diffs = [float((a - b).abs().max()) for a, b in zip(a_layers, b_layers)]
    first = next((i for i, d in enumerate(diffs) if d > LOGITS_ATOL), None)
    return {
        "logits_max_abs": float((a_logits - b_logits).abs().max()),
        "ref_scale": float(b_logits.abs().max()),
        "layer_max_abs": diffs,
        "first_layer": first,
    }


def check(build, ref_dir: Path, seq_len: int = SEQ_LEN, **kw) -> parity.CheckResult:
    """``parity.check_model`` as a user runs it: the model, then each node in isolation (``both``)."""
    return parity.check_model(build, reference=str(ref_dir), mode="both", seq_len=seq_len, **kw)


def assert_clean(build, ref_dir: Path, layers_of, seq_len: int = SEQ_LEN, **kw) -> parity.CheckResult:
    """The library model agrees with Transformers (checked independently) and parity says PASS."""
    ind = independent(build, ref_dir, layers_of, seq_len)
    assert ind["logits_max_abs"] < LOGITS_ATOL, f"the glue itself is wrong (independent check): {ind}"
    result = check(build, ref_dir, seq_len, **kw)
    assert result.passed, result.verdict()
    assert result.first_mismatch is None
    return result


def assert_located(
    build, ref_dir: Path, layers_of, node: str, hint: str | None, seq_len: int = SEQ_LEN, **kw
) -> parity.CheckResult:
    """The bug changes the logits, first at the decoder layer ``node`` names (both read with plain
    hooks), and parity fails first at ``node`` with a hint of kind ``hint``, chained and isolated."""
    ind = independent(build, ref_dir, layers_of, seq_len)
    assert ind["logits_max_abs"] > 10 * LOGITS_ATOL, f"the bug does not change the logits: {ind}"
    layer = re.search(r"\.(?:layers|h)\.(\d+)\.", node)
    assert layer is not None and ind["first_layer"] == int(layer.group(1)), ind
    result = check(build, ref_dir, seq_len, **kw)
    assert not result.passed
    first = result.first_mismatch
    assert first is not None, result.verdict()
    assert first.name == node, result.verdict()
    assert (first.hint.kind if first.hint is not None else None) == hint, (first.hint, result.verdict())
    isolated = result.first_isolated_mismatch  # each node fed the reference's inputs: the same node
    assert isolated is not None and isolated.name == node, result.verdict()
    return result


def glue_lines(library: str) -> dict[str, int]:
    """Lines a user writes per family for ``library``: the code lines (no blank line, comment or
    docstring) of the ``shared`` glue block plus those of the family's block in ``glue_<library>.py``;
    a block marker may name several families (``# --- glue: gpt2 llama2 ---``)."""
    blocks: dict[str, int] = {}
    names: list[str] = []
    in_docstring = False
    for line in (HERE / f"glue_{library}.py").read_text().splitlines():
        text = line.strip()
        marker = re.match(r"# --- glue: (.+) ---$", text)
        if marker:
            names = marker.group(1).split()
            blocks.update(dict.fromkeys(names, 0))
        elif text == "# --- end glue ---":
            names = []
        elif names and in_docstring:
            in_docstring = '"""' not in text
        elif names and text.startswith('"""'):
            in_docstring = text.count('"""') == 1
        elif names and text and not text.startswith("#"):
            for name in names:
                blocks[name] += 1
    shared = blocks.pop("shared", 0)
    return {family: shared + n for family, n in blocks.items()}
