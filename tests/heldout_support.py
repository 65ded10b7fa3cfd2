"""What the held-back sets' tests share: the independent check of a user model against Transformers,
no parity involved (the helpers who wrote the models verified each bug the same way)."""

from __future__ import annotations

import math
from pathlib import Path
from types import MappingProxyType

import pytest
import torch


def bug_fixture(models: dict):
    """A ``bug`` fixture (``indirect``): sets ``BUG`` in every model module of a held-back set (the one
    bug their code reads at call time) and clears it after."""

    @pytest.fixture
    def bug(request):
        for module in models.values():
            module.BUG = request.param
        yield request.param
        for module in models.values():
            module.BUG = ""

    return bug


def independent_max_diff(module, checkpoint: Path, padded: bool, pad_row: int = 0) -> float:
    """Max |logits| difference between ``module.build``'s model and Transformers' (eager) on 24 random
    tokens, called without a mask and with an all-ones one; padded: batch 2, row ``pad_row`` starting with 5
    padding tokens, positions counted over each row's real tokens (padding at position 1, as generation gives
    it), real tokens compared only."""
    ref = reference_model(checkpoint)
    try:
        ours = module.build({k: v.clone() for k, v in ref.state_dict().items()}, ref.config).eval()
    except KeyError:  # a loader written against the files' names (Mixtral's per-expert w1/w2/w3)
        from safetensors.torch import load_file

        ours = module.build(load_file(Path(checkpoint) / "model.safetensors"), ref.config).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        if not padded:  # called without a mask and, as a tokenizer's output calls it, with an all-ones one
            ids = torch.randint(0, 256, (1, 24), generator=g)
            theirs = ref(ids).logits
            gap = float((theirs - ours(ids)).abs().max())
            try:
                masked = ours(ids, attention_mask=torch.ones_like(ids))
            except TypeError:  # a forward that takes no mask
                return gap
            return max(gap, float((theirs - masked).abs().max()))
        ids = torch.randint(0, 256, (2, 24), generator=g)
        mask = torch.ones(2, 24, dtype=torch.long)
        mask[pad_row, :5] = 0
        positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
        a = ref(ids, attention_mask=mask, position_ids=positions).logits[mask.bool()]
        b = ours(ids, attention_mask=mask, position_ids=positions)[mask.bool()]
        return float((a - b).abs().max())


PADDED = {"batch_size": 2, "left_pad": 5}

#: the helpers' tiny config, shared by every family of a set (each adds its own fields)
COMMON = MappingProxyType(
    dict(
        vocab_size=256,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=4,
        max_position_embeddings=256,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
)

#: the arguments of a held-back set's located-bug test, one case each: ``(model, bug, padded, node, kind, says)``
LOCATED = ("model", "bug", "padded", "node", "kind", "says")


def located_cases(named: list[tuple], fast: set[str]) -> list:
    """``named`` as pytest params, the bugs outside ``fast`` marked slow, each id ``<model>-<bug>``."""
    return [
        pytest.param(*case, marks=[] if case[1] in fast else [pytest.mark.slow], id=f"{case[0]}-{case[1]}")
        for case in named
    ]


def check(models: dict, checkpoints: dict, model: str, padded: bool = False, mode: str = "chained"):
    """``parity.check_model`` on a held-back set's ``model`` against its checkpoint (24 tokens; padded: a
    batch of 2, row 0 left-padded by 5)."""
    import parity

    return parity.check_model(
        models[model].build, reference=str(checkpoints[model]), seq_len=24, mode=mode, **(PADDED if padded else {})
    )


def assert_passes(models: dict, checkpoints: dict, model: str, padded: bool, within: float = 1e-4) -> None:
    """A correct variant: within ``within`` (1e-4: a model whose own float32 drift is larger says so) of
    Transformers without parity, and parity passes it (both modes)."""
    assert independent_max_diff(models[model], checkpoints[model], padded, pad_row=0) < within
    res = check(models, checkpoints, model, padded, mode="both")
    assert res.passed, res.verdict()


def assert_located(models: dict, checkpoints: dict, model: str, padded: bool, node: str, kind: str, says: str):
    """A bug: its logits differ from Transformers' without parity, and parity's first mismatch is ``node``
    with a hint of ``kind`` whose text holds ``says``."""
    diff = independent_max_diff(models[model], checkpoints[model], padded, pad_row=0)
    assert not diff <= 1e-6, diff
    res = check(models, checkpoints, model, padded)
    bad = res.first_mismatch
    assert bad is not None and bad.name == node, res.verdict()
    assert bad.hint is not None and bad.hint.kind == kind and says in str(bad.hint), bad.hint


def assert_located_only(models: dict, checkpoints: dict, model: str, padded: bool, node: str) -> None:
    """A bug not yet named: its logits differ from Transformers' without parity, and parity's first mismatch is
    ``node`` (whatever its hint)."""
    assert not independent_max_diff(models[model], checkpoints[model], padded) <= 1e-6
    res = check(models, checkpoints, model, padded)
    assert res.first_mismatch is not None and res.first_mismatch.name == node, res.verdict()


def assert_refused(models: dict, checkpoints: dict, model: str, says: str) -> None:
    """A loader bug: its logits differ from Transformers' without parity, and parity refuses it as bad input
    with a message holding ``says`` (the tensor never loaded, what holds its place)."""
    import parity

    assert not independent_max_diff(models[model], checkpoints[model], False) <= 1e-6
    with pytest.raises(parity.ParityError, match="in no parameter or buffer") as raised:
        check(models, checkpoints, model)
    assert says in str(raised.value)


@torch.no_grad()
def randomise(model, gen: torch.Generator) -> None:
    """The helpers' weights (sets 18 on): norm weights around 1, other vectors (biases) ~0.3, token embeddings
    of unit scale, other matrices of unit gain (one draw per parameter, scaled after); a router's correction
    bias buffer (DeepSeek V3's ``e_score_correction_bias``) ~0.3, so that it changes the choice."""
    for name, p in model.named_parameters():
        r = torch.randn(p.shape, generator=gen)
        if p.dim() == 1:
            r = 1.0 + 0.5 * r if "norm" in name else 0.3 * r
        elif "embed_tokens" not in name:
            r = r / math.sqrt(p.shape[-1])
        p.copy_(r)
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            b.copy_(0.3 * torch.randn(b.shape, generator=gen))


def randomise_with_expert_bias(model, gen: torch.Generator) -> None:
    """:func:`randomise`, and a MoE block's ``expert_bias`` buffer (LFM2-MoE's, which the router adds for the
    choice only) ~0.3 as well (set 23 on; the sets before keep their checkpoints)."""
    randomise(model, gen)
    for name, b in model.named_buffers():
        if name.endswith("expert_bias"):
            b.copy_(0.3 * torch.randn(b.shape, generator=gen))


def causal_lm(config):
    """Transformers' causal LM class for ``config``: the auto mapping's, else the class its model type's package
    defines (Mistral 4's ``Mistral4ForCausalLM`` is in no auto mapping), else its ``...ForConditionalGeneration`` (a
    composite model with no text-only causal LM, GLM-5-Next). Transformers alone, no parity."""
    import importlib

    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING

    if type(config) in MODEL_FOR_CAUSAL_LM_MAPPING:
        return MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    package = importlib.import_module(f"transformers.models.{config.model_type}")
    return next(
        getattr(package, n)
        for suffix in ("ForCausalLM", "ForConditionalGeneration")  # GLM-5-Next's text runs in its composite model
        for n in dir(package)
        if n.endswith(suffix) and getattr(getattr(package, n), "config_class", None) is type(config)
    )


def reference_model(checkpoint: Path):
    """The Transformers model of ``checkpoint`` (eager attention, eval), to patch with a fault of the reference."""
    from transformers import AutoConfig

    cls = causal_lm(AutoConfig.from_pretrained(checkpoint))
    return cls.from_pretrained(checkpoint, attn_implementation="eager").eval()


def first_mismatch(models: dict, model: str, reference, **kwargs):
    """The first mismatch of ``parity.check_model`` on a held-back set's ``model`` against ``reference`` (a
    model or a checkpoint; 24 tokens); fails the test if there is none."""
    import parity

    res = parity.check_model(models[model].build, reference=reference, seq_len=24, **kwargs)
    assert res.first_mismatch is not None, res.verdict()
    return res.first_mismatch


def save_checkpoints(root: Path, specs: dict, randomise, seed: int, weight_seed: int) -> dict[str, Path]:
    """Each config of ``specs`` built by Transformers, its weights set by ``randomise(model, generator)``
    (``torch.manual_seed(seed + i)``, the generator seeded ``weight_seed + i``) and saved under ``root``."""
    out = {}
    for i, (name, config) in enumerate(specs.items()):
        torch.manual_seed(seed + i)
        model = causal_lm(config)._from_config(config).float().eval()
        randomise(model, torch.Generator().manual_seed(weight_seed + i))
        model.save_pretrained(root / name)
        out[name] = root / name
    return out


def save_each_alone(root: Path, configs: dict) -> dict[str, Path]:
    """Each config (a Transformers config, or the keyword arguments of ``AutoConfig.for_model`` beside
    :data:`COMMON`, by model type) saved under ``root`` seeded alone, as its helper's checker saves it (sets 42 on):
    :func:`save_checkpoints` with :func:`randomise_with_expert_bias`, seeds 1000 and 1234, one family at a time."""
    from transformers import AutoConfig

    out = {}
    for name, config in configs.items():
        if isinstance(config, dict):
            config = AutoConfig.for_model(name, **{**COMMON, **config})
        out.update(save_checkpoints(root, {name: config}, randomise_with_expert_bias, 1000, 1234))
    return out


def clean_cases(models: dict, fast: list[tuple], known_false: frozenset = frozenset()) -> list:
    """Every correct variant of a set (the baseline and each module's ``CLEAN``), padded and not, outside
    ``fast``, as pytest params; a ``(model, variant)`` in ``known_false``, or a case id
    (``<model>-<variant>-padded``) for one run alone, is a strict xfail (a known false failure or refusal)."""
    return [
        pytest.param(
            m,
            b,
            p,
            marks=[pytest.mark.xfail(strict=True, reason="a known false failure")]
            if (m, b) in known_false or f"{m}-{b or 'baseline'}-{'padded' if p else 'unpadded'}" in known_false
            else [],
            id=f"{m}-{b or 'baseline'}-{'padded' if p else 'unpadded'}",
        )
        for m in models
        for b in ("", *models[m].CLEAN)
        for p in (False, True)
        if (m, b, p) not in fast
    ]
