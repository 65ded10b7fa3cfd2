"""The step order of a recurrent scan, the porting mistake one line moved makes. The reference's scan function (a
module-level function of its modeling code whose name says so) is replaced, for one search pass, by a recurrence
written here in one order:

* a delta-rule scan (:func:`delta_rule`: Transformers' ``torch_chunk_gated_delta_rule``,
  ``chunk_kimi_delta_attention``), a Gated DeltaNet's or a Kimi Delta Attention's four steps (decay the state,
  read its prediction ``S^T k``, write ``k (beta (v - S^T k))^T``, read the output ``S^T q``) in another order;
* a selective scan (:func:`selective_scan`: Mamba's ``mamba_selective_scan``, Mamba-2's ``mamba2_chunk_scan``),
  its state decayed and written in another order, its input matrix discretised by zero-order hold instead of
  Mamba's Euler step, the output read before the write, the skip ``D x`` added after the gate;
* RWKV's WKV recurrence (:func:`wkv`: Transformers' ``rwkv_linear_attention``), its output read after this
  step's write (no bonus), its state decayed after the write;
* an mLSTM cell (:func:`mlstm`: xLSTM's kernels, bound by its backend module at init, so the module's output is
  replaced instead), its gates through other functions, the output read before the write, the old state decayed
  without the stabiliser.

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
#: the orders of a selective scan's step (Gu and Dao, "Mamba", 2023, eq. 2a-2b and 4; Dao and Gu, "Transformers
#: are SSMs", 2024, for Mamba-2's scalar decay per head); the first is Transformers' (and the mamba_ssm kernels')
SSM_ORDERS: dict[str, str] = {
    "euler_B": "decayed, written dt B x, then read for the output C h, D x added before the gate (Transformers' order)",
    "zoh_B": "written (exp(dt A) - 1) / A B x (B discretised by zero-order hold, not Mamba's dt B)",
    "output_before_update": "read for the output C h before this step's write",
    "decay_after_update": "written before its decay (exp(dt A) (h + dt B x))",
    "D_after_gate": "read with the skip D x added after the output gate silu(z), not before it",
    "D_discretised": "read with the skip on the discretised input (D dt x), not D x",
}
#: the orders of RWKV's WKV step (Peng et al., "RWKV: Reinventing RNNs for the Transformer Era", 2023, eq. 14-16:
#: ``wkv_t = (a + e^{u + k_t} v_t) / (b + e^{u + k_t})``, then ``a = e^w a + e^{k_t} v_t`` with ``w = -exp(decay)``);
#: the first is Transformers'
WKV_ORDERS: dict[str, str] = {
    "bonus_first": "read for the output with the bonus e^{u + k_t}, then decayed and written (Transformers' order)",
    "output_after_update": "written with this step's e^{k_t} v_t before it is read for the output (no bonus u)",
    "decay_after_update": "written before its decay (e^w (a + e^{k_t} v_t))",
}
#: names of the reference's WKV functions
WKV_NAMES = ("rwkv_linear_attention",)
#: the order Transformers' delta-rule scans run (the replacement's in that order must reproduce the original's)
OWN = "decay_first"
#: names of the reference's delta-rule scan functions (module-level, called by name in the block's forward)
_NAMES = ("delta_rule", "delta_attention")
#: names of the reference's selective scan functions
SSM_NAMES = ("mamba_selective_scan", "mamba2_chunk_scan")


def scan_functions(block: torch.nn.Module) -> list[tuple[str, str, Callable]]:
    """The delta-rule and selective scan functions the modeling code of ``block``'s class calls by name:
    ``(module name, global name, function)`` each, in the module's order."""
    module = sys.modules.get(type(block).__module__)
    if module is None:
        return []
    found = []
    for name, value in vars(module).items():
        if (
            callable(value)
            and not inspect.isclass(value)
            and (any(n in name for n in _NAMES) or name in SSM_NAMES or name in WKV_NAMES)
        ):
            found.append((module.__name__, name, value))
    return found


def replacements(name: str, original: Callable) -> list[tuple[Callable, str]]:
    """Every replacement of the scan function ``name`` (one of :func:`scan_functions`), with the words saying
    its order; the first is in the reference's own order (it must reproduce the original before the others
    are tried: each carries ``own``)."""
    if name in SSM_NAMES:
        gated = "z" in inspect.signature(original).parameters  # Mamba-2's scan takes no gate: no D after it
        return [
            (selective_scan(original, o), f"the selective scan with its state {w}")
            for o, w in SSM_ORDERS.items()
            if gated or o != "D_after_gate"
        ]
    if name in WKV_NAMES:
        return [(wkv(original, o), f"the WKV recurrence with its state {w}") for o, w in WKV_ORDERS.items()]
    return [(delta_rule(original, o), f"the delta-rule scan with its state {w}") for o, w in ORDERS.items()]


def wkv(original: Callable, order: str) -> Callable:
    """A replacement for ``original``, RWKV's ``rwkv_linear_attention(time_decay, time_first, key, value, state,
    return_state)`` (``time_decay`` and ``time_first`` ``(channels,)``, ``key`` and ``value`` ``(batch, seq,
    channels)``, ``state`` the list ``[numerator, denominator, max]`` of ``(batch, channels)`` or None), computing
    the recurrence step by step in ``order`` (a key of :data:`WKV_ORDERS`), stabilised by the running max as
    Transformers' CPU path is; returns ``(output (batch, seq, channels), state or None)``. Raises TypeError when
    the call does not bind to the original's signature."""
    signature = inspect.signature(original)

    def scan(*args, **kwargs):
        a = bound_arguments(signature, args, kwargs)
        k, v = _wide(a["key"]), _wide(a["value"])
        w, u = -torch.exp(_wide(a["time_decay"])), _wide(a["time_first"])
        state = a.get("state")
        if state is None:
            num, den = torch.zeros_like(k[:, 0]), torch.zeros_like(k[:, 0])
            top = torch.full_like(k[:, 0], -1e38)
        else:
            num, den, top = (_wide(s) for s in state)
        outs = []
        for t in range(k.shape[1]):
            k_t, v_t = k[:, t], v[:, t]
            if order != "output_after_update":
                m = torch.maximum(top, u + k_t)
                e1, e2 = torch.exp(top - m), torch.exp(u + k_t - m)
                outs.append((e1 * num + e2 * v_t) / (e1 * den + e2))
            if order == "decay_after_update":
                m = torch.maximum(top, k_t)
                e1, e2 = torch.exp(top - m), torch.exp(k_t - m)
                num, den, top = e1 * num + e2 * v_t, e1 * den + e2, m + w
            else:
                m = torch.maximum(top + w, k_t)
                e1, e2 = torch.exp(top + w - m), torch.exp(k_t - m)
                num, den, top = e1 * num + e2 * v_t, e1 * den + e2, m
            if order == "output_after_update":
                outs.append(num / den)
        out = torch.stack(outs, 1).to(a["key"].dtype)
        return out, ([num, den, top] if a.get("return_state") or state is not None else None)

    scan.order = order  # type: ignore[attr-defined]
    scan.own = order == next(iter(WKV_ORDERS))  # type: ignore[attr-defined]
    return scan


def delta_rule(original: Callable, order: str) -> Callable:
    """A replacement for ``original`` (a scan taking ``query, key, value, g, beta`` of shape ``(batch, seq,
    heads, dim)``, ``g`` the log decay ``(batch, seq, heads)`` or per key channel ``(batch, seq, heads, d_k)``,
    ``beta`` ``(batch, seq, heads)``) computing the recurrence step by step in ``order`` (a key of
    :data:`ORDERS`); returns ``(output (batch, seq, heads_v, d_v), final state or None)`` as the original does.
    Key heads fewer than value heads are repeated (each serves consecutive value heads). Raises TypeError when
    the call does not bind to the original's signature."""
    signature = inspect.signature(original)

    def scan(*args, **kwargs):
        a = bound_arguments(signature, args, kwargs)
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

    scan.order = order  # type: ignore[attr-defined]  # which order it computes
    scan.own = order == OWN  # type: ignore[attr-defined]  # the one that must reproduce the original
    return scan


def selective_scan(original: Callable, order: str) -> Callable:
    """A replacement for ``original``, a selective scan, computing the recurrence step by step in ``order`` (a
    key of :data:`SSM_ORDERS`). Two signatures, told apart by ``chunk_size``:

    * Mamba's ``mamba_selective_scan(hidden_states, dt, A, B, C, D, z, delta_bias, delta_softplus,
      return_last_state)``: ``hidden_states``, ``dt`` and ``z`` ``(batch, channels, seq)``, ``A`` ``(channels,
      state)``, ``B`` and ``C`` ``(batch, state, seq)``, ``D`` ``(channels,)``; returns ``(batch, channels,
      seq)``, with the last state ``(batch, channels, state)`` when asked;
    * Mamba-2's ``mamba2_chunk_scan(hidden_states, dt, A, B, C, chunk_size, D, dt_bias, initial_states,
      dt_softplus, dt_limit, return_final_states)``: ``hidden_states`` ``(batch, seq, heads, head_dim)``, ``dt``
      ``(batch, seq, heads)``, ``A`` ``(heads,)``, ``B`` and ``C`` ``(batch, seq, groups, state)`` (each group
      serving consecutive heads), ``D`` ``(heads,)``; returns float32 ``(batch, seq, heads, head_dim)``, with
      the final state ``(batch, heads, head_dim, state)`` when asked.

    Raises TypeError when the call does not bind to the original's signature."""
    signature = inspect.signature(original)

    def scan(*args, **kwargs):
        a = bound_arguments(signature, args, kwargs)
        if "chunk_size" in a:
            return _mamba2(order, a)
        return _mamba1(order, a)

    scan.order = order  # type: ignore[attr-defined]
    scan.own = order == next(iter(SSM_ORDERS))  # type: ignore[attr-defined]
    return scan


def _ssm_steps(order: str, x, dt, A, B, C, state):
    """The recurrence over ``seq``, every operand broadcast to the state ``(batch, *lead, state_dim)``: ``x`` and
    ``dt`` ``(batch, seq, *lead)``, ``A`` ``(*lead, state_dim)`` broadcastable, ``B`` and ``C`` ``(batch, seq,
    *ones, state_dim)``. Returns the readouts ``(batch, seq, *lead)`` (before ``D`` and the gate) and the last
    state."""
    outs = []
    for t in range(x.shape[1]):
        dt_t = dt[:, t][..., None]
        decay = torch.exp(dt_t * A)
        weight = (decay - 1) / A * B[:, t] if order == "zoh_B" else dt_t * B[:, t]
        written = weight * x[:, t][..., None]
        if order == "output_before_update":
            outs.append((state * C[:, t]).sum(-1))
        state = decay * (state + written) if order == "decay_after_update" else decay * state + written
        if order != "output_before_update":
            outs.append((state * C[:, t]).sum(-1))
    return torch.stack(outs, 1), state


def _wide(t: torch.Tensor) -> torch.Tensor:
    """``t`` in float32, or wider where it already is (a float64 run stays float64)."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def _mamba1(order: str, a: dict):
    u, dt, A, B, C = (_wide(a[k]) for k in ("hidden_states", "dt", "A", "B", "C"))
    if a.get("delta_bias") is not None:
        dt = dt + _wide(a["delta_bias"])[..., None]
    if a.get("delta_softplus"):
        dt = torch.nn.functional.softplus(dt)
    batch, channels, _seq = u.shape
    state = torch.zeros(batch, channels, A.shape[-1], dtype=u.dtype, device=u.device)
    out, state = _ssm_steps(
        order,
        u.transpose(1, 2),
        dt.transpose(1, 2),
        A,
        B.transpose(1, 2)[:, :, None],
        C.transpose(1, 2)[:, :, None],
        state,
    )
    out = out.transpose(1, 2)  # (batch, channels, seq)
    D, z = a.get("D"), a.get("z")
    gate = torch.nn.functional.silu(_wide(z)) if z is not None else None
    skip = u * dt if order == "D_discretised" else u
    if D is not None and not (order == "D_after_gate" and gate is not None):
        out = out + skip * _wide(D)[None, :, None]
    if gate is not None:
        out = out * gate
    if D is not None and order == "D_after_gate" and gate is not None:
        out = out + u * _wide(D)[None, :, None]
    out = out.to(a["hidden_states"].dtype)
    return (out, state) if a.get("return_last_state") else out


def _mamba2(order: str, a: dict):
    x, dt, A, B, C = (_wide(a[k]) for k in ("hidden_states", "dt", "A", "B", "C"))
    if a.get("dt_bias") is not None:
        dt = dt + _wide(a["dt_bias"])
    if a.get("dt_softplus"):
        dt = torch.nn.functional.softplus(dt)
    low, high = a.get("dt_limit") or (0.0, float("inf"))
    dt = dt.clamp(min=low, max=high)
    heads = x.shape[2]
    B = B.repeat_interleave(heads // B.shape[2], dim=2)[:, :, :, None]  # (batch, seq, heads, 1, state)
    C = C.repeat_interleave(heads // C.shape[2], dim=2)[:, :, :, None]
    initial = a.get("initial_states")
    state = (
        initial.to(x.dtype)
        if initial is not None
        else torch.zeros(x.shape[0], heads, x.shape[3], B.shape[-1], dtype=x.dtype, device=x.device)
    )
    # the state (batch, heads, head_dim, state): dt per head broadcast over head_dim, A a scalar per head
    out, state = _ssm_steps(order, x, dt[..., None].expand_as(x), A[:, None, None], B, C, state)
    D = a.get("D")
    if D is not None:
        out = out + (x * dt[..., None] if order == "D_discretised" else x) * _wide(D)[:, None]
    return (out, state) if a.get("return_final_states") else out


def bound_arguments(signature: inspect.Signature, args: tuple, kwargs: dict) -> dict:
    """A call's arguments by name, defaults filled and ``**kwargs`` spread (TypeError when they do not bind)."""
    bound = signature.bind(*args, **kwargs)
    bound.apply_defaults()
    a = dict(bound.arguments)
    a.update(a.pop("kwargs", None) or {})
    return a


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


#: the mLSTM cell's variants (Beck et al., "xLSTM", 2024, eq. 19-27, stabilised as Transformers'
#: ``mlstm_recurrent_step_native``); the first is Transformers'
MLSTM_ORDERS: dict[str, str] = {
    "stabilised": "an exp input gate, a sigmoid forget gate, stabilised by the running max m, read after the write "
    "(Transformers' order)",
    "input_gate_sigmoid": "its input gate through a sigmoid in place of exp",
    "forget_gate_exp": "its forget gate through exp in place of a sigmoid (the raw preactivation as its log)",
    "read_before_write": "its output read before this step's write",
    "forget_unstabilised": "its old state decayed by sigmoid(f) without the stabiliser's exp(m_{t-1} - m_t)",
}


def mlstm(order: str, query, key, value, igate, fgate, eps: float) -> torch.Tensor:
    """The mLSTM cell over ``query``, ``key`` ``(batch, heads, seq, d_qk)``, ``value`` ``(batch, heads, seq, d_v)``
    and the gates' preactivations ``(batch, heads, seq)``, step by step in ``order`` (a key of
    :data:`MLSTM_ORDERS`), from a zero state: ``(batch, heads, seq, d_v)`` in ``value``'s dtype. With ``m`` the
    running max of the log gates, ``C_t = f' C + i' k v^T``, ``n_t = f' n + i' k`` (``f' = exp(log f + m_{t-1} -
    m_t)``, ``i' = exp(i - m_t)``), ``h_t = q C_t / (max(|q n_t|, exp(-m_t)) + eps)``, ``q`` scaled by
    ``1 / sqrt(d_qk)``."""
    q, k, v, i, f = (_wide(t) for t in (query, key, value, igate, fgate))
    batch, heads, seq, d_qk = q.shape
    q = q * d_qk**-0.5
    if order == "input_gate_sigmoid":
        i = torch.nn.functional.logsigmoid(i)  # sigmoid(i) = exp(logsigmoid(i)): the same stabiliser
    log_f = f if order == "forget_gate_exp" else torch.nn.functional.logsigmoid(f)
    C = q.new_zeros(batch, heads, d_qk, v.shape[-1])
    n = q.new_zeros(batch, heads, d_qk)
    m = q.new_zeros(batch, heads)
    outs = []
    for t in range(seq):
        m_new = torch.maximum(log_f[..., t] + m, i[..., t])
        f_act = torch.sigmoid(f[..., t]) if order == "forget_unstabilised" else torch.exp(log_f[..., t] + m - m_new)
        i_act = torch.exp(i[..., t] - m_new)
        q_t = q[:, :, t]
        if order == "read_before_write":
            outs.append(_mlstm_read(q_t, C, n, m, eps))
        C = f_act[..., None, None] * C + i_act[..., None, None] * k[:, :, t, :, None] * v[:, :, t, None, :]
        n = f_act[..., None] * n + i_act[..., None] * k[:, :, t]
        m = m_new
        if order != "read_before_write":
            outs.append(_mlstm_read(q_t, C, n, m, eps))
    return torch.stack(outs, 2).to(value.dtype)


def _mlstm_read(q: torch.Tensor, C: torch.Tensor, n: torch.Tensor, m: torch.Tensor, eps: float) -> torch.Tensor:
    numerator = (q[..., None] * C).sum(-2)
    denominator = torch.maximum((q * n).sum(-1).abs(), torch.exp(-m)) + eps
    return numerator / denominator[..., None]
