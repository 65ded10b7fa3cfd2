"""Positions a user's model derives itself: a padded check hands both models ``position_ids`` counted over
each row's real tokens (as ``generate`` does), so a model that computes them otherwise when none are
given (an ``arange`` over the padding) agrees in the check and differs in a generation loop that passes
none. One more forward of each side without them tells: the reference's logits stay where it derives
its positions from the mask itself (OPT, GPT-Neo's own ``generate`` path), and then ours' must too."""

from __future__ import annotations

import inspect

import torch

from parity.model.pair import Pair
from parity.record.trace import first_tensor
from parity.run.plan import Run
from parity.run.stages import device_of, on_device

#: how far (relative to the logits' largest magnitude) the reference may move without position_ids and
#: still count as deriving the same positions, and how far ours must move to be said to derive others
STILL, MOVED = 1e-5, 1e-3


def _defaults_position_ids(model) -> bool:
    """Whether ``model.forward`` takes ``position_ids`` and runs without them (a default)."""
    try:
        param = inspect.signature(model.forward).parameters.get("position_ids")
    except (TypeError, ValueError):
        return False
    return param is not None and param.default is not inspect.Parameter.empty


def derived_positions_note(pair: Pair, run: Run) -> str | None:
    """A note when ours, called without ``position_ids`` on the run's left-padded batch, moves its logits at
    real tokens while the reference's stay (the reference derives the positions from the mask; ours
    derives others): a bug the check itself, which passes ``position_ids``, never runs. None otherwise
    (no padding, a family pair, a model that needs position_ids, or one whose forward is not repeatable)."""
    mask = run.attention_mask
    if not pair.alignment or mask is None or not bool((mask == 0).any()) or not _defaults_position_ids(pair.ours):
        return None
    real = mask.bool().cpu()

    def logits(model, with_positions: bool) -> torch.Tensor | None:
        device = device_of(model)
        kwargs = {"attention_mask": on_device(device, mask)}
        if with_positions:
            kwargs["position_ids"] = on_device(device, run.position_ids)
        with torch.no_grad():
            out = model(on_device(device, run.input_ids), **kwargs)
        t = getattr(out, "logits", None)
        t = t if isinstance(t, torch.Tensor) else first_tensor(out)
        return t.detach().float().cpu()[real] if isinstance(t, torch.Tensor) and t.shape[:2] == real.shape else None

    ref_with, ref_without = logits(pair.reference, True), logits(pair.reference, False)
    ours_with, again, ours_without = logits(pair.ours, True), logits(pair.ours, True), logits(pair.ours, False)
    if ref_with is None or ref_without is None or ours_with is None or again is None or ours_without is None:
        return None
    scale = float(ref_with.abs().max()) or 1.0
    if not torch.equal(ours_with, again):
        return None  # ours is not repeatable (a dropout left on): a difference says nothing about positions
    ref_moved = float((ref_without - ref_with).abs().max())
    ours_moved = float((ours_without - ours_with).abs().max())
    if ref_moved > STILL * scale or ours_moved <= MOVED * scale:
        return None
    return (
        f"positions: called without position_ids on this padded batch (as a generation loop that passes none), "
        f"ours moves its logits by up to {ours_moved:.3g} at real tokens while the reference's stay within "
        f"{ref_moved:.2g}: the reference's result does not depend on them (it derives each row's positions from the "
        "attention mask, or its RoPE is relative to them), ours derives others (an arange over the padding, or q "
        "and k rotated at positions derived two ways?); the check passes position_ids, so its nodes cannot show this"
    )
