"""The step order of a delta-rule scan: a Gated DeltaNet's or a Kimi Delta Attention's recurrence run with its
four steps (decay the state, read its prediction ``S^T k``, write ``k (beta (v - S^T k))^T``, read the output
``S^T q``) in another order, the porting mistake one line moved makes. The reference's scan function (a
module-level function of its modeling code whose name says so: Transformers' ``torch_chunk_gated_delta_rule``,
``chunk_kimi_delta_attention``) is replaced, for one search pass, by :func:`delta_rule` in one order.

The formulas are Transformers' ``torch_recurrent_gated_delta_rule`` (Qwen3-Next) and
``recurrent_kimi_delta_attention`` (Kimi Linear), after Yang et al., "Gated Delta Networks" (2024): with
``q`` and ``k`` optionally L2-normalised (eps 1e-6 inside the root), ``q`` scaled by ``1 / sqrt(d_k)``,

    S_t = exp(g_t) S_{t-1};  u_t = beta_t (v_t - S_t^T k_t);  S_t = S_t + k_t u_t^T;  o_t = S_t^T q_t.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable

import torch

#: the orders of one step; the first is Transformers' (and FLA's)
ORDERS: dict[str, str] = {
    "decay_first": "decayed, read, written, then read for the output (Transformers' order)",
    "decay_after_update": "read and written before its decay (the state decayed after the update)",
    "read_before_decay": "read for its prediction S^T k before this step's decay",
    "output_before_update": "read for the output before this step's write",
}
#: the order Transformers' scans run (the replacement's in that order must reproduce the original's output)
OWN = "decay_first"
#: names of the reference's scan functions (module-level, called by name in the block's forward)
_NAMES = ("delta_rule", "delta_attention")


def scan_functions(block: torch.nn.Module) -> list[tuple[str, str, Callable]]:
    """The delta-rule scan functions the modeling code of ``block``'s class calls by name: ``(module name,
    global name, function)`` each, in the module's order."""
    module = sys.modules.get(type(block).__module__)
    if module is None:
        return []
    found = []
    for name, value in vars(module).items():
        if callable(value) and not inspect.isclass(value) and any(n in name for n in _NAMES):
            found.append((module.__name__, name, value))
    return found


def delta_rule(original: Callable, order: str) -> Callable:
    """A replacement for ``original`` (a scan taking ``query, key, value, g, beta`` of shape ``(batch, seq,
    heads, dim)``, ``g`` the log decay ``(batch, seq, heads)`` or per key channel ``(batch, seq, heads, d_k)``,
    ``beta`` ``(batch, seq, heads)``) computing the recurrence step by step in ``order`` (a key of
    :data:`ORDERS`); returns ``(output (batch, seq, heads_v, d_v), final state or None)`` as the original does.
    Key heads fewer than value heads are repeated (each serves consecutive value heads). Raises TypeError when
    the call does not bind to the original's signature."""
    signature = inspect.signature(original)

    def scan(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        a = dict(bound.arguments)
        a.update(a.pop("kwargs", None) or {})
        out, state = _recurrence(
            order,
            a["query"],
            a["key"],
            a["value"],
            a["g"],
            a["beta"],
            a.get("initial_state"),
            bool(a.get("use_qk_l2norm_in_kernel", False)),
            a.get("scale"),
        )
        return out, state if a.get("output_final_state") else None

    scan.order = order  # type: ignore[attr-defined]  # which order it computes (OWN: the one to reproduce)
    return scan


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def _recurrence(
    order: str,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial: torch.Tensor | None,
    l2: bool,
    scale: float | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    dtype = query.dtype
    heads_k, heads_v = key.shape[2], value.shape[2]
    if heads_k != heads_v:
        query = query.repeat_interleave(heads_v // heads_k, dim=2)
        key = key.repeat_interleave(heads_v // heads_k, dim=2)
    q, k, v, g, beta = (x.float() for x in (query, key, value, g, beta))
    if l2:
        q, k = _l2norm(q), _l2norm(k)
    q = q * (scale if scale is not None else q.shape[-1] ** -0.5)
    batch, seq, heads, d_k = k.shape
    state = (
        torch.zeros(batch, heads, d_k, v.shape[-1], dtype=torch.float32, device=v.device)
        if initial is None
        else initial.float()
    )
    outs = []
    for t in range(seq):
        decay = g[:, t].exp()
        decay = decay[..., None, None] if decay.dim() == 2 else decay[..., None]  # per head, or per key channel
        k_t, v_t, q_t, b_t = k[:, t], v[:, t], q[:, t], beta[:, t][..., None]
        if order != "read_before_decay" and order != "decay_after_update":
            state = state * decay
        written = k_t[..., None] * (b_t * (v_t - (state * k_t[..., None]).sum(-2)))[..., None, :]
        if order == "read_before_decay":
            state = state * decay
        if order == "output_before_update":
            outs.append((state * q_t[..., None]).sum(-2))
        state = state + written
        if order == "decay_after_update":
            state = state * decay
        if order != "output_before_update":
            outs.append((state * q_t[..., None]).sum(-2))
    return torch.stack(outs, 1).to(dtype), state
