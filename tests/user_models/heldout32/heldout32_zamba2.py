"""Hand-written plain-PyTorch port of Zamba2 (Zamba2ForCausalLM): a Mamba2 backbone with shared transformer blocks.

Architecture as this port implements it:
- token embedding e (no scaling); lm_head (tied to e in the released models); final RMSNorm
  (all RMSNorms: w * x / sqrt(mean(x^2) + config.rms_norm_eps)).
- layer kinds from config.layers_block_type: "mamba" (stored as "linear_attention") or "hybrid".
- mamba layer:   h = h + Mixer(RMSNorm(h)).
- hybrid layer, the u-th one (u = 0, 1, ... counts hybrid layers only), shared block b = u % num_mem_blocks:
      t = W_mix_u Shared_b(h, e; adapters of use u)
      h = h + Mixer(RMSNorm(h + t))            (t enters the mixer input only, not the residual)
- shared block b (one set of weights reused by every use u with u % num_mem_blocks == b; no residual inside):
      c = RMSNorm_2H(concat[h, e])               (hidden state first, original embeddings second)
      q / k / v = c W_{q,k,v} + (c A_u) B_u      (rank-r LoRA adapter per use u, on the normed input)
      head_dim d = 2H / num_attention_heads (attention_head_dim; kv_channels = H / heads is unused);
      rotate-half RoPE over all d dims (theta from rope_parameters) when use_mem_rope;
      scores scaled by (d / 2) ** -0.5; causal + key-padding mask as an additive finfo.min (fully masked
      padding rows stay finite, never NaN); o = attn W_o (-> H);
      m = RMSNorm_H(o);  [gate | up] = m W_gu + b_gu + (m A^ff_u) B^ff_u;  out = (gelu(gate) * up) W_down + b_down.
- Mixer (Mamba2, G = mamba_ngroups groups, N = d_state, heads = n_mamba_heads, P = d_inner / heads):
      input zeroed at padding BEFORE in_proj (padding positions then carry in_proj's bias into the conv);
      in_proj -> [z (d_inner) | xBC (d_inner + 2 G N) | dt (heads)];
      xBC = silu(causal depthwise conv1d(xBC) + conv bias), zeroed again at padding; split x | B | C;
      dt = clamp(softplus(dt + dt_bias), min=time_step_min) (no upper clamp); A = -exp(A_log);
      head h reads the B, C of group h // (heads / G);
      s_t = exp(dt_t A) s_{t-1} + dt_t x_t B_t^T,  y_t = s_t C_t + D x_t, computed in the chunked
      state-space-dual form (chunk_size from config: intra-chunk decay matrix + states carried between chunks);
      y = (y * silu(z)) normalised by the RMS of each of its G groups of d_inner / G channels (gate first,
      eps fixed at 1e-5, not rms_norm_eps) * w;  out_proj.
Weight layout of this port (own names, built from Transformers' names):
- tok (V, H); head (V, H) (transposed (H, V) in the transposed-layout variant); fin (H,).
- blocks[b] (read from the first hybrid layer using block b, layers.<l>.shared_transformer.*):
  ln_in (2H,); wqkv (n d + 2 nkv d, 2H) = [q; k; v] fused; wo (H, n d); ln_ff (H,);
  w_gu (2I, H) = [gate; up], b_gu (2I,); w_down (H, I), b_down (H,).
- uses[u] (hybrid use u): lora_a (3, r, 2H) / lora_b (3, n d, r) = q, k, v adapters (slot u of the block's
  adapter lists) stacked; ff_a (r, H), ff_b (2I, r) the gate_up adapter; mix (H, H) = the layer's `linear`.
- mixers[i] (every layer): ln (H,); w_in (d_in_proj, H) = [z; xBC; dt] and b_in; conv_w (C, K), conv_b (C,);
  dt_bias, A (= -exp(A_log)), D (heads,); gnorm (d_inner,); w_out (H, d_inner), b_out (H,)
  (w_in / w_out transposed in the transposed-layout variant).
"""

import os

import torch
import torch.nn as nn
import torch.nn.functional as F

BUG = os.environ.get("BUG", "")

BUGS = [
    "zamba2_concat_swapped",  # shared block reads concat[embeddings, hidden] instead of concat[hidden, embeddings]
    "zamba2_attn_scale_full_hd",  # attention scores scaled by head_dim ** -0.5 instead of (head_dim / 2) ** -0.5
    "zamba2_block_by_layer_index",  # shared block picked by absolute layer index % num_mem_blocks, not by hybrid use
    "zamba2_lora_before_norm",  # q/k/v LoRA adapters applied to the un-normalised concat instead of the normed one
    "zamba2_adapters_tied_with_block",  # every use of a shared block gets the LoRA adapters of that block's first use
    "zamba2_shared_out_in_residual",  # shared-block output t added to the residual stream too, not only the mixer input
    "zamba2_in_proj_order",  # in_proj split at load as [xBC | z | dt] instead of [z | xBC | dt]
    "zamba2_gated_norm_ungrouped",  # gated RMSNorm over all of d_inner instead of per group (n_groups = 2)
    "zamba2_norm_before_gate",  # gated norm normalises first and multiplies by silu(z) after (norm_before_gate)
    "zamba2_dt_clamp_max",  # dt also clamped above at config.time_step_max (the reference has no upper limit)
    "zamba2_groups_tiled",  # B/C group of mamba head h taken as h % n_groups instead of h // (heads / n_groups)
    "zamba2_conv_flipped",  # depthwise conv1d taps reversed at load (kernel applied as true convolution)
    "zamba2_rope_kv_channels",  # RoPE dim read from config.kv_channels (H / heads = 16): only half of head_dim rotates
    "zamba2_pad_unmasked_after_conv",  # padding positions not re-zeroed after the conv, so they enter the SSM state
]
PADDING_ONLY = {"zamba2_pad_unmasked_after_conv"}
CLEAN = [
    "zamba2_complex_rope",  # RoPE as complex multiplication of the (x_i, x_{i + d/2}) pairs by cos + i sin
    "zamba2_rope_cache",  # cos / sin tables built once for max_position_embeddings, gathered by position_ids
    "zamba2_mask_fill",  # attention mask applied by masked_fill on a boolean mask instead of an additive bias
    "zamba2_conv_taps",  # causal depthwise conv as bias + a running sum of shifted taps (addcmul), no F.conv1d
    "zamba2_transposed_proj",  # mixer in/out projections and lm head stored transposed (in, out), used as x @ W
]


def _rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope_rot(x, cos, sin, rd):
    """Rotate-half RoPE on the first rd dims of x (B, n, S, d); cos / sin (B, S, rd)."""
    cos, sin = cos[:, None], sin[:, None]
    xr, xp = x[..., :rd], x[..., rd:]
    x1, x2 = xr[..., : rd // 2], xr[..., rd // 2 :]
    rot = torch.cat((-x2, x1), -1)
    return torch.cat((xr * cos + rot * sin, xp), -1)


def _rope_complex(x, cos_h, sin_h):
    """RoPE as complex multiplication: pair (x_i, x_{i + d/2}) is one complex number; cos_h / sin_h (B, S, d/2)."""
    h = x.shape[-1] // 2
    z = torch.complex(x[..., :h].contiguous(), x[..., h:].contiguous())
    z = z * torch.complex(cos_h, sin_h)[:, None]
    return torch.cat((z.real, z.imag), -1)


class _Obj(nn.Module):
    pass


class Zamba2Port(nn.Module):
    def __init__(self, sd, cfg):
        super().__init__()

        def g(k):
            return sd[k].detach().clone().float()

        def gb(k):
            return sd[k].detach().clone().float() if k in sd else None

        self.H = cfg.hidden_size
        self.nh = cfg.num_attention_heads
        self.hd = cfg.attention_head_dim
        self.nkv = cfg.num_key_value_heads
        self.kv_channels = cfg.kv_channels
        self.eps = cfg.rms_norm_eps
        self.theta = cfg.rope_parameters["rope_theta"]
        self.use_rope = cfg.use_mem_rope
        self.act = cfg.hidden_act
        self.types = list(cfg.layers_block_type)
        self.nmb = cfg.num_mem_blocks
        self.hybrid_layers = [i for i, t in enumerate(self.types) if t == "hybrid"]
        self.d_inner = int(cfg.mamba_expand * cfg.hidden_size)
        self.mh = cfg.n_mamba_heads
        self.mp = self.d_inner // self.mh
        self.G = cfg.mamba_ngroups
        self.N = cfg.mamba_d_state
        self.K = cfg.mamba_d_conv
        self.chunk = cfg.chunk_size
        self.dt_min, self.dt_max = cfg.time_step_min, cfg.time_step_max
        self.use_qkv_lora = cfg.use_shared_attention_adapter
        self.max_pos = cfg.max_position_embeddings
        self.transposed = BUG == "zamba2_transposed_proj"  # a layout chosen at load time

        self.tok = nn.Parameter(g("model.embed_tokens.weight"))
        head = g("lm_head.weight") if "lm_head.weight" in sd else g("model.embed_tokens.weight")
        self.head = nn.Parameter(head.t().contiguous() if self.transposed else head)
        self.fin = nn.Parameter(g("model.final_layernorm.weight"))

        isz = cfg.intermediate_size

        # shared blocks: block b first used by hybrid use b
        self.blocks = nn.ModuleList()
        for b in range(min(self.nmb, len(self.hybrid_layers))):
            p = f"model.layers.{self.hybrid_layers[b]}.shared_transformer."
            m = _Obj()
            m.ln_in = nn.Parameter(g(p + "input_layernorm.weight"))
            m.wqkv = nn.Parameter(torch.cat([g(p + f"self_attn.{x}_proj.weight") for x in "qkv"], 0))
            m.wo = nn.Parameter(g(p + "self_attn.o_proj.weight"))
            m.ln_ff = nn.Parameter(g(p + "pre_ff_layernorm.weight"))
            m.w_gu = nn.Parameter(g(p + "feed_forward.gate_up_proj.weight"))  # rows [gate | up]
            bgu = gb(p + "feed_forward.gate_up_proj.bias")
            m.b_gu = nn.Parameter(bgu if bgu is not None else torch.zeros(2 * isz))
            m.w_down = nn.Parameter(g(p + "feed_forward.down_proj.weight"))
            bd = gb(p + "feed_forward.down_proj.bias")
            m.b_down = nn.Parameter(bd if bd is not None else torch.zeros(self.H))
            self.blocks.append(m)

        # per hybrid use: adapters (in the block of that use, slot u) and the mixing linear
        self.uses = nn.ModuleList()
        for u, li in enumerate(self.hybrid_layers):
            p = f"model.layers.{li}.shared_transformer."
            m = _Obj()
            if self.use_qkv_lora:
                m.lora_a = nn.Parameter(
                    torch.stack([g(p + f"self_attn.linear_{x}_adapter_list.{u}.0.weight") for x in "qkv"])
                )
                m.lora_b = nn.Parameter(
                    torch.stack([g(p + f"self_attn.linear_{x}_adapter_list.{u}.1.weight") for x in "qkv"])
                )
            m.ff_a = nn.Parameter(g(p + f"feed_forward.gate_up_proj_adapter_list.{u}.0.weight"))
            m.ff_b = nn.Parameter(g(p + f"feed_forward.gate_up_proj_adapter_list.{u}.1.weight"))
            m.mix = nn.Parameter(g(f"model.layers.{li}.linear.weight"))
            self.uses.append(m)

        # mamba mixers, one per layer
        conv_dim = self.d_inner + 2 * self.G * self.N
        if BUG == "zamba2_in_proj_order":
            order = [("xbc", conv_dim), ("z", self.d_inner), ("dt", self.mh)]
        else:
            order = [("z", self.d_inner), ("xbc", conv_dim), ("dt", self.mh)]
        self.mixers = nn.ModuleList()
        for i, t in enumerate(self.types):
            p = f"model.layers.{i}." + ("mamba_decoder." if t == "hybrid" else "")
            m = _Obj()
            m.ln = nn.Parameter(g(p + "input_layernorm.weight"))
            q = p + "mamba."
            w = g(q + "in_proj.weight")
            bias = gb(q + "in_proj.bias")
            if bias is None:
                bias = torch.zeros(w.shape[0])
            parts, off = {}, 0
            for name, n in order:  # how the loader reads in_proj's rows ...
                parts[name] = (w[off : off + n], bias[off : off + n])
                off += n
            # ... stored fused in this port's own order [z | xBC | dt]
            w_in = torch.cat([parts[k][0] for k in ("z", "xbc", "dt")], 0)
            m.w_in = nn.Parameter(w_in.t().contiguous() if self.transposed else w_in)
            m.b_in = nn.Parameter(torch.cat([parts[k][1] for k in ("z", "xbc", "dt")], 0))
            cw = g(q + "conv1d.weight")[:, 0]  # (C, K)
            if BUG == "zamba2_conv_flipped":
                cw = cw.flip(-1)
            m.conv_w = nn.Parameter(cw)
            cb = gb(q + "conv1d.bias")
            m.conv_b = nn.Parameter(cb if cb is not None else torch.zeros(conv_dim))
            m.dt_bias = nn.Parameter(g(q + "dt_bias"))
            m.A = nn.Parameter(-torch.exp(g(q + "A_log")))
            m.D = nn.Parameter(g(q + "D"))
            m.gnorm = nn.Parameter(g(q + "norm.weight"))
            w_out = g(q + "out_proj.weight")
            m.w_out = nn.Parameter(w_out.t().contiguous() if self.transposed else w_out)
            bo = gb(q + "out_proj.bias")
            m.b_out = nn.Parameter(bo if bo is not None else torch.zeros(self.H))
            self.mixers.append(m)

    # ---------------------------------------------------------------- shared transformer block
    def _act(self, x):
        if self.act in ("gelu_pytorch_tanh", "gelu_new", "gelu_fast"):
            return F.gelu(x, approximate="tanh")
        if self.act == "silu":
            return F.silu(x)
        return F.gelu(x)

    def _shared(self, blk, use, h, emb, pos, allowed):
        B, S, _ = h.shape
        n, d = self.nh, self.hd
        raw = torch.cat([emb, h], -1) if BUG == "zamba2_concat_swapped" else torch.cat([h, emb], -1)
        c = _rms(raw, blk.ln_in, self.eps)
        qkv = F.linear(c, blk.wqkv)
        if self.use_qkv_lora:
            src = raw if BUG == "zamba2_lora_before_norm" else c
            lo = [F.linear(F.linear(src, use.lora_a[j]), use.lora_b[j]) for j in range(3)]
            qkv = qkv + torch.cat(lo, -1)
        nkv = self.nkv
        q, k, v = qkv.split([n * d, nkv * d, nkv * d], -1)
        q = q.view(B, S, n, d).transpose(1, 2)
        k = k.view(B, S, nkv, d).transpose(1, 2)
        v = v.view(B, S, nkv, d).transpose(1, 2)
        if self.use_rope:
            rd = self.kv_channels if BUG == "zamba2_rope_kv_channels" else d
            inv = 1.0 / (self.theta ** (torch.arange(0, rd, 2, dtype=torch.float32) / rd))
            if BUG == "zamba2_rope_cache":
                table = torch.arange(self.max_pos, dtype=torch.float32)[:, None] * inv  # (max_pos, rd/2)
                cos_h, sin_h = table.cos()[pos], table.sin()[pos]
            else:
                ang = pos[..., None].float() * inv  # (B, S, rd/2)
                cos_h, sin_h = ang.cos(), ang.sin()
            if BUG == "zamba2_complex_rope":
                q, k = _rope_complex(q, cos_h, sin_h), _rope_complex(k, cos_h, sin_h)
            else:
                cos, sin = torch.cat([cos_h, cos_h], -1), torch.cat([sin_h, sin_h], -1)
                q, k = _rope_rot(q, cos, sin, rd), _rope_rot(k, cos, sin, rd)
        scale = d**-0.5 if BUG == "zamba2_attn_scale_full_hd" else (d / 2) ** -0.5
        if nkv != n:  # query head i reads kv head i // (n / nkv)
            k, v = k.repeat_interleave(n // nkv, 1), v.repeat_interleave(n // nkv, 1)
        att = (q @ k.transpose(-1, -2)) * scale
        if BUG == "zamba2_mask_fill":
            att = att.masked_fill(~allowed, torch.finfo(att.dtype).min)
        else:
            att = att + torch.zeros(allowed.shape, dtype=att.dtype).masked_fill(~allowed, torch.finfo(att.dtype).min)
        o = torch.softmax(att, -1) @ v
        o = F.linear(o.transpose(1, 2).reshape(B, S, n * d), blk.wo)
        m = _rms(o, blk.ln_ff, self.eps)
        gu = F.linear(m, blk.w_gu, blk.b_gu) + F.linear(F.linear(m, use.ff_a), use.ff_b)
        gate, up = gu.chunk(2, -1)
        return F.linear(self._act(gate) * up, blk.w_down, blk.b_down)

    # ---------------------------------------------------------------- Mamba2 mixer
    def _conv(self, mx, xbc):
        # xbc (B, S, C) -> causal depthwise conv along S
        K = mx.conv_w.shape[-1]
        if BUG == "zamba2_conv_taps":  # channels-first (B, C, S), full-length output then the causal part
            S = xbc.shape[1]
            L = S + K - 1
            xp = F.pad(xbc.transpose(1, 2), (K - 1, K - 1))
            out = mx.conv_b[:, None].expand(xbc.shape[0], -1, L).clone()
            for j in range(K):  # tap j sees the input K - 1 - j steps back
                out = torch.addcmul(out, xp[..., j : j + L], mx.conv_w[:, j, None])
            return out[..., :S].transpose(1, 2)
        S = xbc.shape[1]
        y = F.conv1d(xbc.transpose(1, 2), mx.conv_w[:, None], mx.conv_b, padding=K - 1, groups=xbc.shape[-1])
        return y[..., :S].transpose(1, 2)

    @staticmethod
    def _segsum(a):
        """a (..., Q) -> (..., Q, Q) with [l, s] = a[s+1] + ... + a[l] for s <= l, -inf above the diagonal."""
        Q = a.shape[-1]
        rep = a[..., None].expand(*a.shape, Q)  # [..., i, s] = a[i]
        rep = rep.masked_fill(~torch.ones(Q, Q, dtype=torch.bool).tril(-1), 0.0)
        out = rep.cumsum(-2)
        return out.masked_fill(~torch.ones(Q, Q, dtype=torch.bool).tril(), float("-inf"))

    def _scan_ssd(self, x, dt, A, Bh, Ch):
        """Chunked state-space-dual form (chunk_size from config), all chunks at once.
        x (B, S, h, P); dt (B, S, h); Bh / Ch (B, S, h, N) -> y (B, S, h, P) (no D term)."""
        Bsz, S, nh, P = x.shape
        Q = self.chunk
        pad = (-S) % Q
        xd = x * dt[..., None]
        la = A * dt
        if pad:
            xd, la = F.pad(xd, (0, 0, 0, 0, 0, pad)), F.pad(la, (0, 0, 0, pad))
            Bh, Ch = F.pad(Bh, (0, 0, 0, 0, 0, pad)), F.pad(Ch, (0, 0, 0, 0, 0, pad))
        nc = xd.shape[1] // Q
        xd = xd.reshape(Bsz, nc, Q, nh, P)
        Bc, Cc = Bh.reshape(Bsz, nc, Q, nh, self.N), Ch.reshape(Bsz, nc, Q, nh, self.N)
        la = la.reshape(Bsz, nc, Q, nh).permute(0, 3, 1, 2)  # (B, h, c, Q)
        cs = la.cumsum(-1)
        # within each chunk
        Lmat = torch.exp(self._segsum(la))  # (B, h, c, l, s)
        scores = torch.einsum("bclhn,bcshn->bclsh", Cc, Bc)
        y_in = torch.einsum("bclsh,bcshp->bclhp", scores * Lmat.permute(0, 2, 3, 4, 1), xd)
        # state left by each chunk, then carried across chunks
        tail = torch.exp(cs[..., -1:] - cs)  # (B, h, c, Q)
        chunk_states = torch.einsum("bclhn,bclhp->bchpn", Bc * tail.permute(0, 2, 3, 1)[..., None], xd)
        chunk_states = torch.cat([torch.zeros_like(chunk_states[:, :1]), chunk_states], 1)
        carry = torch.exp(self._segsum(F.pad(cs[..., -1], (1, 0)))).transpose(1, 3)  # (B, src, dst, h)
        start = torch.einsum("bzch,bzhpn->bchpn", carry, chunk_states)[:, :-1]
        y_out = torch.einsum("bclhn,bchpn->bclhp", Cc, start) * torch.exp(cs).permute(0, 2, 3, 1)[..., None]
        y = (y_in + y_out).reshape(Bsz, -1, nh, P)
        return y[:, :S]

    def _mixer(self, mx, h, pad):
        Bsz, S, _ = h.shape
        if pad is not None:
            h = h * pad[..., None]
        GN = self.G * self.N
        proj = torch.matmul(h, mx.w_in) + mx.b_in if self.transposed else F.linear(h, mx.w_in, mx.b_in)
        z, xbc, dt = proj.split([self.d_inner, self.d_inner + 2 * GN, self.mh], -1)
        xbc = F.silu(self._conv(mx, xbc))
        if pad is not None and BUG != "zamba2_pad_unmasked_after_conv":
            xbc = xbc * pad[..., None]
        x, Bm, Cm = xbc.split([self.d_inner, GN, GN], -1)
        dt = F.softplus(dt + mx.dt_bias)
        if BUG == "zamba2_dt_clamp_max":
            dt = dt.clamp(min=self.dt_min, max=self.dt_max)
        else:
            dt = dt.clamp(min=self.dt_min)
        Bm, Cm = Bm.view(Bsz, S, self.G, self.N), Cm.view(Bsz, S, self.G, self.N)
        if BUG == "zamba2_groups_tiled":
            gi = torch.arange(self.mh) % self.G
        else:
            gi = torch.arange(self.mh) // (self.mh // self.G)
        Bh, Ch = Bm[:, :, gi], Cm[:, :, gi]
        xh = x.reshape(Bsz, S, self.mh, self.mp)
        y = self._scan_ssd(xh, dt, mx.A, Bh, Ch)
        y = (y + mx.D[:, None] * xh).reshape(Bsz, S, self.d_inner)
        # gated group RMSNorm
        gs = self.d_inner if BUG == "zamba2_gated_norm_ungrouped" else self.d_inner // self.G
        if BUG == "zamba2_norm_before_gate":
            yg = y.view(Bsz, S, -1, gs)
            yg = yg * torch.rsqrt(yg.pow(2).mean(-1, keepdim=True) + 1e-5)
            y = yg.reshape(Bsz, S, -1) * F.silu(z)
        else:
            y = y * F.silu(z)
            yg = y.view(Bsz, S, -1, gs)
            y = (yg * torch.rsqrt(yg.pow(2).mean(-1, keepdim=True) + 1e-5)).reshape(Bsz, S, -1)
        y = y * mx.gnorm
        return torch.matmul(y, mx.w_out) + mx.b_out if self.transposed else F.linear(y, mx.w_out, mx.b_out)

    # ---------------------------------------------------------------- model
    def forward(self, input_ids, attention_mask=None, position_ids=None):
        Bsz, S = input_ids.shape
        emb = self.tok[input_ids]
        h = emb
        if position_ids is None:
            position_ids = torch.arange(S)[None].expand(Bsz, S)
        pad = attention_mask.to(h.dtype) if attention_mask is not None else None
        allowed = torch.ones(S, S, dtype=torch.bool).tril()[None, None]
        if attention_mask is not None:
            allowed = allowed & attention_mask.bool()[:, None, None, :]
        use_idx = 0
        for i, t in enumerate(self.types):
            mx = self.mixers[i]
            if t == "hybrid":
                if BUG == "zamba2_block_by_layer_index":
                    b = i % self.nmb
                else:
                    b = use_idx % self.nmb
                use = self.uses[use_idx]
                # the adapters of hybrid use u live in slot u of its block (one set per use, not per block)
                ad = self.uses[b] if BUG == "zamba2_adapters_tied_with_block" else use
                use_idx += 1
                tr = F.linear(self._shared(self.blocks[b], ad, h, emb, position_ids, allowed), use.mix)
                inp = h + tr
                res = inp if BUG == "zamba2_shared_out_in_residual" else h
                h = res + self._mixer(mx, _rms(inp, mx.ln, self.eps), pad)
            else:
                h = h + self._mixer(mx, _rms(h, mx.ln, self.eps), pad)
        h = _rms(h, self.fin, self.eps)
        return torch.matmul(h, self.head) if self.transposed else F.linear(h, self.head)


def build(state_dict, config):
    return Zamba2Port(state_dict, config).eval()
