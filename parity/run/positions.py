"""Positions a user's model derives itself: a padded check hands both models ``position_ids`` counted over
each row's real tokens (as ``generate`` does), so a model that computes them otherwise when none are
given (an ``arange`` over the padding) agrees in the check and differs in a generation loop that passes
none. One more forward of each side without them tells: ours must then give what it gives with the mask's
positions (it derives them itself) or what the reference gives without them (its own default); anything
else fails as one more node after the check's own (:data:`UNPOSITIONED`)."""

from __future__ import annotations

import inspect
from dataclasses import replace

import torch

from parity.compare.results import NodeResult, compare_node
from parity.compare.tolerances import Tolerances
from parity.diagnose.hints import Hint
from parity.model.pair import NodeSpec, Pair
from parity.record.trace import first_tensor
from parity.run.plan import Run
from parity.run.stages import device_of, on_device

#: how far (relative to the logits' largest magnitude) the reference may move without position_ids and
#: still count as deriving the same positions, and how far ours must move to be said to derive others
STILL, MOVED = 1e-5, 1e-3


#: the node a forward without position_ids fails as (after every node of the check itself)
UNPOSITIONED = "logits (without position_ids)"


def unpositioned_result(pair: Pair, run: Run, index: int) -> NodeResult | None:
    """A failing node when ours, called without ``position_ids`` on the run's left-padded batch (as a
    generation loop that passes none), gives at real tokens neither what it gives with the mask's positions
    (it derives them from the mask) nor what the reference gives without them (it follows the reference's own
    default): a bug the check itself, which passes ``position_ids``, never runs (an arange over the padding
    where the reference derives them; q and k rotated at positions derived two ways; rows rolled back the
    wrong way around a right-padding kernel). Compared with the reference at the mask's positions, at index
    ``index``. None otherwise (no padding, a family pair, a model that needs position_ids, or one whose
    forward is not repeatable)."""
    mask = run.attention_mask
    if (
        not pair.alignment
        or mask is None
        or not bool((mask == 0).any())
        or not _defaults_argument(pair.ours, "position_ids")
    ):
        return None
    real = mask.bool().cpu()

    def logits(model, with_positions: bool, **extra) -> torch.Tensor | None:
        kwargs = {"attention_mask": mask} | ({"position_ids": run.position_ids} if with_positions else {})
        t = _forward_logits(model, run.input_ids, **kwargs, **extra)
        return t[real] if t is not None and t.shape[:2] == real.shape else None

    # the reference without a cache, as the trace runs it (a hybrid's cache cannot always be built alone)
    ref_with, ref_without = (
        logits(pair.reference, True, use_cache=False),
        logits(pair.reference, False, use_cache=False),
    )
    ours_with, again, ours_without = logits(pair.ours, True), logits(pair.ours, True), logits(pair.ours, False)
    if ref_with is None or ref_without is None or ours_with is None or again is None or ours_without is None:
        return None
    scale = float(ref_with.abs().max()) or 1.0
    if not torch.equal(ours_with, again) or ours_without.shape != ref_without.shape:
        return None  # ours is not repeatable (a dropout left on): a difference says nothing about positions
    from_mask = float((ours_without - ours_with).abs().max())
    as_reference = float((ours_without - ref_without).abs().max())
    if min(from_mask, as_reference) <= MOVED * scale:
        return None
    ref_moved = float((ref_without - ref_with).abs().max())
    reference = (
        "the reference's stay (it derives each row's positions from the attention mask, or its RoPE is relative to "
        "them)"
        if ref_moved <= STILL * scale
        else f"the reference's own default moves its logits by {ref_moved:.3g}, and ours' differ from those by "
        f"{as_reference:.3g}"
    )
    spec = NodeSpec(UNPOSITIONED, UNPOSITIONED, reference="", kind="logits")
    result = compare_node(spec, index, ours_without, ref_with, Tolerances(atol=0.0, rtol=0.0))
    hint = Hint(
        "position_offset",
        f"likely the positions ours derives when given none: called without position_ids on this padded batch, "
        f"ours moves its logits by up to {from_mask:.3g} at real tokens while {reference}: ours derives other "
        "positions (an arange over the padding, q and k rotated at positions derived two ways) or moves its rows "
        "otherwise (padding rolled to the right and back by the wrong shift); the check's own nodes pass "
        "position_ids, so only this call shows it",
        {"moved": from_mask, "from_reference": as_reference, "reference_moved": ref_moved},
    )
    return replace(result, hint=hint, detail=f"ours called without position_ids, at real tokens; {result.detail}")


#: the node an unpadded check's forward with an all-ones attention_mask fails as (after the check's own nodes)
ALL_ONES = "logits (with an all-ones attention_mask)"


def all_ones_mask_result(pair: Pair, run: Run, index: int) -> NodeResult | None:
    """A failing node when ours, on the run's unpadded batch, gives other logits with an all-ones
    ``attention_mask`` (what a tokenizer hands every call) than without one, while the reference gives the
    same: a mask path the check itself, which calls an unpadded model without a mask, never runs (the causal
    triangle built only when no mask is given, the mask added where it should be combined). Compared with
    the reference, at index ``index``. None otherwise (a padded run, a family pair, a model whose forward
    takes no mask, or one whose forward is not repeatable)."""
    if not pair.alignment or run.attention_mask is not None or not _defaults_argument(pair.ours, "attention_mask"):
        return None
    ones, ids = torch.ones_like(run.input_ids), run.input_ids
    ref = _forward_logits(pair.reference, ids, attention_mask=ones, use_cache=False)  # as the trace runs it
    ours_plain, again = _forward_logits(pair.ours, ids), _forward_logits(pair.ours, ids)
    ours_masked = _forward_logits(pair.ours, ids, attention_mask=ones)
    if ref is None or ours_plain is None or again is None or ours_masked is None or ours_masked.shape != ref.shape:
        return None
    if not torch.equal(ours_plain, again):
        return None  # ours is not repeatable (a dropout left on): a difference says nothing about the mask
    scale = float(ref.abs().max()) or 1.0
    moved = float((ours_masked - ours_plain).abs().max())
    if moved <= MOVED * scale or float((ours_masked - ref).abs().max()) <= MOVED * scale:
        return None
    spec = NodeSpec(ALL_ONES, ALL_ONES, reference="", kind="logits")
    result = compare_node(spec, index, ours_masked, ref, Tolerances(atol=0.0, rtol=0.0))
    if ids.shape[-1] > 1 and _causal_with(pair.ours, ids, ones, scale):
        # ours stays causal with the mask (a later token changed moves no earlier logit): the mask moves something
        # else than which keys a query sees
        hint = Hint(
            "argument_slot",
            f"likely the attention_mask read as another input in ours: with an all-ones mask (no padding at all) ours "
            f"moves its logits by up to {moved:.3g} from its own without one, while it stays causal with it (changing "
            "the last token moves no earlier position's logits): the mask passed where another input goes "
            "(token_type_ids, position ids: a positional argument in the wrong slot), the reference does not move; the "
            "check's own nodes call ours without a mask, so only this call shows it",
            {"moved": moved},
        )
        return replace(result, hint=hint, detail=f"ours called with an all-ones attention_mask; {result.detail}")
    hint = Hint(
        "causal_mask",
        f"likely the mask ours builds when given an attention_mask: with an all-ones mask (no padding at all) ours "
        f"moves its logits by up to {moved:.3g} from its own without one, the reference does not: the causal "
        "triangle built only when no mask is given (a passed mask taken as the whole mask), or the mask added "
        "where it should be combined; the check's own nodes call ours without a mask, so only this call shows it",
        {"moved": moved},
    )
    return replace(result, hint=hint, detail=f"ours called with an all-ones attention_mask; {result.detail}")


def _causal_with(model, ids: torch.Tensor, mask: torch.Tensor, scale: float) -> bool:
    """Whether ``model`` called with ``mask`` keeps every position but the last where it was when the last token
    alone is changed (no earlier position sees a later one)."""
    other = ids.clone()
    other[:, -1] = (other[:, -1] + 1) % max(int(ids.max()) + 1, 2)
    first, second = _forward_logits(model, ids, attention_mask=mask), _forward_logits(model, other, attention_mask=mask)
    if first is None or second is None or first.shape != second.shape:
        return False
    # a causal forward computes each earlier position over the same keys, their weights unchanged: the same numbers
    return float((first[:, :-1] - second[:, :-1]).abs().max()) <= 1e-6 * scale


def _forward_logits(model, input_ids: torch.Tensor, **kwargs) -> torch.Tensor | None:
    """``model``'s logits (float32, on the CPU) for ``input_ids`` and ``kwargs`` (tensors moved to its device): its
    output's ``logits``, or its first tensor; None when it returns none."""
    device = device_of(model)
    with torch.no_grad():
        moved = {k: on_device(device, v) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
        out = model(on_device(device, input_ids), **moved)
    t = getattr(out, "logits", None)
    t = t if isinstance(t, torch.Tensor) else first_tensor(out)
    return t.detach().float().cpu() if isinstance(t, torch.Tensor) else None


def _defaults_argument(model, name: str) -> bool:
    """Whether ``model.forward`` takes ``name`` and runs without it (a default)."""
    try:
        param = inspect.signature(model.forward).parameters.get(name)
    except (TypeError, ValueError):
        return False
    return param is not None and param.default is not inspect.Parameter.empty
