"""Hand-written plain-PyTorch port of Granite-MoE-Shared (GraniteMoeSharedForCausalLM).

Architecture as this port implements it (what differs from Llama is marked *):
  * token embedding multiplied by embedding_multiplier before the first block; untied output head;
  RMSNorm y = x / sqrt(mean(x^2) + eps) * w, two pre-norms per block;
  * residual branches scaled by residual_multiplier before being added:
        h = h + m * Attn(RMS_in(h));  h = h + m * (MoE(n) + SharedMLP(n)),  n = RMS_post(h);
  attention: GQA (nh = 4, nkv = 2), head_dim = hidden / heads, no biases;
  * scores = q.k * attention_multiplier (NOT head_dim**-0.5);
  RoPE in the half-split (rotate_half / NeoX) form, theta = rope_parameters["rope_theta"];
  * MoE: router logits = x @ Wr^T (no bias), top-k (num_experts_per_tok) of the logits, softmax over the k selected
    logits only; each expert is silu(gate) * up -> down with gate/up packed in one matrix, gate = first half;
  * shared expert (shared_intermediate_size): same packed SwiGLU (gate = first half), always on, added to the MoE
    output inside the residual multiplier;
  * logits divided by logits_scaling;
  padding: HF-style attention_mask masks padded keys; positions from position_ids (0..S-1 when absent).

Weight layout of this port (einsum / JAX-like, own names, not the HF state-dict names):
  wte (V, H); ln_f.scale (H,); head (H, V) applied as x @ head;
  blocks[i].ln_attn.scale / ln_moe.scale (H,);
  blocks[i].attn.wq (H, nh, hd); blocks[i].attn.wkv (H, 2, nkv, hd) with [:, 0] = K, [:, 1] = V;
  blocks[i].attn.wo (nh, hd, H); all applied through torch.einsum;
  blocks[i].moe.router (H, E); blocks[i].moe.w_in (E, H, 2, I) with [..., 0, :] = gate, [..., 1, :] = up;
  blocks[i].moe.w_out (E, I, H);
  blocks[i].shared.w_in (H, 2, Is) with [:, 0] = gate, [:, 1] = up; blocks[i].shared.w_out (Is, H).
"""

import os

import torch
import torch.nn as nn
import torch.nn.functional as F

BUG = os.environ.get("BUG", "")
REC = None

BUGS = [
    "gs_embedding_multiplier_dropped",  # embeddings fed to the first block without embedding_multiplier
    "gs_attention_multiplier_ignored",  # Llama scaling head_dim**-0.5 kept instead of config.attention_multiplier
    "gs_residual_multiplier_dropped",  # residual_multiplier never applied: branches added at full strength
    "gs_residual_multiplier_on_stream",  # multiplier applied to the residual stream (m * h + branch), not the branch
    "gs_logits_scaling_multiply",  # logits multiplied by logits_scaling instead of divided
    "gs_shared_expert_dropped",  # shared_mlp weights never loaded: only routed experts contribute
    "gs_shared_outside_multiplier",  # shared-expert output added after the residual multiplier (h + m*moe + shared)
    "gs_shared_on_residual",  # shared expert fed the un-normalised residual stream instead of RMS_post(h)
    "gs_router_softmax_then_topk",  # Mixtral-style softmax over all experts, top-k weights not renormalised
    "gs_expert_gate_up_swapped",  # packed expert matrix split as [up | gate]: SiLU applied to the up half
    "gs_shared_split_interleaved",  # shared input_linear split by even/odd rows instead of first/second half
    "gs_rope_interleaved",  # RoPE applied to interleaved pairs (GPT-J) instead of half-split
    "gs_pad_mask_ignored",  # attention_mask never merged into the causal mask
]
PADDING_ONLY = {"gs_pad_mask_ignored"}
CLEAN = [
    "multipliers_folded",  # embedding_multiplier into wte, residual_multiplier into wo / w_out, 1/logits_scaling into head
    "query_scale_folded",  # attention_multiplier folded into wq, scores left unscaled
    "dense_experts",  # every expert run on every token, combined with a sparse (T, E) gate matrix
    "router_masked_softmax",  # softmax over all logits with non-selected experts set to -inf
    "varlen_unpad",  # each row's real tokens run alone with their own position_ids, logits scattered back
]


def _bug():
    return globals()["BUG"]


def _rec(name, t):
    r = globals()["REC"]
    if isinstance(r, dict):
        r[name] = t.detach().clone()


def _P(t):
    return nn.Parameter(t.detach().clone().float().contiguous(), requires_grad=False)


class RMSNorm(nn.Module):
    def __init__(self, w, eps):
        super().__init__()
        self.scale = _P(w)
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.scale


def _rope(x, cos, sin):
    """x (B, S, heads, hd); cos/sin (B, S, hd/2)"""
    c, s = cos[:, :, None], sin[:, :, None]
    if _bug() == "gs_rope_interleaved":
        x0, x1 = x[..., 0::2], x[..., 1::2]
        return torch.stack((x0 * c - x1 * s, x0 * s + x1 * c), -1).flatten(-2)
    h = x.shape[-1] // 2
    x0, x1 = x[..., :h], x[..., h:]
    return torch.cat((x0 * c - x1 * s, x1 * c + x0 * s), -1)


class Attn(nn.Module):
    def __init__(self, sd, p, cfg, rmul):
        super().__init__()
        b = _bug()
        self.pre = p
        self.nh, self.nkv = cfg.num_attention_heads, cfg.num_key_value_heads
        H = cfg.hidden_size
        self.hd = H // self.nh
        q = sd[p + "q_proj.weight"].float().t().reshape(H, self.nh, self.hd)
        k = sd[p + "k_proj.weight"].float().t().reshape(H, self.nkv, self.hd)
        v = sd[p + "v_proj.weight"].float().t().reshape(H, self.nkv, self.hd)
        self.scale = float(cfg.attention_multiplier)
        if b == "gs_attention_multiplier_ignored":
            self.scale = self.hd**-0.5
        if b == "query_scale_folded":
            q = q * self.scale
            self.scale = 1.0
        self.wq = _P(q)
        self.wkv = _P(torch.stack((k, v), 1))
        self.wo = _P(sd[p + "o_proj.weight"].float().t().reshape(self.nh, self.hd, H) * rmul)

    def forward(self, x, allowed, cos, sin):
        B, S, _ = x.shape
        q = torch.einsum("bsh,hnd->bsnd", x, self.wq)
        k = torch.einsum("bsh,hnd->bsnd", x, self.wkv[:, 0])
        v = torch.einsum("bsh,hnd->bsnd", x, self.wkv[:, 1])
        if _bug() != "query_scale_folded":
            _rec(self.pre + "q_proj", q.reshape(B, S, -1))
        _rec(self.pre + "k_proj", k.reshape(B, S, -1))
        _rec(self.pre + "v_proj", v.reshape(B, S, -1))
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        g = self.nh // self.nkv
        k, v = k.repeat_interleave(g, 2), v.repeat_interleave(g, 2)
        s = torch.einsum("bqnd,bknd->bnqk", q, k) * self.scale
        s = s.masked_fill(~allowed, torch.finfo(s.dtype).min)
        ctx = torch.einsum("bnqk,bknd->bqnd", torch.softmax(s, -1), v)
        out = torch.einsum("bqnd,ndh->bqh", ctx, self.wo)
        if _bug() != "multipliers_folded":
            _rec(self.pre.rstrip("."), out)
        return out


class MoE(nn.Module):
    def __init__(self, sd, p, cfg, rmul):
        super().__init__()
        self.pre = p
        self.k = cfg.num_experts_per_tok
        gu = sd[p + "experts.gate_up_proj"].float()  # (E, 2I, H)
        E, I2, H = gu.shape
        I = I2 // 2  # noqa: E741
        w_in = gu.view(E, 2, I, H).permute(0, 3, 1, 2)  # (E, H, 2, I)
        if _bug() == "gs_expert_gate_up_swapped":
            w_in = w_in.flip(2)
        self.w_in = _P(w_in)
        self.w_out = _P(sd[p + "experts.down_proj"].float().transpose(1, 2) * rmul)  # (E, I, H)
        self.router = _P(sd[p + "router.weight"].float().t())
        self.E = E

    def gates(self, x):
        b = _bug()
        logits = x @ self.router
        if b == "gs_router_softmax_then_topk":
            w, idx = torch.softmax(logits, -1).topk(self.k, -1)
        elif b == "router_masked_softmax":
            _, idx = logits.topk(self.k, -1)
            keep = torch.zeros_like(logits, dtype=torch.bool).scatter(1, idx, True)
            probs = torch.softmax(logits.masked_fill(~keep, float("-inf")), -1)
            w = probs.gather(1, idx)
        else:
            top, idx = logits.topk(self.k, -1)
            w = torch.softmax(top, -1)
        return torch.zeros_like(logits).scatter(1, idx, w)  # (T, E)

    def forward(self, x):
        B, S, H = x.shape
        t = x.reshape(-1, H)
        G = self.gates(t)
        if _bug() == "dense_experts":
            h = torch.einsum("th,ehci->etci", t, self.w_in)
            y = torch.einsum("eti,eih->eth", F.silu(h[:, :, 0]) * h[:, :, 1], self.w_out)
            out = torch.einsum("te,eth->th", G, y)
        else:
            out = torch.zeros_like(t)
            for e in range(self.E):
                rows = (G[:, e] != 0).nonzero().flatten()
                if rows.numel() == 0:
                    continue
                h = torch.einsum("th,hci->tci", t[rows], self.w_in[e])
                y = (F.silu(h[:, 0]) * h[:, 1]) @ self.w_out[e]
                out.index_add_(0, rows, y * G[rows, e, None])
        out = out.view(B, S, H)
        if _bug() != "multipliers_folded":
            _rec(self.pre + "block_sparse_moe", out)
        return out


class Shared(nn.Module):
    def __init__(self, sd, p, rmul):
        super().__init__()
        w = sd[p + "input_linear.weight"].float()  # (2 Is, H)
        Is = w.shape[0] // 2
        if _bug() == "gs_shared_split_interleaved":
            w_in = torch.stack((w[0::2], w[1::2]), 0)
        else:
            w_in = w.view(2, Is, -1)
        self.w_in = _P(w_in.permute(2, 0, 1))  # (H, 2, Is)
        self.w_out = _P(sd[p + "output_linear.weight"].float().t() * rmul)
        self.pre = p

    def forward(self, x):
        h = torch.einsum("bsh,hci->bsci", x, self.w_in)
        out = (F.silu(h[..., 0, :]) * h[..., 1, :]) @ self.w_out
        if _bug() != "multipliers_folded":
            _rec(self.pre.rstrip("."), out)
        return out


class Block(nn.Module):
    def __init__(self, sd, cfg, i):
        super().__init__()
        b = _bug()
        p = f"model.layers.{i}."
        self.pre = p
        self.m = float(cfg.residual_multiplier)
        rmul = 1.0
        if b == "multipliers_folded":
            rmul, self.m = self.m, 1.0
        self.ln_attn = RMSNorm(sd[p + "input_layernorm.weight"], cfg.rms_norm_eps)
        self.attn = Attn(sd, p + "self_attn.", cfg, rmul)
        self.ln_moe = RMSNorm(sd[p + "post_attention_layernorm.weight"], cfg.rms_norm_eps)
        self.moe = MoE(sd, p + "block_sparse_moe.", cfg, rmul)
        has_shared = (p + "shared_mlp.input_linear.weight") in sd and b != "gs_shared_expert_dropped"
        self.shared = Shared(sd, p + "shared_mlp.", rmul) if has_shared else None

    def _add(self, h, branch):
        b = _bug()
        if b == "gs_residual_multiplier_dropped":
            return h + branch
        if b == "gs_residual_multiplier_on_stream":
            return h * self.m + branch
        return h + branch * self.m

    def forward(self, h, allowed, cos, sin):
        b = _bug()
        n = self.ln_attn(h)
        _rec(self.pre + "input_layernorm", n)
        h = self._add(h, self.attn(n, allowed, cos, sin))
        n = self.ln_moe(h)
        _rec(self.pre + "post_attention_layernorm", n)
        y = self.moe(n)
        if self.shared is None:
            h = self._add(h, y)
        elif b == "gs_shared_outside_multiplier":
            h = self._add(h, y) + self.shared(n)
        else:
            sh = self.shared(h if b == "gs_shared_on_residual" else n)
            h = self._add(h, y + sh)
        _rec(self.pre.rstrip("."), h)
        return h


class GraniteMoeSharedPort(nn.Module):
    def __init__(self, sd, cfg):
        super().__init__()
        b = _bug()
        self.cfg = cfg
        table = sd["model.embed_tokens.weight"].float()
        head = sd.get("lm_head.weight")
        if head is None or cfg.tie_word_embeddings:
            head = table
        head = head.float()
        self.emul = float(cfg.embedding_multiplier)
        self.lscale = float(cfg.logits_scaling)
        if b == "multipliers_folded":
            head = head / self.lscale
            table = table * self.emul
            self.emul, self.lscale = 1.0, 1.0
        self.wte = _P(table)
        self.head = _P(head.t())
        self.blocks = nn.ModuleList(Block(sd, cfg, i) for i in range(cfg.num_hidden_layers))
        self.ln_f = RMSNorm(sd["model.norm.weight"], cfg.rms_norm_eps)
        rp = cfg.rope_parameters or {}
        if rp.get("rope_type", "default") != "default":
            raise NotImplementedError(rp["rope_type"])
        hd = cfg.hidden_size // cfg.num_attention_heads
        self.inv_freq = 1.0 / (float(rp["rope_theta"]) ** (torch.arange(0, hd, 2, dtype=torch.float) / hd))

    def _core(self, input_ids, keep, pos):
        b = _bug()
        B, S = input_ids.shape
        causal = torch.tril(torch.ones(S, S, dtype=torch.bool))[None, None]
        allowed = causal if b == "gs_pad_mask_ignored" else causal & keep[:, None, None, :]
        allowed = allowed.expand(B, 1, S, S)
        h = self.wte[input_ids]
        if b != "gs_embedding_multiplier_dropped":
            h = h * self.emul
        _rec("model.embed_tokens", h)
        ang = pos[..., None].float() * self.inv_freq
        cos, sin = ang.cos(), ang.sin()
        for blk in self.blocks:
            h = blk(h, allowed, cos, sin)
        h = self.ln_f(h)
        _rec("model.norm", h)
        logits = h @ self.head
        if b == "gs_logits_scaling_multiply":
            logits = logits * self.lscale
        else:
            logits = logits / self.lscale
        _rec("lm_head", logits)
        return logits

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        B, S = input_ids.shape
        if attention_mask is None:
            attention_mask = torch.ones(B, S, dtype=torch.long)
        keep = attention_mask.bool()
        if position_ids is None:
            position_ids = torch.arange(S)[None]
        position_ids = position_ids.expand(B, S)
        if _bug() == "varlen_unpad":
            saved, globals()["REC"] = globals()["REC"], None
            logits = torch.zeros(B, S, self.cfg.vocab_size)
            for r in range(B):
                ids = input_ids[r][keep[r]][None]
                pos = position_ids[r][keep[r]][None]
                logits[r, keep[r]] = self._core(ids, torch.ones_like(ids, dtype=torch.bool), pos)[0]
            globals()["REC"] = saved
            return logits.float()
        return self._core(input_ids, keep, position_ids).float()


def build(state_dict, config):
    return GraniteMoeSharedPort(state_dict, config).eval()
