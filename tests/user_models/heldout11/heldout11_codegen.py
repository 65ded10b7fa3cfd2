"""Hand-written plain-PyTorch port of a CodeGen causal LM.

The fused qkv_proj (mp_num=4 blocks, each [q | v | k]) is re-packed at build time
into separate per-head q/k/v matrices stored as (in, out); partial rotary with
rotate-every-two on the first rotary_dim of each head; parallel attn + MLP on ln_1.
"""

import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

BUG = os.environ.get("BUG", "")
REC = None

BUGS = [
    "cg_mp_num_8",  # qkv re-pack assumes mp_num=8 (CodeGen2/TPU-v4 layout) instead of 4
    "cg_qvk_split_without_mp_blocks",  # q|v|k order known but split as three flat chunks, mp blocking ignored
    "cg_rotary_before_head_split",  # rotary applied to the first rotary_dim channels of the whole q/k (only head 0) before splitting heads
    "cg_scale_attn_inverted",  # scores multiplied by scale_attn=sqrt(head_dim) instead of divided; cf. AI-Hypercomputer/maxtext#1370
    "cg_qk_rope_positions_split",  # q rotated with mask-derived positions, k (cache writer) with arange
    "cg_mlp_double_ln",  # MLP branch re-applies ln_1 to the already normalised input (sequential-block template)
    "cg_rotate_every_two_stack_dim",  # rotate_every_two stacks on dim -2 -> halves layout [-x_odd, x_even] while cos/sin stay interleaved
    "cg_k_pass_from_q",  # copy-paste: key = cat(k_rot, q_pass)
    "cg_inv_freq_missing_step",  # inv_freq exponent arange(0, rd//2)/rd (step-2 arange lost)
    "cg_rope_q_applied_twice",  # q rotated in the head-split helper and again in attention
    "cg_out_proj_shards_averaged",  # row-parallel out_proj partial sums over mp_num shards averaged instead of summed
    "cg_act_after_fc_out",  # gelu_new applied to fc_out output instead of fc_in output (block order misread)
]
PADDING_ONLY = {"cg_qk_rope_positions_split"}
CLEAN = [
    "sdpa",  # F.scaled_dot_product_attention with explicit scale and additive mask
    "fused_mp_runtime",  # keep the fused qkv weight and do the mp_num split at runtime
    "rope_halfsplit_repack",  # q/k rotary rows permuted to half-split layout at build, rotate_half at runtime
    "rope_rotation_matrix",  # rope as explicit block-diagonal 2x2 rotation matrices
]


def _bug():
    return globals()["BUG"]


def _rec(name, t):
    r = globals()["REC"]
    if isinstance(r, dict):
        r[name] = t.detach().clone()


def _P(t):
    return nn.Parameter(t.detach().clone().float().contiguous(), requires_grad=False)


def _gelu_new(x):
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x.pow(3))))


def _ln(x, w, b, eps):
    mu = x.mean(-1, keepdim=True)
    var = (x - mu).pow(2).mean(-1, keepdim=True)
    return (x - mu) / torch.sqrt(var + eps) * w + b


class Block(nn.Module):
    pass


def _repack_qkv(W, E, mp):
    """W: (3E, E) fused rows laid out as mp blocks of [q | v | k]. Returns (in,out) q, k, v."""
    local = E // mp
    blocks = W.view(mp, 3, local, E)
    q = blocks[:, 0].reshape(E, E)
    v = blocks[:, 1].reshape(E, E)
    k = blocks[:, 2].reshape(E, E)
    return q.t(), k.t(), v.t()


class CodeGenPort(nn.Module):
    def __init__(self, sd, cfg):
        super().__init__()
        b = _bug()
        self.cfg = cfg
        E = self.E = cfg.n_embd
        self.nh = cfg.n_head
        self.hd = E // cfg.n_head
        self.rd = cfg.rotary_dim or self.hd
        self.eps = cfg.layer_norm_epsilon
        self.mp = 4
        rd, hd = self.rd, self.hd
        perm = torch.arange(hd)
        if b == "rope_halfsplit_repack":
            perm = torch.cat([torch.arange(0, rd, 2), torch.arange(1, rd, 2), torch.arange(rd, hd)])
        rowperm = (torch.arange(self.nh)[:, None] * hd + perm[None]).reshape(-1)
        self.wte = _P(sd["transformer.wte.weight"])
        self.lnf_w = _P(sd["transformer.ln_f.weight"])
        self.lnf_b = _P(sd["transformer.ln_f.bias"])
        self.head_w = _P(sd["lm_head.weight"].t())
        self.head_b = _P(sd["lm_head.bias"])
        self.blocks = nn.ModuleList()
        for i in range(cfg.n_layer):
            p = f"transformer.h.{i}."
            blk = Block()
            blk.idx = i
            blk.ln_w = _P(sd[p + "ln_1.weight"])
            blk.ln_b = _P(sd[p + "ln_1.bias"])
            W = sd[p + "attn.qkv_proj.weight"]
            if b == "fused_mp_runtime":
                blk.qkv = _P(W.t())
            else:
                if b == "cg_mp_num_8":
                    q, k, v = _repack_qkv(W, E, 8)
                elif b == "cg_qvk_split_without_mp_blocks":
                    q, v, k = (t.t() for t in W.split(E, 0))
                else:
                    q, k, v = _repack_qkv(W, E, self.mp)
                blk.wq = _P(q[:, rowperm])
                blk.wk = _P(k[:, rowperm])
                blk.wv = _P(v)
            blk.wo = _P(sd[p + "attn.out_proj.weight"].t())
            blk.fc1_w = _P(sd[p + "mlp.fc_in.weight"].t())
            blk.fc1_b = _P(sd[p + "mlp.fc_in.bias"])
            blk.fc2_w = _P(sd[p + "mlp.fc_out.weight"].t())
            blk.fc2_b = _P(sd[p + "mlp.fc_out.bias"])
            self.blocks.append(blk)

    def _sincos(self, pos):
        rd = self.rd
        if _bug() == "cg_inv_freq_missing_step":
            inv = 1.0 / (10000 ** (torch.arange(0, rd // 2, dtype=torch.float32) / rd))
        else:
            inv = 1.0 / (10000 ** (torch.arange(0, rd, 2, dtype=torch.float32) / rd))
        ang = pos.float()[..., None] * inv  # (B,S,rd/2)
        return ang.sin()[:, :, None], ang.cos()[:, :, None]  # (B,S,1,rd/2)

    def _rotate(self, x, sc):
        """x (..., rd) in (B,S,H,rd) layout."""
        b = _bug()
        sin, cos = sc
        if b == "rope_halfsplit_repack":
            h = x.shape[-1] // 2
            x1, x2 = x[..., :h], x[..., h:]
            return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), -1)
        if b == "rope_rotation_matrix":
            n = x.shape[-1] // 2
            R = torch.zeros(cos.shape[:-1] + (n, 2, 2))
            R[..., 0, 0] = cos
            R[..., 0, 1] = -sin
            R[..., 1, 0] = sin
            R[..., 1, 1] = cos
            xp = x.reshape(x.shape[:-1] + (n, 2))
            return torch.einsum("...nij,...nj->...ni", R, xp).reshape(x.shape)
        sin2 = torch.repeat_interleave(sin, 2, -1)
        cos2 = torch.repeat_interleave(cos, 2, -1)
        x1, x2 = x[..., ::2], x[..., 1::2]
        if b == "cg_rotate_every_two_stack_dim":
            rot = torch.stack((-x2, x1), dim=-2).flatten(-2)
        else:
            rot = torch.stack((-x2, x1), dim=-1).flatten(-2)
        return x * cos2 + rot * sin2

    def _attn(self, blk, x, amask, sc_q, sc_k, pre):
        b = _bug()
        B, S, E = x.shape
        nh, hd, rd = self.nh, self.hd, self.rd
        if b == "fused_mp_runtime":
            qkv = x @ blk.qkv
            _rec(pre + "qkv_proj", qkv)
            parts = qkv.view(B, S, self.mp, 3 * E // self.mp)
            q, v, k = parts.split(E // self.mp, -1)
            q, v, k = (t.reshape(B, S, nh, hd) for t in (q, v, k))
        else:
            q, k, v = x @ blk.wq, x @ blk.wk, x @ blk.wv
            if b != "rope_halfsplit_repack":
                mp = self.mp
                _rec(
                    pre + "qkv_proj",
                    torch.stack((q.view(B, S, mp, -1), v.view(B, S, mp, -1), k.view(B, S, mp, -1)), 3).reshape(
                        B, S, -1
                    ),
                )
            if b == "cg_rotary_before_head_split":
                sq, cq = sc_q[0][:, :, 0], sc_q[1][:, :, 0]
                sk, ck = sc_k[0][:, :, 0], sc_k[1][:, :, 0]
                q = torch.cat((self._rotate(q[..., :rd], (sq, cq)), q[..., rd:]), -1)
                k = torch.cat((self._rotate(k[..., :rd], (sk, ck)), k[..., rd:]), -1)
            q, k, v = (t.view(B, S, nh, hd) for t in (q, k, v))
        if b != "cg_rotary_before_head_split":
            q_rot = self._rotate(q[..., :rd], sc_q)
            if b == "cg_rope_q_applied_twice":
                q_rot = self._rotate(q_rot, sc_q)
            k_rot = self._rotate(k[..., :rd], sc_k)
            q_pass, k_pass = q[..., rd:], k[..., rd:]
            q = torch.cat((q_rot, q_pass), -1)
            k = torch.cat((k_rot, q_pass if b == "cg_k_pass_from_q" else k_pass), -1)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        scale_attn = math.sqrt(hd)
        if b == "sdpa":
            ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=amask, scale=1.0 / scale_attn)
        else:
            s = q @ k.transpose(-1, -2)
            s = s * scale_attn if b == "cg_scale_attn_inverted" else s / scale_attn
            ctx = torch.softmax(s + amask, -1) @ v
        ctx = ctx.transpose(1, 2).reshape(B, S, E)
        if b == "cg_out_proj_shards_averaged":
            sh = E // self.mp
            parts = [ctx[..., j * sh : (j + 1) * sh] @ blk.wo[j * sh : (j + 1) * sh] for j in range(self.mp)]
            out = torch.stack(parts).mean(0)
        else:
            out = ctx @ blk.wo
        _rec(pre + "out_proj", out)
        _rec(pre.rstrip("."), out)
        return out

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        b = _bug()
        B, S = input_ids.shape
        if attention_mask is None:
            attention_mask = torch.ones(B, S, dtype=torch.long)
        pos_given = position_ids is not None
        if position_ids is None:
            position_ids = torch.arange(S)[None].expand(B, S)
        pos_q = position_ids
        if b == "cg_qk_rope_positions_split" and not pos_given:
            pos_q = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        sc_k = self._sincos(position_ids)
        sc_q = self._sincos(pos_q)
        allowed = torch.ones(S, S, dtype=torch.bool).tril()[None, None] & attention_mask.bool()[:, None, None, :]
        amask = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)
        h = self.wte[input_ids]
        _rec("transformer.wte", h)
        for blk in self.blocks:
            p = f"transformer.h.{blk.idx}."
            x = _ln(h, blk.ln_w, blk.ln_b, self.eps)
            _rec(p + "ln_1", x)
            a = self._attn(blk, x, amask, sc_q, sc_k, p + "attn.")
            xm = _ln(x, blk.ln_w, blk.ln_b, self.eps) if b == "cg_mlp_double_ln" else x
            f1 = xm @ blk.fc1_w + blk.fc1_b
            _rec(p + "mlp.fc_in", f1)
            if b == "cg_act_after_fc_out":
                f2 = _gelu_new(f1 @ blk.fc2_w + blk.fc2_b)
            else:
                f2 = _gelu_new(f1) @ blk.fc2_w + blk.fc2_b
            _rec(p + "mlp.fc_out", f2)
            _rec(p + "mlp", f2)
            h = a + f2 + h
            _rec(p.rstrip("."), h)
        h = _ln(h, self.lnf_w, self.lnf_b, self.eps)
        _rec("transformer.ln_f", h)
        logits = h @ self.head_w + self.head_b
        _rec("lm_head", logits)
        return logits.float()


def build(state_dict, config):
    return CodeGenPort(state_dict, config).eval()
