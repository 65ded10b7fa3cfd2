"""An activation with learned parameters read back from its values: xIELU (Apertus), whose slopes are stored
reparametrised (``softplus`` of raw parameters), so a port that reads them otherwise computes the same shape of
function with other coefficients, or drops a term of one branch.

xIELU (Huang et al. 2024, "Deriving Activation Functions Using Integration", arXiv:2411.13010; Transformers'
``XIELUActivation``)::

    a_p = softplus(alpha_p),  a_n = beta + softplus(alpha_n)
    f(x) = a_p x^2 + beta x                        x > 0
         = a_n (expm1(min(x, eps)) - x) + beta x   x <= 0

Both branches are linear in two coefficients: ``p2 x^2 + p1 x`` and ``n1 expm1(x) + n2 x`` (xIELU's ``n2`` is
``beta - a_n``; an ELU-style negative branch without the ``- x`` term has ``n2 = beta``). Each side's four
coefficients are fitted by least squares and named against expressions of the reference's own scalars.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from parity.diagnose.evidence import EXPLAINS, Evidence, rel
from parity.diagnose.hints import Hint
from parity.record.trace import SCALARS

#: the reference's raw xIELU parameters and buffer, by the last part of their path
_NAMES = ("alpha_p", "alpha_n", "beta")


def _xielu_scalars(e: Evidence) -> dict[str, float] | None:
    """``{"alpha_p", "alpha_n", "beta"}`` of the reference's xIELU module in this node's layer (its one-element
    parameters and buffer, from the trace's reference scalars), or None when the layer has none."""
    scalars = e.ref_trace.extras.get(SCALARS)
    if not isinstance(scalars, dict) or e.result.layer is None:
        return None
    found: dict[str, dict[str, float]] = {}
    for path, value in scalars.items():
        module, _, leaf = path.rpartition(".")
        if leaf in _NAMES and e.facts.locate(path)[0] == e.result.layer:
            found.setdefault(module, {})[leaf] = float(value)
    return next((v for v in found.values() if len(v) == len(_NAMES)), None)


def _fit(x: torch.Tensor, y: torch.Tensor) -> tuple[float, float, float, float, float] | None:
    """``(p2, p1, n1, n2, n0)`` with ``y = p2 x^2 + p1 x`` where ``x > 0`` and ``y = n1 expm1(x) + n2 x + n0`` where
    ``x <= 0`` (least squares in float64; ``n0`` is ``n1`` for ``exp`` in place of ``expm1``), or None when either
    branch has too few points or the fit does not reproduce ``y``."""
    x, y = x.double().flatten(), y.double().flatten()
    coefficients = []
    negative = (x <= 0, lambda t: (torch.expm1(t), t, torch.ones_like(t)))
    for keep, basis in ((x > 0, lambda t: (t * t, t)), negative):
        if int(keep.sum()) < 8:
            return None
        a = torch.stack(basis(x[keep]), dim=1)
        solution = torch.linalg.lstsq(a, y[keep, None]).solution.flatten()
        if rel(a @ solution, y[keep]) > EXPLAINS:
            return None
        coefficients += [float(c) for c in solution]
    p2, p1, n1, n2, n0 = coefficients
    return p2, p1, n1, n2, n0


def _named(value: float, candidates: dict[str, float]) -> str:
    """The first candidate expression equal to ``value`` (relative 1e-3), else the number itself."""
    for text, v in candidates.items():
        if abs(value - v) <= 1e-3 * max(abs(v), 1e-3):
            return text
    return f"{value:.4g}"


def _read(coefficients: tuple[float, float, float, float, float], s: dict[str, float]) -> dict[str, str]:
    """Each coefficient of one side's fit named by an expression of the reference's scalars."""
    p2, p1, n1, n2, n0 = coefficients
    ap, an, beta = s["alpha_p"], s["alpha_n"], s["beta"]
    sp = {"alpha_p": float(F.softplus(torch.tensor(ap, dtype=torch.float64))),
          "alpha_n": float(F.softplus(torch.tensor(an, dtype=torch.float64)))}  # fmt: skip
    a_p = {
        "softplus(alpha_p)": sp["alpha_p"],
        "alpha_p (raw: softplus not applied)": ap,
        "softplus(alpha_n) (alpha_n's: the two exchanged)": sp["alpha_n"],
        "beta + softplus(alpha_n) (a_n's: the two exchanged)": beta + sp["alpha_n"],
    }
    a_n = {
        "beta + softplus(alpha_n)": beta + sp["alpha_n"],
        "beta + alpha_n (raw: softplus not applied)": beta + an,
        "softplus(alpha_n) (beta not added)": sp["alpha_n"],
        "alpha_n (raw, beta not added)": an,
        "beta + softplus(alpha_p) (alpha_p's: the two exchanged)": beta + sp["alpha_p"],
        "softplus(alpha_p) (alpha_p's: the two exchanged, beta not added)": sp["alpha_p"],
    }
    x_terms = {"beta - a_n (xIELU's - x term)": beta - n1, "beta (the - x term dropped: an ELU-style branch)": beta,
               "0 (beta x dropped)": 0.0, "- a_n (beta x dropped)": -n1}  # fmt: skip
    return {
        "a_p": _named(p2, a_p),
        "positive x term": _named(p1, {"beta": beta, "0 (beta x dropped)": 0.0, "1": 1.0}),
        "a_n": _named(n1, a_n),
        "negative x term": _named(n2, x_terms),
        "negative constant": _named(n0, {"0": 0.0, "a_n (exp(x) in place of expm1(x) = exp(x) - 1)": n1}),
    }


#: the reference formula's reading of each coefficient (Transformers' ``XIELUActivation._xielu_python``)
_CANONICAL = {
    "a_p": "softplus(alpha_p)",
    "positive x term": "beta",
    "a_n": "beta + softplus(alpha_n)",
    "negative x term": "beta - a_n (xIELU's - x term)",
    "negative constant": "0",
}


def xielu_parameters(e: Evidence, ours: torch.Tensor, ref: torch.Tensor, pre: torch.Tensor, where: str) -> Hint | None:
    """Both sides' values are xIELU-shaped functions of the reference's pre-activation ``pre`` (same shape,
    e.g. ``up_proj``'s output) and one side's coefficients are not what the reference's module computes from
    its scalars ``alpha_p``, ``alpha_n``, ``beta``: each differing coefficient named (softplus not applied,
    beta not added to ``a_n``, the slopes exchanged, the negative branch's ``- x`` dropped). Either side."""
    s = _xielu_scalars(e)
    if s is None or pre.shape != ref.shape or ours.shape != ref.shape:
        return None
    fits = {side: _fit(pre, y) for side, y in (("ours", ours), ("the reference", ref))}
    if any(f is None for f in fits.values()):
        return None
    read = {side: _read(f, s) for side, f in fits.items() if f is not None}
    off = [side for side, r in read.items() if r != _CANONICAL]
    if len(off) != 1:
        return None
    side, other = off[0], "the reference" if off[0] == "ours" else "ours"
    wrong = {k: v for k, v in read[side].items() if v != _CANONICAL[k]}
    said = "; ".join(f"{k} = {v} (the formula: {_CANONICAL[k]})" for k, v in wrong.items())
    return Hint(
        "activation",
        f"likely xIELU's parameters read otherwise in {side}: {where}both sides are xIELU of the reference's "
        f"pre-activation (x > 0: a_p x^2 + beta x; x <= 0: a_n (expm1(x) - x) + beta x, a_p = softplus(alpha_p), "
        f"a_n = beta + softplus(alpha_n)), {other} as written, {side} with {said}",
        {"side": side, "ours": read["ours"], "reference": read["the reference"], "scalars": s},
    )
