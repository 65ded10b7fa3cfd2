"""A from-scratch PyTorch port of the Byte Latent Transformer (``BltForCausalLM``) without an entropy patcher.

Architecture (as implemented here; B batch, S bytes, D local width, G global width, k = cross_attn_k)
------------------------------------------------------------------------------------------------------
Patching.  With ``patch_in_forward=False`` every byte is its own patch and one extra empty patch closes the
sequence: patch lengths are ``ones(B, S + 1)``, so ``P = S + 1`` patches and byte ``t`` belongs to patch ``t``
(patch ``S`` holds no byte).  The decoder's patch ids come from the lengths without the first one and are
``t`` as well.

1. Byte embedding with hash n-grams.  For each hash function f (prime ``PRIMES[f]``) and each group size g of
   ``encoder_hash_byte_group_size`` (table index ``j`` counting over (f, g)):
       window_t = (x_{t-g+1}, ..., x_t)        (bytes before the start are 0)
       h_t      = sum_i window_t[i] * prime^i   (int64 arithmetic, wrapping modulo 2^64, signed)
       id_t     = (h_t mod V_hash) + j * V_hash (floor modulo, so in [0, V_hash))
   e_t = E_byte[x_t] + sum_j E_hash[id_t].

2. Local encoder (``encoder_config``): pre-norm Llama-style layers
       h = h + Wo · Attn(RoPE(Wq·n1(h)), RoPE(Wk·n1(h)), Wv·n1(h));   h = h + Wd·(silu(Wg·n2(h)) * Wu·n2(h))
   n = RMSNorm (x * rsqrt(mean(x^2) + eps) * w).  RoPE rotates *adjacent pairs* (2i, 2i+1) of each head by
   angle pos * theta^(-2i/hd), theta from the stack's own ``rope_parameters``; scale hd^-0.5; causal mask with
   the sliding window ``local_attention_window_len`` and the padding mask on keys, added as finfo.min (a fully
   masked row therefore averages all keys uniformly, as Transformers' eager path does).
   After the last layer: patch pooling p_q = max over bytes of patch q of h (amax, empty patch -> 0),
   z = p · W_pe  (D -> k·D), split into k contiguous chunks -> (B, P·k, D) patch slots, then cross-attention
   patch slots -> bytes (slot s of patch s//k may attend only to the bytes of patch s//k; no RoPE, no causal):
       c = Wo · Attn(Wq · nq(z), Wk · nkv(h), Wv · nkv(h)) + z      (the module's own residual)
       z = z + c                                                    (the caller's residual; z counts twice)
   The encoder returns the byte states h and z viewed as (B, P, k·D).

3. Global transformer (``global_config``) over the P patch vectors (optional input projection when k·D != G),
   same layer type, RoPE positions 0..P-1, plain causal mask (no padding mask), no final norm.

4. Local decoder (``decoder_config``): patch slots y = g · W_pd (G -> k·D) as (B, P·k, D); starting from the
   encoder's byte states h, for each layer l (every layer when ``cross_attn_all_layers``):
       h = h + (Wo · Attn(Wq · nq(h), Wk · nkv(y), Wv · nkv(y)) + h)   (byte t attends to the k slots of patch t)
       h = layer_l(h)    (same self-attention layer type, byte positions, the encoder's causal/padding mask)
   then the final RMSNorm and the LM head: logits = n_f(h) · W_lm.

Weight layout (mine; converted in ``build``)
--------------------------------------------
* ``byte_emb`` (V, D); ``hash_emb`` (n_tables, V_hash, D): the fused hash table split per table.
* each self-attention stack (``enc``, ``glob``, ``dec``) is a ``_Stack`` with per-layer weights stacked on dim 0,
  all matrices stored transposed (in -> out):
    ``wqkv`` (L, D, (H + 2·Hkv)·hd)   q | k | v fused along the output axis,
    ``wo``   (L, H·hd, D),
    ``wgu``  (L, D, 2·I)              gate | up fused,
    ``wd``   (L, I, D),
    ``norms`` (L, 2, D)               [attention-norm, mlp-norm].
* each cross-attention set (``enc_x``, ``dec_x``) is a ``_Cross``: ``wq`` (L, D, H·hd), ``wkv`` (L, D, 2·Hkv·hd)
  (k | v), ``wo`` (L, H·hd, D), ``norms`` (L, 2, D) [query-side norm, key/value-side norm].
* ``enc_patch`` (D, k·D), ``glob_in`` (k·D, G) or absent, ``dec_patch`` (G, k·D), ``final_norm`` (D,),
  ``head`` (D, V) - all transposed.
"""

import os

import torch
import torch.nn as nn
import torch.nn.functional as F

BUG = os.environ.get("BUG", "")

BUGS = [
    "rope_half_split",  # RoPE rotates the two halves of each head (Llama/NeoX layout) instead of BLT's adjacent pairs
    "rope_theta_top_level",  # every stack takes rope_theta from the top-level config (500000) instead of its own sub-config's
    "hash_powers_reversed",  # rolling hash gives the newest byte of the window prime^0 instead of the oldest
    "hash_unsigned_mod",  # the wrapped 64-bit hash is taken as unsigned (uint64, C-style) before the modulo
    "hash_no_table_offset",  # hash ids of every n-gram group index the first table (no j * hash_vocab offset)
    "patch_reduce_include_self",  # patch amax pooling includes the zero initial value (scatter_reduce include_self=True)
    "cross_mask_tiled",  # cross_attn_k slots expanded in the cross mask with repeat (tiled) instead of repeat_interleave
    "patch_proj_strided_split",  # the k*D patch projection is split into k slots with a stride instead of contiguous chunks
    "cross_v_unnormed",  # cross-attn kv-side RMSNorm applied to the key input only; values use the unnormalised states
    "cross_scale_global_dim",  # decoder cross-attn scale uses hidden_size_global/heads as head dim (1/sqrt(32) not 1/sqrt(16))
    "decoder_cross_first_layer_only",  # decoder reads cross_attn_all_layers from the encoder config: cross-attn before layer 0 only
    "cross_qnorm_after_proj",  # cross-attn query RMSNorm applied after q_proj (Qwen3-style) instead of before it
    "global_positions_from_bytes",  # global transformer RoPE fed the byte position_ids instead of arange over patches
    "global_padding_mask",  # the byte padding mask is also applied to the global transformer's attention
]

PADDING_ONLY = [
    "global_positions_from_bytes",
    "global_padding_mask",
]

CLEAN = [
    "rope_complex",  # RoPE as complex multiplication of adjacent (re, im) pairs by exp(i*pos*freq)
    "rope_permuted_weights",  # q/k output columns de-interleaved per head and rotated half-split (dot products unchanged)
    "hash_horner",  # rolling hash by Horner's rule in wrapping int64 (same value modulo 2^64)
    "pool_identity",  # one byte per patch: pooling is the byte states plus a zero row, no scatter_reduce
    "cross_attn_direct",  # cross-attn as its exact block structure: gathers/softmax over own slots, empty patch = mean
]

PRIMES = [
    1000000007,
    5915587277,
    1500450271,
    3267000013,
    5754853343,
    4093082899,
    9576890767,
    3628273133,
    2860486313,
    5463458053,
    3367900313,
]


# ----------------------------------------------------------------------------------------------------------------
# small helpers
# ----------------------------------------------------------------------------------------------------------------
def rms_norm(x, w, eps):
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _to_signed64(v):
    v &= (1 << 64) - 1
    return v - (1 << 64) if v >= (1 << 63) else v


def _theta(sub_config, top_config):
    cfg = top_config if BUG == "rope_theta_top_level" else sub_config
    rp = getattr(cfg, "rope_parameters", None) or {}
    if "rope_theta" in rp:
        return float(rp["rope_theta"])
    return float(getattr(cfg, "rope_theta", 10000.0))


def rope_tables(positions, head_dim, theta):
    """positions (B, T) -> angles (B, T, head_dim/2), float32."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    return positions.float()[..., None] * inv.to(positions.device)


def apply_rope(x, ang):
    """x (B, H, T, hd), ang (B, T, hd/2): rotate adjacent pairs (2i, 2i+1) by ang[..., i]."""
    ang = ang[:, None]
    if BUG == "rope_half_split":
        h = x.shape[-1] // 2
        cos = torch.cat([ang.cos(), ang.cos()], -1)
        sin = torch.cat([ang.sin(), ang.sin()], -1)
        rot = torch.cat([-x[..., h:], x[..., :h]], -1)
        return x * cos + rot * sin
    if BUG == "rope_complex":
        xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2).contiguous())
        out = torch.view_as_real(xc * torch.polar(torch.ones_like(ang), ang)).flatten(-2)
        return out.to(x.dtype)
    cos, sin = ang.cos(), ang.sin()
    pairs = x.reshape(*x.shape[:-1], -1, 2)
    a, b = pairs[..., 0], pairs[..., 1]
    return torch.stack([a * cos - b * sin, b * cos + a * sin], -1).flatten(-2)


def apply_rope_half(x, ang):
    """half-split rotation (for weights whose rotary pairs were moved to (i, i + hd/2))."""
    ang = ang[:, None]
    h = x.shape[-1] // 2
    cos, sin = ang.cos(), ang.sin()
    a, b = x[..., :h], x[..., h:]
    return torch.cat([a * cos - b * sin, b * cos + a * sin], -1)


def attend(q, k, v, bias, scale):
    """q (B, H, Tq, hd), k/v (B, Hkv, Tk, hd), bias additive (B, 1, Tq, Tk) or None."""
    rep = q.shape[1] // k.shape[1]
    if rep > 1:
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if bias is not None:
        s = s + bias
    p = torch.softmax(s.float(), dim=-1).to(q.dtype)
    return torch.matmul(p, v)


def additive(allowed, dtype):
    return torch.where(allowed, torch.zeros((), dtype=dtype), torch.tensor(torch.finfo(dtype).min, dtype=dtype))


# ----------------------------------------------------------------------------------------------------------------
# hashing
# ----------------------------------------------------------------------------------------------------------------
def ngram_hash_ids(ids, group, prime, vocab):
    """(B, S) int64 bytes -> (B, S) ids in [0, vocab) of the hash of the `group` bytes ending at each position."""
    b = ids.shape[0]
    padded = torch.cat([torch.zeros(b, group - 1, dtype=torch.int64, device=ids.device), ids.long()], 1)
    win = padded.unfold(1, group, 1)  # (B, S, g), oldest first
    if BUG == "hash_horner":
        h = torch.zeros_like(win[..., 0])
        for i in range(group - 1, -1, -1):
            h = h * prime + win[..., i]
    else:
        pw = [_to_signed64(prime**i) for i in range(group)]
        if BUG == "hash_powers_reversed":
            pw = pw[::-1]
        powers = torch.tensor(pw, dtype=torch.int64, device=ids.device)
        h = (win * powers).sum(-1)
    out = torch.remainder(h, vocab)
    if BUG == "hash_unsigned_mod":
        extra = (1 << 64) % vocab
        out = torch.where(h < 0, torch.remainder(out + extra, vocab), out)
    return out


# ----------------------------------------------------------------------------------------------------------------
# stacks
# ----------------------------------------------------------------------------------------------------------------
class _Stack(nn.Module):
    """Pre-norm self-attention + SwiGLU layers, weights stacked per layer, transposed (in -> out)."""

    def __init__(self, cfg, sd, prefix):
        super().__init__()
        self.n = cfg.num_hidden_layers
        self.h = cfg.num_attention_heads
        self.hkv = cfg.num_key_value_heads or self.h
        self.hd = cfg.hidden_size // self.h
        self.eps = cfg.rms_norm_eps
        self.inter = cfg.intermediate_size
        L = [f"{prefix}.layers.{i}." for i in range(self.n)]
        self.wqkv = nn.Parameter(
            torch.stack(
                [torch.cat([sd[p + f"self_attn.{n}_proj.weight"] for n in "qkv"], 0).t() for p in L]
            ).contiguous()
        )
        self.wo = nn.Parameter(torch.stack([sd[p + "self_attn.o_proj.weight"].t() for p in L]).contiguous())
        self.wgu = nn.Parameter(
            torch.stack(
                [torch.cat([sd[p + "mlp.gate_proj.weight"], sd[p + "mlp.up_proj.weight"]], 0).t() for p in L]
            ).contiguous()
        )
        self.wd = nn.Parameter(torch.stack([sd[p + "mlp.down_proj.weight"].t() for p in L]).contiguous())
        self.norms = nn.Parameter(
            torch.stack(
                [torch.stack([sd[p + "input_layernorm.weight"], sd[p + "post_attention_layernorm.weight"]]) for p in L]
            )
        )
        hd = self.hd
        half = torch.cat([torch.arange(0, hd, 2), torch.arange(1, hd, 2)])
        qk_cols = self.h + self.hkv
        perm = torch.cat(
            [half + j * hd for j in range(qk_cols)] + [torch.arange(qk_cols * hd, (qk_cols + self.hkv) * hd)]
        )
        self.register_buffer("half_perm", perm, persistent=False)

    def layer(self, x, ang, bias, i):
        """layer i: x + attention, then + SwiGLU MLP (both pre-norm)."""
        B, T, _ = x.shape
        h, hkv, hd = self.h, self.hkv, self.hd
        permuted = BUG == "rope_permuted_weights"
        y = rms_norm(x, self.norms[i, 0], self.eps)
        w = self.wqkv[i][:, self.half_perm] if permuted else self.wqkv[i]
        q, k, v = (y @ w).split([h * hd, hkv * hd, hkv * hd], -1)
        q = q.view(B, T, h, hd).transpose(1, 2)
        k = k.view(B, T, hkv, hd).transpose(1, 2)
        v = v.view(B, T, hkv, hd).transpose(1, 2)
        rot = apply_rope_half if permuted else apply_rope
        q, k = rot(q, ang), rot(k, ang)
        a = attend(q, k, v, bias, hd**-0.5)
        x = x + a.transpose(1, 2).reshape(B, T, h * hd) @ self.wo[i]
        y = rms_norm(x, self.norms[i, 1], self.eps)
        g, u = (y @ self.wgu[i]).split(self.inter, -1)
        return x + (F.silu(g) * u) @ self.wd[i]

    def forward(self, x, ang, bias):
        for i in range(self.n):
            x = self.layer(x, ang, bias, i)
        return x


class _Cross(nn.Module):
    """BLT cross-attention layers (RMSNorm on both sides before projection, inner residual on the query side)."""

    def __init__(self, cfg, sd, prefix, n_layers):
        super().__init__()
        self.h = cfg.num_attention_heads
        self.hkv = cfg.num_key_value_heads or self.h
        self.hd = cfg.hidden_size // self.h
        self.eps = cfg.rms_norm_eps
        L = [f"{prefix}.cross_attn_layers.{i}." for i in range(n_layers)]
        self.wq = nn.Parameter(torch.stack([sd[p + "q_proj.weight"].t() for p in L]).contiguous())
        self.wkv = nn.Parameter(
            torch.stack([torch.cat([sd[p + "k_proj.weight"], sd[p + "v_proj.weight"]], 0).t() for p in L]).contiguous()
        )
        self.wo = nn.Parameter(torch.stack([sd[p + "o_proj.weight"].t() for p in L]).contiguous())
        self.norms = nn.Parameter(
            torch.stack([torch.stack([sd[p + "q_norm.weight"], sd[p + "k_norm.weight"]]) for p in L])
        )

    def forward(self, i, xq, xkv, bias, scale=None, direct=None):
        B, Tq, _ = xq.shape
        Tk = xkv.shape[1]
        h, hkv, hd = self.h, self.hkv, self.hd
        if BUG == "cross_qnorm_after_proj":
            q = rms_norm(xq @ self.wq[i], self.norms[i, 0], self.eps)
        else:
            q = rms_norm(xq, self.norms[i, 0], self.eps) @ self.wq[i]
        kv_in = rms_norm(xkv, self.norms[i, 1], self.eps)
        k, v = (kv_in @ self.wkv[i]).split(hkv * hd, -1)
        if BUG == "cross_v_unnormed":
            v = xkv @ self.wkv[i][:, hkv * hd :]
        q = q.view(B, Tq, h, hd).transpose(1, 2)
        k = k.view(B, Tk, hkv, hd).transpose(1, 2)
        v = v.view(B, Tk, hkv, hd).transpose(1, 2)
        scale = hd**-0.5 if scale is None else scale
        if direct is not None:
            a = direct(q, k, v, scale)
        else:
            a = attend(q, k, v, bias, scale)
        out = a.transpose(1, 2).reshape(B, Tq, h * hd) @ self.wo[i]
        return out + xq


# ----------------------------------------------------------------------------------------------------------------
# the model
# ----------------------------------------------------------------------------------------------------------------
class BltPort(nn.Module):
    def __init__(self, sd, config):
        super().__init__()
        self.config = config
        ec, gc, dc = config.encoder_config, config.global_config, config.decoder_config
        self.ec, self.gc, self.dc = ec, gc, dc
        self.k = config.cross_attn_k
        self.window = getattr(config, "local_attention_window_len", None)
        self.groups = list(config.encoder_hash_byte_group_size)
        self.n_funcs = config.encoder_hash_byte_group_nb_functions
        self.hash_vocab = config.encoder_hash_byte_group_vocab
        n_tab = self.n_funcs * len(self.groups)

        self.byte_emb = nn.Parameter(sd["model.local_encoder.embed_tokens.weight"].clone())
        self.hash_emb = nn.Parameter(
            sd["model.encoder_hash_tok_embedding.weight"].reshape(n_tab, self.hash_vocab, -1).clone()
        )
        self.enc = _Stack(ec, sd, "model.local_encoder")
        self.enc_x = _Cross(ec, sd, "model.local_encoder", ec.num_hidden_layers if ec.cross_attn_all_layers else 1)
        self.enc_patch = nn.Parameter(sd["model.local_encoder.patch_embedding_projection.weight"].t().contiguous())
        self.glob = _Stack(gc, sd, "model.global_transformer")
        key = "model.global_transformer.token_embedding_projection.weight"
        self.glob_in = nn.Parameter(sd[key].t().contiguous()) if key in sd else None
        self.dec = _Stack(dc, sd, "model.local_decoder")
        self.dec_x = _Cross(dc, sd, "model.local_decoder", dc.num_hidden_layers if dc.cross_attn_all_layers else 1)
        self.dec_patch = nn.Parameter(sd["model.local_decoder.patch_embedding_projection.weight"].t().contiguous())
        self.final_norm = nn.Parameter(sd["model.local_decoder.norm.weight"].clone())
        self.head = nn.Parameter(sd["lm_head.weight"].t().contiguous())

    # -- pieces ---------------------------------------------------------------------------------------------
    def embed(self, ids):
        x = self.byte_emb[ids]
        j = 0
        for f in range(self.n_funcs):
            prime = PRIMES[f % len(PRIMES)]
            for g in self.groups:
                hid = ngram_hash_ids(ids, g, prime, self.hash_vocab)
                table = self.hash_emb[0] if BUG == "hash_no_table_offset" else self.hash_emb[j]
                x = x + table[hid]
                j += 1
        return x

    def split_slots(self, z, width):
        """(B, P, k*width) -> (B, P*k, width): slot s of patch p = chunk s of the projection."""
        B, P, _ = z.shape
        if BUG == "patch_proj_strided_split":
            return z.view(B, P, width, self.k).transpose(-1, -2).reshape(B, P * self.k, width)
        return z.reshape(B, P * self.k, width)

    def pool(self, hs, patch_ids, n_patches):
        B, S, D = hs.shape
        if BUG == "pool_identity":
            return torch.cat([hs, hs.new_zeros(B, n_patches - S, D)], 1)
        out = hs.new_zeros(B, n_patches, D)
        idx = patch_ids[..., None].expand(B, S, D)
        return out.scatter_reduce(1, idx, hs, reduce="amax", include_self=BUG == "patch_reduce_include_self")

    def slot_mask(self, q_patch, kv_patch, dim, dtype):
        """bool (B, Tq, Tk) of exact patch matching, expanded by k along `dim` (1: queries, 2: keys)."""
        m = q_patch[..., :, None] == kv_patch[..., None, :]
        if BUG == "cross_mask_tiled":
            reps = [1, 1, 1]
            reps[dim] = self.k
            m = m.repeat(*reps)
        else:
            m = m.repeat_interleave(self.k, dim=dim)
        return additive(m, dtype)[:, None]

    # -- forward --------------------------------------------------------------------------------------------
    def forward(self, input_ids, attention_mask=None, position_ids=None):
        ids = input_ids.long()
        B, S = ids.shape
        dev = ids.device
        k = self.k
        if attention_mask is None:
            attention_mask = torch.ones(B, S, dtype=torch.long, device=dev)
        if position_ids is None:
            position_ids = torch.arange(S, device=dev)[None].expand(B, S)
        pad = attention_mask.bool()

        # patches: every byte its own patch plus one empty closing patch
        lengths = torch.ones(B, S + 1, dtype=torch.long, device=dev)
        P = lengths.shape[1]
        starts = torch.cumsum(lengths, -1) - lengths
        tpos = torch.arange(S, device=dev)
        patch_ids = (starts[:, None, :] <= tpos[None, :, None]).sum(-1) - 1  # (B, S)
        dl = lengths[:, 1:]
        dstarts = torch.cumsum(dl, -1) - dl
        dec_patch_ids = (dstarts[:, None, :] <= tpos[None, :, None]).sum(-1) - 1

        x = self.embed(ids)
        dtype = x.dtype

        # local (byte) self-attention mask: causal (+ sliding window) and key padding
        qi = tpos[:, None]
        ki = tpos[None, :]
        allowed = ki <= qi
        if self.window is not None:
            allowed = allowed & (ki > qi - self.window)
        local_bias = additive(allowed[None] & pad[:, None, :], dtype)[:, None]

        # ---- local encoder
        ec = self.ec
        ang_e = rope_tables(position_ids, ec.hidden_size // ec.num_attention_heads, _theta(ec, self.config))
        hs = x
        patches = None
        n_enc = ec.num_hidden_layers
        for li in range(n_enc):
            hs = self.enc.layer(hs, ang_e, local_bias, li)
            if li == n_enc - 1 or ec.cross_attn_all_layers:
                pooled = self.pool(hs, patch_ids, P)
                z = self.split_slots(pooled @ self.enc_patch, ec.hidden_size)
                xi = li if ec.cross_attn_all_layers else 0
                if BUG == "cross_attn_direct":
                    c = self.enc_x(xi, z, hs, None, direct=self._direct_enc(patch_ids, P))
                else:
                    bias = self.slot_mask(torch.arange(P, device=dev)[None].expand(B, P), patch_ids, 1, dtype)
                    c = self.enc_x(xi, z, hs, bias)
                z = z + c
                patches = z
        g_in = patches.reshape(B, P, k * ec.hidden_size)

        # ---- global transformer over patches
        gc = self.gc
        g = g_in @ self.glob_in if self.glob_in is not None else g_in
        if BUG == "global_positions_from_bytes":
            gpos = torch.cat([position_ids, position_ids[:, -1:] + 1], 1)
        else:
            gpos = torch.arange(P, device=dev)[None].expand(B, P)
        ang_g = rope_tables(gpos, gc.hidden_size // gc.num_attention_heads, _theta(gc, self.config))
        pi = torch.arange(P, device=dev)
        gallowed = (pi[None, :] <= pi[:, None])[None].expand(B, P, P)
        if BUG == "global_padding_mask":
            gpad = torch.cat([pad, torch.ones(B, 1, dtype=torch.bool, device=dev)], 1)
            gallowed = gallowed & gpad[:, None, :]
        g = self.glob(g, ang_g, additive(gallowed, dtype)[:, None])

        # ---- local decoder
        dc = self.dc
        y = self.split_slots(g @ self.dec_patch, dc.hidden_size)
        ang_d = rope_tables(position_ids, dc.hidden_size // dc.num_attention_heads, _theta(dc, self.config))
        if BUG == "cross_attn_direct":
            dbias, ddirect = None, self._direct_dec(dec_patch_ids, P)
        else:
            dbias = self.slot_mask(dec_patch_ids, torch.arange(P, device=dev)[None].expand(B, P), 2, dtype)
            ddirect = None
        all_layers = dc.cross_attn_all_layers
        if BUG == "decoder_cross_first_layer_only":
            all_layers = ec.cross_attn_all_layers
        scale = None
        if BUG == "cross_scale_global_dim":
            scale = (dc.hidden_size_global // dc.num_attention_heads) ** -0.5
        h = hs
        for li in range(dc.num_hidden_layers):
            if li == 0 or all_layers:
                h = h + self.dec_x(li, h, y, dbias, scale=scale, direct=ddirect)
            h = self.dec.layer(h, ang_d, local_bias, li)
        h = rms_norm(h, self.final_norm, dc.rms_norm_eps)
        return (h @ self.head).float()

    # exact block-structured cross attention (clean variant): each encoder slot of patch p < S holds one byte,
    # the empty patch's slots see no byte (fully masked row -> uniform average of all bytes, as the additive
    # finfo.min mask gives); each decoder byte sees the k slots of its own patch.
    def _direct_enc(self, patch_ids, P):
        k = self.k

        def run(q, kk, v, scale):
            B, H, Tq, hd = q.shape
            S = kk.shape[2]
            rep = H // kk.shape[1]
            kk, v = kk.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
            slot_patch = torch.arange(Tq, device=q.device) // k  # (Tq,)
            out = v.mean(2, keepdim=True).expand(B, H, Tq, hd).clone()
            # byte owning each patch (one byte per patch): byte t is in patch patch_ids[b, t]
            owner = torch.full((B, P), -1, dtype=torch.long, device=q.device)
            owner.scatter_(1, patch_ids, torch.arange(S, device=q.device)[None].expand(B, S))
            src = owner[:, slot_patch]  # (B, Tq)
            has = src >= 0
            gathered = torch.gather(v, 2, src.clamp(min=0)[:, None, :, None].expand(B, H, Tq, hd))
            return torch.where(has[:, None, :, None], gathered, out)

        return run

    def _direct_dec(self, dec_patch_ids, P):
        k = self.k

        def run(q, kk, v, scale):
            B, H, S, hd = q.shape
            rep = H // kk.shape[1]
            kk, v = kk.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
            slots = dec_patch_ids[:, :, None] * k + torch.arange(k, device=q.device)  # (B, S, k)
            idx = slots[:, None, :, :, None].expand(B, H, S, k, hd)
            ks = torch.gather(kk[:, :, None].expand(B, H, S, kk.shape[2], hd), 3, idx)
            vs = torch.gather(v[:, :, None].expand(B, H, S, v.shape[2], hd), 3, idx)
            s = (q[:, :, :, None, :] * ks).sum(-1) * scale
            p = torch.softmax(s.float(), -1).to(q.dtype)
            return (p[..., None] * vs).sum(3)

        return run


def build(state_dict, config):
    sd = {k: v.detach().float() for k, v in state_dict.items()}
    return BltPort(sd, config).float().eval()
