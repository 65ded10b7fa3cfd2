"""Hand-written plain-PyTorch port of Gemma 4 unified's text model (Gemma4UnifiedForCausalLM, model type
gemma4_unified_text).

Architecture as this port implements it:
- embedding scaled by sqrt(hidden); head tied to the embedding; final logit softcap c * tanh(logits / c).
- RMSNorms with a plain gain w (x * (mean x^2 + eps)^-1/2 * w), eps = rms_norm_eps.
- layer i (sandwich norms): h = h + N_post_attn(Attn(N_in(h))); h = h + N_post_ff(MLP(N_pre_ff(h))); h = h * s_i
  (the per-layer `layer_scalar` buffer).
- attention: per layer type (layer_types): sliding layers (window W, head_dim, num_key_value_heads, RoPE
  "default") and full layers (global head_dim and kv heads from per_layer_config, "proportional" RoPE: only the
  first partial_rotary_factor * head_dim / 2 frequencies are non-zero, exponents over the whole head_dim);
  q = RoPE(RMSNorm_w(W_q x)), k = RoPE(RMSNorm_w(W_k x)), v = RMSNorm(W_v x) without gain; attention scale 1
  (the q / k norms do the scaling); full layers with attention_k_eq_v have no W_v: v = RMSNorm(W_k x) (the raw
  key projection, before its norm and RoPE).  RoPE is rotate-half over the whole head.
- KV sharing: the last num_kv_shared_layers layers have no k / v weights and reuse the keys / values of the
  last earlier layer of the same type; these layers' MLPs are double wide (use_double_wide_mlp).
- MLP: down(gelu_tanh(gate x) * up x).
Weight layout, baseline (BUG == ""): own names (`emb`, `blocks.{i}.attn` / `.mlp`, ...); projections stored
transposed (in, out) and applied as x @ W; q / k / v fused into one `w_qkv` = [q | k | v] ([q | k] in k_eq_v
layers, q alone in kv-shared layers); gate / up fused into `w_gate_up` = [gate | up]; head = the embedding
Parameter itself (x @ emb^T); kv sharing through a dict keyed by layer type.
Variants (CLEAN), each a correct port:
- gemma_scaled_table_tied_head: the sqrt(hidden) embedding scale folded into the stored table; the tied head
  reuses that same scaled table and divides the final hidden state by sqrt(hidden).
- gemma_meta_rope_complex: Meta-style permutation of q / k rows (and q / k norm gains) so rotary pairs are
  adjacent, RoPE by complex multiplication; in k_eq_v layers the values inherit the key permutation, so
  o_proj's input columns are permuted to match.
- gemma_sdpa_tables: cos / sin tables per layer type over max_position_embeddings as buffers, positions from
  the attention mask when none are given, F.scaled_dot_product_attention (scale 1) with boolean masks.
- gemma_folded_norms: input-norm gains folded into q / k / v rows, pre-MLP gains into gate / up rows, the final
  norm gain into an untied copy of the head.
- gemma_stacked_functional: one functional forward over an nn.ParameterDict of (n_layers_of_kind, ...) stacked
  tensors (sliding / full / shared attention kinds, MLP widths, norms), Transformers' (out, in) orientation.
- gemma_heads_einsum_kv_list: (heads, head_dim, hidden) weights applied with einsum, GQA by grouping query
  heads as (kv_heads, group) instead of repeating keys, kv sharing through a list of every layer's k / v and a
  per-layer source index.
- gemma_grouped_qkv_interleaved_mlp: Falcon-style grouped fused qkv (per kv head: [its query heads | k | v]),
  gate / up interleaved per channel [g0, u0, g1, u1, ...].
- gemma_module_dict_additive: layers in an nn.ModuleDict keyed "sliding_0", "full_1", ... with norms as
  modules holding `scale` parameters, the attention mask built additively (0 / finfo.min) and the final
  softcap as a separate module.
"""

import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

BUG = os.environ.get("BUG", "")

BUGS = []
PADDING_ONLY = []
CLEAN = [
    "gemma_scaled_table_tied_head",  # sqrt(H) folded into the table, tied head divides the hidden by sqrt(H)
    "gemma_meta_rope_complex",  # Meta-permuted q/k rows + norm gains, complex RoPE, o_proj columns permuted (k=v)
    "gemma_sdpa_tables",  # per-type cos/sin buffers, mask-derived positions, SDPA (scale 1) with bool masks
    "gemma_folded_norms",  # input / pre-MLP / final norm gains folded into the next projections (untied head)
    "gemma_stacked_functional",  # functional forward over per-kind stacked (n_layers, ...) ParameterDict tensors
    "gemma_heads_einsum_kv_list",  # (heads, head_dim, hidden) einsum, grouped-query GQA, kv list + source index
    "gemma_grouped_qkv_interleaved_mlp",  # Falcon-style per-kv-group fused qkv, interleaved gate/up channels
    "gemma_module_dict_additive",  # ModuleDict layers, norm modules with `scale`, additive mask, softcap module
]


_NEG = torch.finfo(torch.float32).min  # as Transformers: a fully masked (padding) query row stays finite


def _p(t):
    return nn.Parameter(t.detach().clone().float().contiguous(), requires_grad=False)


def _rms(x, eps):
    return x * torch.pow(x.pow(2).mean(-1, keepdim=True) + eps, -0.5)


def _rot_half(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat([-b, a], dim=-1)


def _softcap(x, c):
    return x if c is None else torch.tanh(x / c) * c


class _Spec:
    """Per-layer facts read from the Transformers config and the weights."""

    def __init__(self, sd, c):
        L = c.num_hidden_layers
        self.L, self.H, self.nh, self.eps = L, c.hidden_size, c.num_attention_heads, c.rms_norm_eps
        self.types = list(c.layer_types)
        self.sliding = [t == "sliding_attention" for t in self.types]
        self.window = c.sliding_window
        first_shared = L - c.num_kv_shared_layers
        self.source = []
        for i in range(L):
            if i < first_shared:
                self.source.append(None)
            else:
                self.source.append(max(j for j in range(first_shared) if self.types[j] == self.types[i]))
        self.k_eq_v = [bool(c.attention_k_eq_v) and not s for s in self.sliding]
        self.hd = [sd[f"model.layers.{i}.self_attn.q_proj.weight"].shape[0] // self.nh for i in range(L)]
        self.nkv = []
        for i in range(L):
            j = i if self.source[i] is None else self.source[i]
            self.nkv.append(sd[f"model.layers.{j}.self_attn.k_proj.weight"].shape[0] // self.hd[j])
        self.softcap = c.final_logit_softcapping
        self.max_pos = c.max_position_embeddings
        self.inv_freq = {}
        for t in set(self.types):
            rp = c.rope_parameters[t]
            hd = self.hd[self.types.index(t)]
            base = rp["rope_theta"]
            if rp.get("rope_type", "default") == "proportional":
                n_rot = int(rp.get("partial_rotary_factor", 1.0) * hd // 2)
                inv = 1.0 / base ** (torch.arange(0, 2 * n_rot, 2, dtype=torch.float) / hd)
                inv = torch.cat([inv, torch.zeros(hd // 2 - n_rot)]) / rp.get("factor", 1.0)
            else:
                inv = 1.0 / base ** (torch.arange(0, hd, 2, dtype=torch.float) / hd)
            self.inv_freq[t] = inv


def _meta_perm(hd):
    h = hd // 2
    return torch.stack([torch.arange(h), torch.arange(h) + h], dim=1).reshape(-1)


class Norm(nn.Module):
    """gemma_module_dict_additive's RMSNorm module (gain called `scale`)."""

    def __init__(self, w, eps):
        super().__init__()
        self.scale, self.eps = _p(w), eps

    def forward(self, x):
        return _rms(x, self.eps) * self.scale


class Softcap(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c = c

    def forward(self, x):
        return _softcap(x, self.c)


class Attention(nn.Module):
    def __init__(self, sd, i, spec, variant, gain):
        super().__init__()
        a = f"model.layers.{i}.self_attn."
        self.i, self.variant = i, variant
        self.nh, self.hd, self.nkv = spec.nh, spec.hd[i], spec.nkv[i]
        self.shared = spec.source[i] is not None
        self.k_eq_v = spec.k_eq_v[i]
        self.eps = spec.eps
        nh, hd, nkv = self.nh, self.hd, self.nkv
        wq = sd[a + "q_proj.weight"].float()
        wo = sd[a + "o_proj.weight"].float()
        gq = sd[a + "q_norm.weight"].float()
        wk = wv = gk = None
        if not self.shared:
            wk = sd[a + "k_proj.weight"].float()
            gk = sd[a + "k_norm.weight"].float()
            if not self.k_eq_v:
                wv = sd[a + "v_proj.weight"].float()
        if gain is not None:  # gemma_folded_norms
            wq = wq * gain
            wk = None if wk is None else wk * gain
            wv = None if wv is None else wv * gain
        if variant == "gemma_meta_rope_complex":
            perm = _meta_perm(hd)
            wq = wq.reshape(nh, hd, -1)[:, perm].reshape(nh * hd, -1)
            gq = gq[perm]
            if wk is not None:
                wk = wk.reshape(nkv, hd, -1)[:, perm].reshape(nkv * hd, -1)
                gk = gk[perm]
            # values taken from the (permuted) keys, here or in the layer this one shares with: permute o_proj's inputs
            if self.k_eq_v:
                wo = wo.reshape(-1, nh, hd)[:, :, perm].reshape(wo.shape[0], -1)
        self.q_gain = _p(gq)
        if gk is not None:
            self.k_gain = _p(gk)
        if variant == "gemma_heads_einsum_kv_list":
            self.wq = _p(wq.reshape(nh, hd, -1))
            if wk is not None:
                self.wk = _p(wk.reshape(nkv, hd, -1))
            if wv is not None:
                self.wv = _p(wv.reshape(nkv, hd, -1))
            self.wo = _p(wo.t().reshape(nh, hd, -1))
        elif variant == "gemma_grouped_qkv_interleaved_mlp":
            rep = nh // nkv
            if self.shared:
                self.w_q_t = _p(wq.t())
            else:
                parts = []
                for g in range(nkv):
                    parts.append(wq[g * rep * hd : (g + 1) * rep * hd])
                    parts.append(wk[g * hd : (g + 1) * hd])
                    if wv is not None:
                        parts.append(wv[g * hd : (g + 1) * hd])
                self.w_qkv_grouped_t = _p(torch.cat(parts).t())
            self.wo_t = _p(wo.t())
        else:
            fused = [wq] + [w for w in (wk, wv) if w is not None]
            self.w_qkv_t = _p(torch.cat(fused).t())
            self.wo_t = _p(wo.t())

    def project(self, x):
        """q (b, t, nh, hd) and, outside kv-shared layers, raw k / v (b, t, nkv, hd) (v = raw k if k_eq_v)."""
        b, t, _ = x.shape
        nh, hd, nkv = self.nh, self.hd, self.nkv
        if self.variant == "gemma_heads_einsum_kv_list":
            q = torch.einsum("bth,ndh->btnd", x, self.wq)
            if self.shared:
                return q, None, None
            k = torch.einsum("bth,ndh->btnd", x, self.wk)
            v = k if self.k_eq_v else torch.einsum("bth,ndh->btnd", x, self.wv)
            return q, k, v
        if self.variant == "gemma_grouped_qkv_interleaved_mlp":
            if self.shared:
                return (x @ self.w_q_t).reshape(b, t, nh, hd), None, None
            rep = nh // nkv
            per = rep + 1 + (0 if self.k_eq_v else 1)
            y = (x @ self.w_qkv_grouped_t).reshape(b, t, nkv, per, hd)
            q = y[:, :, :, :rep].reshape(b, t, nh, hd)
            k = y[:, :, :, rep]
            v = k if self.k_eq_v else y[:, :, :, rep + 1]
            return q, k, v
        y = x @ self.w_qkv_t
        if self.shared:
            return y.reshape(b, t, nh, hd), None, None
        sizes = [nh * hd, nkv * hd] + ([] if self.k_eq_v else [nkv * hd])
        parts = y.split(sizes, dim=-1)
        q, k = parts[0].reshape(b, t, nh, hd), parts[1].reshape(b, t, nkv, hd)
        v = k if self.k_eq_v else parts[2].reshape(b, t, nkv, hd)
        return q, k, v

    def rope(self, x, ctx):
        if self.variant == "gemma_meta_rope_complex":
            f = ctx["cis"][:, :, None]
            xc = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2).contiguous())
            return torch.view_as_real(xc * f).flatten(-2)
        cos, sin = ctx["cos"][:, :, None], ctx["sin"][:, :, None]
        return x * cos + _rot_half(x) * sin

    def forward(self, x, ctx, kv_store):
        b, t, _ = x.shape
        q, k, v = self.project(x)
        q = self.rope(_rms(q, self.eps) * self.q_gain, ctx).transpose(1, 2)
        if self.shared:
            k, v = kv_store(self.i)
        else:
            k = self.rope(_rms(k, self.eps) * self.k_gain, ctx).transpose(1, 2)
            v = _rms(v, self.eps).transpose(1, 2)
            kv_store(self.i, (k, v))
        nh, nkv = self.nh, k.shape[1]
        if self.variant == "gemma_heads_einsum_kv_list":
            qg = q.reshape(b, nkv, nh // nkv, t, -1)
            s = torch.einsum("bgrqd,bgkd->bgrqk", qg, k).masked_fill(~ctx["keep"][:, :, None], _NEG)
            o = torch.einsum("bgrqk,bgkd->bgrqd", torch.softmax(s, -1), v).reshape(b, nh, t, -1)
            return torch.einsum("bntd,ndh->bth", o, self.wo)
        k, v = k.repeat_interleave(nh // nkv, dim=1), v.repeat_interleave(nh // nkv, dim=1)
        if self.variant == "gemma_sdpa_tables":
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=ctx["keep"], scale=1.0)
        elif self.variant == "gemma_module_dict_additive":
            o = torch.softmax(q @ k.transpose(-1, -2) + ctx["additive"], dim=-1) @ v
        else:
            s = (q @ k.transpose(-1, -2)).masked_fill(~ctx["keep"], _NEG)
            o = torch.softmax(s, dim=-1) @ v
        return o.transpose(1, 2).reshape(b, t, -1) @ self.wo_t


class MLP(nn.Module):
    def __init__(self, sd, i, variant, gain):
        super().__init__()
        m = f"model.layers.{i}.mlp."
        self.variant = variant
        g, u = sd[m + "gate_proj.weight"].float(), sd[m + "up_proj.weight"].float()
        if gain is not None:
            g, u = g * gain, u * gain
        if variant == "gemma_grouped_qkv_interleaved_mlp":
            self.w_gu_t = _p(torch.stack([g, u], dim=1).reshape(-1, g.shape[1]).t())  # columns g0, u0, g1, u1, ...
        else:
            self.w_gate_up_t = _p(torch.cat([g, u]).t())
        self.w_down_t = _p(sd[m + "down_proj.weight"].float().t())

    def forward(self, x):
        if self.variant == "gemma_grouped_qkv_interleaved_mlp":
            y = x @ self.w_gu_t
            g, u = y[..., 0::2], y[..., 1::2]
        else:
            g, u = (x @ self.w_gate_up_t).chunk(2, dim=-1)
        return (F.gelu(g, approximate="tanh") * u) @ self.w_down_t


class Block(nn.Module):
    def __init__(self, sd, i, spec, variant):
        super().__init__()
        pre = f"model.layers.{i}."
        self.eps, self.variant = spec.eps, variant
        self.type = spec.types[i]
        names = (
            "input_layernorm",
            "post_attention_layernorm",
            "pre_feedforward_layernorm",
            "post_feedforward_layernorm",
        )
        g = {n: sd[pre + n + ".weight"].float() for n in names}
        fold = variant == "gemma_folded_norms"
        self.attn = Attention(sd, i, spec, variant, g["input_layernorm"] if fold else None)
        self.mlp = MLP(sd, i, variant, g["pre_feedforward_layernorm"] if fold else None)
        if variant == "gemma_module_dict_additive":
            self.norms = nn.ModuleDict({n.replace("layernorm", "norm"): Norm(w, spec.eps) for n, w in g.items()})
        else:
            self.g_in = None if fold else _p(g["input_layernorm"])
            self.g_post_attn = _p(g["post_attention_layernorm"])
            self.g_pre_ff = None if fold else _p(g["pre_feedforward_layernorm"])
            self.g_post_ff = _p(g["post_feedforward_layernorm"])
        self.register_buffer("layer_scalar", sd[pre + "layer_scalar"].float().clone())

    def _n(self, x, name, gain):
        if self.variant == "gemma_module_dict_additive":
            return self.norms[name](x)
        x = _rms(x, self.eps)
        return x if gain is None else x * gain

    def forward(self, h, ctx, kv_store):
        a = self.attn(self._n(h, "input_norm", getattr(self, "g_in", None)), ctx[self.type], kv_store)
        h = h + self._n(a, "post_attention_norm", getattr(self, "g_post_attn", None))
        m = self.mlp(self._n(h, "pre_feedforward_norm", getattr(self, "g_pre_ff", None)))
        h = h + self._n(m, "post_feedforward_norm", getattr(self, "g_post_ff", None))
        return h * self.layer_scalar


class Gemma4TextLM(nn.Module):
    def __init__(self, sd, c, variant):
        super().__init__()
        spec = _Spec(sd, c)
        self.spec, self.variant = spec, variant
        emb = sd["model.embed_tokens.weight"].float()
        self.scale = math.sqrt(c.hidden_size)
        final = sd["model.norm.weight"].float()
        if variant == "gemma_scaled_table_tied_head":
            self.emb = _p(emb * torch.tensor(self.scale, dtype=torch.float32))
        else:
            self.emb = _p(emb)
        if variant == "gemma_folded_norms":
            self.head_t = _p((emb * final).t())  # untied: the final norm gain lives in the head
            self.g_final = None
        else:
            self.g_final = _p(final)
        if variant == "gemma_module_dict_additive":
            self.layers = nn.ModuleDict(
                {f"{'sliding' if spec.sliding[i] else 'full'}_{i}": Block(sd, i, spec, variant) for i in range(spec.L)}
            )
            self.cap = Softcap(spec.softcap)
        else:
            self.blocks = nn.ModuleList([Block(sd, i, spec, variant) for i in range(spec.L)])
        for t, inv in spec.inv_freq.items():
            self.register_buffer(f"inv_freq_{t}", inv, persistent=False)
            if variant == "gemma_sdpa_tables":
                ang = torch.arange(spec.max_pos, dtype=torch.float)[:, None] * inv
                emb2 = torch.cat([ang, ang], dim=-1)
                self.register_buffer(f"cos_{t}", emb2.cos(), persistent=False)
                self.register_buffer(f"sin_{t}", emb2.sin(), persistent=False)

    def _ctx(self, input_ids, attention_mask, position_ids):
        spec = self.spec
        b, t = input_ids.shape
        dev = input_ids.device
        if position_ids is None:
            if self.variant == "gemma_sdpa_tables" and attention_mask is not None:
                position_ids = (attention_mask.long().cumsum(-1) - 1).masked_fill(attention_mask == 0, 1)
            else:
                position_ids = torch.arange(t, device=dev)[None]
        i = torch.arange(t, device=dev)
        dist = i[:, None] - i[None, :]
        pad = torch.ones(b, t, dtype=torch.bool, device=dev) if attention_mask is None else attention_mask.bool()
        ctx = {}
        for typ in set(spec.types):
            keep = (dist >= 0)[None, None] & pad[:, None, None, :]
            if typ == "sliding_attention":
                keep = keep & (dist < spec.window)
            d = {"keep": keep}
            if self.variant == "gemma_sdpa_tables":
                d["cos"] = getattr(self, f"cos_{typ}")[position_ids]
                d["sin"] = getattr(self, f"sin_{typ}")[position_ids]
                d["keep"] = keep | torch.eye(t, dtype=torch.bool, device=dev)  # no all-False (padding) row
            else:
                ang = position_ids[..., None].float() * getattr(self, f"inv_freq_{typ}")
                if self.variant == "gemma_meta_rope_complex":
                    d["cis"] = torch.polar(torch.ones_like(ang), ang)
                else:
                    emb = torch.cat([ang, ang], dim=-1)
                    d["cos"], d["sin"] = emb.cos(), emb.sin()
            if self.variant == "gemma_module_dict_additive":
                d["additive"] = torch.zeros(keep.shape, device=dev).masked_fill(~keep, torch.finfo(torch.float32).min)
            ctx[typ] = d
        return ctx

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        spec = self.spec
        ctx = self._ctx(input_ids, attention_mask, position_ids)
        h = self.emb[input_ids]
        if self.variant != "gemma_scaled_table_tied_head":
            h = h * torch.tensor(self.scale, dtype=h.dtype)
        if self.variant == "gemma_heads_einsum_kv_list":
            kv = [None] * spec.L

            def store(i, value=None):
                if value is None:
                    return kv[spec.source[i]]
                kv[i] = value

        else:
            kv = {}

            def store(i, value=None):
                if value is None:
                    return kv[spec.types[i]]
                kv[spec.types[i]] = value

        blocks = self.layers.values() if self.variant == "gemma_module_dict_additive" else self.blocks
        for blk in blocks:
            h = blk(h, ctx, store)
        h = _rms(h, spec.eps)
        if self.g_final is not None:
            h = h * self.g_final
        if self.variant == "gemma_folded_norms":
            logits = h @ self.head_t
        elif self.variant == "gemma_scaled_table_tied_head":
            logits = (h / self.scale) @ self.emb.t()
        else:
            logits = h @ self.emb.t()
        if self.variant == "gemma_module_dict_additive":
            return self.cap(logits).float()
        return _softcap(logits, spec.softcap).float()


# ------------------------------------------------------------------------------- stacked functional port
class Gemma4Functional(nn.Module):
    """gemma_stacked_functional: per-kind stacked tensors and one forward function."""

    def __init__(self, sd, c):
        super().__init__()
        spec = _Spec(sd, c)
        self.spec = spec
        L = spec.L
        kinds = {}
        for i in range(L):
            kind = ("shared_" if spec.source[i] is not None else "") + ("sliding" if spec.sliding[i] else "full")
            kinds.setdefault(kind, []).append(i)
        self.kind_of = {i: (k, idx.index(i)) for k, idx in kinds.items() for i in idx}
        widths = {}
        for i in range(L):
            widths.setdefault(sd[f"model.layers.{i}.mlp.gate_proj.weight"].shape[0], []).append(i)
        self.mlp_of = {i: (f"mlp{w}", idx.index(i)) for w, idx in widths.items() for i in idx}
        P = {}
        for kind, idx in kinds.items():
            for name in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm"):
                keys = [f"model.layers.{i}.self_attn.{name}.weight" for i in idx]
                if all(k in sd for k in keys):
                    P[f"{kind}_{name}"] = torch.stack([sd[k] for k in keys])
        for w, idx in widths.items():
            for name in ("gate_proj", "up_proj", "down_proj"):
                P[f"mlp{w}_{name}"] = torch.stack([sd[f"model.layers.{i}.mlp.{name}.weight"] for i in idx])
        names = (
            "input_layernorm",
            "post_attention_layernorm",
            "pre_feedforward_layernorm",
            "post_feedforward_layernorm",
        )
        P["norms"] = torch.stack([torch.stack([sd[f"model.layers.{i}.{n}.weight"] for n in names]) for i in range(L)])
        P["layer_scalars"] = torch.stack([sd[f"model.layers.{i}.layer_scalar"] for i in range(L)])
        P["embed"] = sd["model.embed_tokens.weight"]
        P["final_norm"] = sd["model.norm.weight"]
        self.P = nn.ParameterDict({k: _p(v) for k, v in P.items()})
        for t, inv in spec.inv_freq.items():
            self.register_buffer(f"inv_freq_{t}", inv, persistent=False)

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        P, spec = self.P, self.spec
        b, t = input_ids.shape
        eps = spec.eps
        if position_ids is None:
            position_ids = torch.arange(t)[None]
        i_ = torch.arange(t)
        dist = i_[:, None] - i_[None, :]
        keep = (dist >= 0)[None, None]
        if attention_mask is not None:
            keep = keep & attention_mask.bool()[:, None, None, :]
        keeps = {"full_attention": keep, "sliding_attention": keep & (dist < spec.window)}
        rope = {}
        for typ in keeps:
            ang = position_ids[..., None].float() * getattr(self, f"inv_freq_{typ}")
            emb = torch.cat([ang, ang], dim=-1)
            rope[typ] = (emb.cos()[:, :, None], emb.sin()[:, :, None])

        def norm(x, w=None):
            x = _rms(x, eps)
            return x if w is None else x * w

        h = F.embedding(input_ids, P["embed"]) * torch.tensor(math.sqrt(spec.H))
        kv = {}
        for i in range(spec.L):
            typ = spec.types[i]
            kind, j = self.kind_of[i]
            cos, sin = rope[typ]
            nh, hd = spec.nh, spec.hd[i]
            x = norm(h, P["norms"][i, 0])
            q = F.linear(x, P[f"{kind}_q_proj"][j]).reshape(b, t, nh, hd)
            q = norm(q, P[f"{kind}_q_norm"][j])
            q = (q * cos + _rot_half(q) * sin).transpose(1, 2)
            if spec.source[i] is None:
                kr = F.linear(x, P[f"{kind}_k_proj"][j]).reshape(b, t, -1, hd)
                vr = kr if spec.k_eq_v[i] else F.linear(x, P[f"{kind}_v_proj"][j]).reshape(b, t, -1, hd)
                k = norm(kr, P[f"{kind}_k_norm"][j])
                k = (k * cos + _rot_half(k) * sin).transpose(1, 2)
                kv[typ] = (k, norm(vr).transpose(1, 2))
            k, v = kv[typ]
            rep = nh // k.shape[1]
            k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
            s = (q @ k.transpose(-1, -2)).masked_fill(~keeps[typ], _NEG)
            o = (torch.softmax(s, -1) @ v).transpose(1, 2).reshape(b, t, -1)
            h = h + norm(F.linear(o, P[f"{kind}_o_proj"][j]), P["norms"][i, 1])
            mk, mj = self.mlp_of[i]
            x = norm(h, P["norms"][i, 2])
            y = F.gelu(F.linear(x, P[f"{mk}_gate_proj"][mj]), approximate="tanh") * F.linear(x, P[f"{mk}_up_proj"][mj])
            h = (h + norm(F.linear(y, P[f"{mk}_down_proj"][mj]), P["norms"][i, 3])) * P["layer_scalars"][i]
        logits = F.linear(norm(h, P["final_norm"]), P["embed"])
        return _softcap(logits, spec.softcap).float()


def build(state_dict, config):
    variant = BUG
    if variant and variant not in CLEAN:
        raise ValueError(f"unknown variant {variant!r}")
    sd = dict(state_dict)
    if variant == "gemma_stacked_functional":
        return Gemma4Functional(sd, config).eval()
    return Gemma4TextLM(sd, config, variant).eval()
