"""Hints for a training-parity check (:mod:`parity.run.backward`): why a gradient, the loss, the
train-mode forward or causality differs.

Each detector is a function of the tensors it reads and returns a
:class:`~parity.diagnose.hints.Hint` or None; each stays silent unless the pattern is exact (no hint
is better than a wrong one):

* :func:`detached`: ours never receives a gradient at a node (or an all-zero one) where the
  reference's is non-zero: a ``.detach()``, ``torch.no_grad()`` or a tensor rebuilt from ``.data``;
* :func:`in_place`: ours' backward raised the autograd error of an in-place op;
* :func:`untied_copy`: ours keeps two Parameters for one tensor the reference ties: each copy's
  gradient differs from the reference's while their sum matches it;
* :func:`loss_hints`: what the gradient at the logits says about the loss. For Transformers'
  ``ForCausalLMLoss`` (cross-entropy, mean over the positions whose label is not -100) the gradient
  at position ``t`` is ``(softmax(logits[t]) - onehot(target_t)) / N``: every entry positive but the
  target's, so the target each position is trained toward is read from its one negative entry
  (:func:`trained_targets`), and a position the loss ignores has a zero row. ``label_shift``: ours
  trains position ``t`` toward the target the reference trains ``t + d`` toward; ``loss_mask``: ours
  trains positions the reference ignores (padding) or ignores ones it trains, the others agreeing
  up to the one factor the mean's count changes;
* :func:`dropout`: a model's forward in train mode differs from its eval mode although every
  dropout parity can see was set to 0;
* :func:`future_leak`: a node's values at position ``t`` change when only tokens after ``t`` change.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from parity.diagnose.hints import Hint


def fmt_positions(values: Sequence[object], limit: int = 6) -> str:
    shown = ", ".join(str(v) for v in values[:limit])
    return shown + (f", ... ({len(values)} in all)" if len(values) > limit else "")


def detached(name: str, ref_grad: torch.Tensor, ours_zero: bool, cut: str | None = None) -> Hint | None:
    """Ours has no gradient at ``name`` (``ours_zero``: an all-zero one) where the reference's is
    non-zero. ``cut``: the earliest node (forward order) of the run of ours' nodes carrying no gradient
    at all that ends at ``name`` (``requires_grad`` False from there on: the graph is cut where ``cut``
    is computed); None when ours' tensor at ``name`` requires grad but no gradient reached it (the
    graph is cut after it)."""
    if ref_grad.numel() == 0:
        return None
    peak = float(ref_grad.double().abs().max())
    if not peak > 0:
        return None
    node = name.split("/", 1)[-1]
    if ours_zero:
        where = f"ours' gradient at {node} is all zero (a straight-through x + (f(x) - x).detach(), or a multiply by 0)"
    elif cut is not None:
        start = cut.split("/", 1)[-1]
        span = start if start == node else f"{start} .. {node}"
        where = (
            f"ours' tensors carry no gradient at all (requires_grad False) at {span}: the graph is cut where "
            f"{start} is computed (its inputs carry one)"
        )
    else:
        where = f"ours' tensor at {node} requires grad but no gradient reaches it: the graph is cut after it"
    return Hint(
        "detached",
        f"likely a .detach(), torch.no_grad() or .data in ours: {where}; the reference's gradient there is "
        f"non-zero (max |g| {peak:.3g}), so nothing before that point learns through it",
        {"reference_max_abs": peak, "ours": "zero" if ours_zero else "none", "cut": (cut or name).split("/", 1)[-1]},
    )


def in_place(message: str) -> Hint:
    """Ours' backward raised (``message``, one line): the autograd error an in-place op causes when it
    overwrites a tensor a backward formula reads, or another autograd error."""
    text = message if len(message) <= 300 else message[:297] + "..."
    if "inplace" in message.replace("in-place", "inplace").lower():
        return Hint(
            "in_place",
            f"likely an in-place op in ours (x.mul_(), x[...] = ..., an out= buffer reused) overwriting a tensor "
            f"its backward reads: ours' backward raised, and no gradient reached this node: {text}",
            {"error": text},
        )
    return Hint(
        "in_place",
        f"ours' backward raised before this node's gradient was computed (an autograd error, e.g. of a custom "
        f"autograd.Function): {text}",
        {"error": text},
    )


def untied_copy(
    ref_grad: torch.Tensor, copies: list[tuple[str, torch.Tensor]], atol: float, rtol: float
) -> Hint | None:
    """The reference ties this parameter (one tensor, one gradient summing every use); ours holds it
    as several Parameters (``copies``: ``(name, gradient in the reference's layout)``). A hint when
    no copy's gradient alone agrees and their sum does (within ``atol + rtol |ref|``)."""
    if len(copies) < 2 or any(g.shape != ref_grad.shape for _, g in copies):
        return None
    ref = ref_grad.double()
    bound = atol + rtol * ref.abs()

    def fits(t: torch.Tensor) -> bool:
        return bool(((t.double() - ref).abs() <= bound + 1e-12 * float(ref.abs().max())).all())

    total = torch.stack([g.double() for _, g in copies]).sum(0)
    if any(fits(g) for _, g in copies) or not fits(total):
        return None
    names = [name for name, _ in copies]
    share = [float(g.double().abs().sum() / max(float(ref.abs().sum()), 1e-300)) for _, g in copies]
    return Hint(
        "untied_copy",
        f"likely an untied copy: the reference ties this tensor (one Parameter, one gradient summing both uses), "
        f"ours holds it as {len(copies)} Parameters ({', '.join(names)}): each gets the gradient of its own use "
        f"and their sum equals the reference's. The forward agrees; a training step would update the copies "
        f"apart. Tie them (out_head.weight = tok_emb.weight)",
        {"copies": names, "share_of_gradient": [round(s, 4) for s in share]},
    )


def trained_targets(grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(targets, trained)`` ``(batch, seq)`` from a cross-entropy gradient at the logits ``(batch,
    seq, vocab)``: each position's one negative entry is the token it is trained toward (``targets``,
    -1 where none), ``trained`` False where the row is all zero (a position the loss ignores) or has
    no single negative entry."""
    flat = grad.double().reshape(-1, grad.shape[-1])
    low, index = flat.min(dim=-1)
    single = (flat < 0).sum(-1) == 1
    trained = (low < 0) & single
    targets = torch.where(trained, index, torch.full_like(index, -1))
    return targets.reshape(grad.shape[:-1]), trained.reshape(grad.shape[:-1])


def _shift(a: torch.Tensor, d: int) -> tuple[slice, slice]:
    seq = a.shape[-1]
    return slice(max(0, -d), seq - max(0, d)), slice(max(0, d), seq + min(0, d))


def label_shift(ours_grad: torch.Tensor, ref_grad: torch.Tensor) -> Hint | None:
    """Ours trains position ``t`` toward the token the reference trains ``t + d`` toward (``d != 0``)
    at every position both train, and not at ``d = 0``: labels shifted once more, or once less,
    than Transformers' convention (``logits[:, :-1]`` against ``labels[:, 1:]``)."""
    if ours_grad.shape != ref_grad.shape or ours_grad.dim() != 3:
        return None
    ours_t, ours_ok = trained_targets(ours_grad)
    ref_t, ref_ok = trained_targets(ref_grad)
    both = ours_ok & ref_ok
    if int(both.sum()) >= 3 and bool((ours_t[both] == ref_t[both]).float().mean() > 0.5):
        return None  # the same targets: not a shift
    for d in (-1, 1, -2, 2):
        mine, theirs = _shift(ours_t, d)
        ok = ours_ok[:, mine] & ref_ok[:, theirs]
        n = int(ok.sum())
        if n >= 3 and bool((ours_t[:, mine][ok] == ref_t[:, theirs][ok]).all()):
            if d == -1:
                how = (
                    "its loss does not shift the labels (logits[t] against labels[t]: the token itself); Transformers "
                    "shifts inside the loss, logits[:, :-1] against labels[:, 1:], and takes labels = input_ids"
                )
            elif d > 0:
                how = (
                    f"the labels are shifted {'twice' if d == 1 else f'{d + 1} times'} (once by the data, once more in "
                    "the loss); Transformers shifts once, inside the loss, and takes labels = input_ids"
                )
            else:
                how = f"the labels are shifted {-d} positions the wrong way"
            return Hint(
                "label_shift",
                f"likely a label shift: ours trains position t toward the token the reference trains position "
                f"t {'+' if d > 0 else '-'} {abs(d)} toward, at all {n} positions both train: {how}",
                {"shift": d, "positions": n},
            )
    return None


def loss_mask(ours_grad: torch.Tensor, ref_grad: torch.Tensor) -> Hint | None:
    """Ours trains positions the reference's loss ignores (a zero row there: padding, label -100), or
    ignores positions it trains, while on the positions both train the targets agree and the
    gradients differ by one factor at most (the mean over another count of tokens)."""
    if ours_grad.shape != ref_grad.shape or ours_grad.dim() != 3:
        return None
    ours_rows = (ours_grad != 0).any(-1)
    ref_rows = (ref_grad != 0).any(-1)
    extra = ours_rows & ~ref_rows
    dropped = ref_rows & ~ours_rows
    both = ours_rows & ref_rows
    if not (bool(extra.any()) or bool(dropped.any())) or int(both.sum()) < 1:
        return None
    ours_t, ours_ok = trained_targets(ours_grad)
    ref_t, ref_ok = trained_targets(ref_grad)
    shared = both & ours_ok & ref_ok
    if not bool(shared.any()) or not bool((ours_t[shared] == ref_t[shared]).all()):
        return None
    a, b = ours_grad[both].double(), ref_grad[both].double()
    factor = float((a * b).sum() / (b * b).sum()) if float((b * b).sum()) > 0 else float("nan")
    residual = float((a - factor * b).norm() / max(float(a.norm()), 1e-300))
    if not residual < 1e-3:
        return None
    parts = []
    if bool(extra.any()):
        where = [f"{int(r)}:{int(c)}" for r, c in extra.nonzero().tolist()]
        parts.append(
            f"ours trains {len(where)} position(s) the reference ignores (batch:position {fmt_positions(where)}: "
            "label -100, padding or the last position)"
        )
    if bool(dropped.any()):
        where = [f"{int(r)}:{int(c)}" for r, c in dropped.nonzero().tolist()]
        parts.append(f"ours ignores {len(where)} position(s) the reference trains ({fmt_positions(where)})")
    return Hint(
        "loss_mask",
        f"likely the loss mask: {'; '.join(parts)}; on the positions both train the targets agree and ours' "
        f"gradient is the reference's times {factor:.4g} (the mean over another number of tokens): a loss over "
        "padding, or labels not set to -100 where the attention mask is 0",
        {
            "extra_positions": int(extra.sum()),
            "dropped_positions": int(dropped.sum()),
            "factor": factor,
        },
    )


def loss_hints(ours_grad: torch.Tensor | None, ref_grad: torch.Tensor | None) -> Hint | None:
    """:func:`label_shift`, else :func:`loss_mask`, from both gradients at the logits ``(batch, seq, vocab)``."""
    if ours_grad is None or ref_grad is None:
        return None
    return label_shift(ours_grad, ref_grad) or loss_mask(ours_grad, ref_grad)


def dropout(models: list[str], changes: list[float]) -> Hint | None:
    """``models`` (``ours``, ``the reference``) compute other logits in train mode than in eval mode
    (by ``changes``, max |train - eval|) although parity set every dropout it found to 0."""
    if not models:
        return None
    which = " and ".join(models)
    return Hint(
        "dropout",
        f"likely dropout (or another train-only path) left on in {which}: its logits in train mode differ from its "
        f"logits in eval mode (max |train - eval| {', '.join(f'{c:.3g}' for c in changes)}) although every nn.Dropout "
        "and every float attribute named *dropout* was set to 0; a probability written into forward "
        "(F.dropout(x, 0.1, training=self.training)) stays on, and gradients are not compared",
        {"models": models, "max_change": changes},
    )


def future_leak(node: str, positions: list[int], change: float) -> Hint:
    """``node`` of ours at position ``t`` (``positions``: the ``t`` that did) changes when only tokens
    after ``t`` change (by ``change`` at most): it sees the future."""
    return Hint(
        "future_leak",
        f"likely a causality leak: {node.split('/', 1)[-1]} at position t changes when only tokens after t change "
        f"(t = {fmt_positions(positions)}; max change {change:.3g}), the first node where it does: a causal mask "
        "off by one (j <= i + 1), a mask not applied, a convolution padded on the wrong side",
        {"positions": positions[:32], "max_change": change},
    )
