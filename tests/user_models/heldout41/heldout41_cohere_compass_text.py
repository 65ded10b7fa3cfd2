"""Hand-written plain-PyTorch port of Cohere Compass's text decoder (CohereCompassForCausalLM, model_type
cohere_compass_text: the "North" text tower, a Cohere2-style parallel-block decoder with per-layer-type RoPE).

Architecture as this port implements it (float32 throughout):
- h0 = E[input_ids] (no embedding scale).  The head is tied: logits = logit_scale * (LN_f(h_L) @ E^T), with
  logit_scale = config.logit_scale (1.0 when None), applied AFTER the head matmul.
- LayerNorm without bias, as Cohere writes it: LN(x) = w * (x - mean(x)) / sqrt(var(x) + eps), biased variance
  (mean of squared deviations) over the hidden axis, eps = config.layer_norm_eps; computed in float32.
- Block i (parallel, ONE norm per block, no post-attention norm):
      a = LN_i(h);   h <- h + Attn_i(a) + MLP_i(a)
  MLP(a) = W_down (silu(W_gate a) * (W_up a)).
- Attention: q = W_q a + b_q, k = W_k a + b_k, v = W_v a + b_v (biases iff config.attention_bias), n_heads query
  heads and n_kv heads of head_dim = hidden / n_heads; grouped-query: query head j uses kv head j // (n_heads / n_kv)
  (repeat_interleave).  scores = q k^T / sqrt(head_dim) + mask, softmax in float32, out = W_o concat(heads) + b_o.
- Layer types: config.layer_types[i] is "sliding_attention" or "full_attention" (the list is authoritative, not the
  legacy every-4th-layer pattern).  Mask, by token INDEX (not position id): causal k <= q; sliding layers also
  need k > q - W (W = config.sliding_window, so W tokens including the current one); padding keys
  (attention_mask == 0) are masked.  Masked scores are set to finfo.min (a fully masked padding query row then
  gives a finite uniform softmax, never NaN).
- RoPE per layer type: config.rope_parameters[layer_type]; None means NoPE (no rotation at all on that layer
  type).  Rotation is the half-split (NeoX / Qwen3) kind, NOT Cohere's interleaved one:
      rot(x) = x * cos + rotate_half(x) * sin,  rotate_half([x1, x2]) = [-x2, x1]  (halves of head_dim),
      cos = cat(cos(theta), cos(theta)) * attention_factor, theta[p, j] = pos_p * inv_freq_j (float32).
  inv_freq: "default" -> base^(-2j/d); "yarn" -> blend of base^(-2j/d) (extrapolation) and base^(-2j/d)/factor
  (interpolation) with a linear ramp between the truncated correction dims of beta_fast=32 / beta_slow=1 over
  original_max_position_embeddings; attention_factor = 0.1 ln(factor) + 1 (or the given one).  Positions are
  the given position_ids (B, S) or arange(S).  (Transformers' M-RoPE recomposition is the identity for text, all
  three axes carrying the same positions, so it is not implemented.)

Weight layout of this port (own names, built at load time from Transformers' tensors):
- tok_emb (V, H): embedding, also the (tied) head.
- norm_w (L + 1, H): the L block-norm weights stacked, row L = the final norm weight.
- blocks[i].w_qkv_t (H, Q + 2K): [q | k | v] fused and transposed;  blocks[i].b_qkv (Q + 2K,) fused biases
  (zeros when the config has no attention bias).
- blocks[i].w_out_t (Q, H): o_proj transposed;  blocks[i].b_out (H,).
- blocks[i].w_gate_up (2I, H): [gate; up] stacked on the output axis;  blocks[i].w_down (H, I) as stored.
- rope_inv_freq_<layer_type> buffers (head_dim / 2,) precomputed from the config, and self.rope_factor, a
  dict {layer_type: attention_factor or None (NoPE)}.
"""

import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

BUG = os.environ.get("BUG", "")

BUGS = [
    "cc_sequential_block",  # Llama-style sequential block: h += attn(LN(h)); h += mlp(LN(h)) (norm reused), not parallel
    "cc_rmsnorm",  # the bias-free LayerNorm written as an RMSNorm: no mean subtraction, x / sqrt(mean(x^2) + eps)
    "cc_rope_interleaved",  # Cohere/Command-R rotary kept: pairs (2j, 2j+1) rotated instead of the half-split (j, j+d/2)
    "cc_rope_on_nope_layers",  # rope_parameters["full_attention"] = None ignored: the sliding layers' RoPE applied on full layers too
    "cc_yarn_factor_dropped",  # YaRN attention_factor (0.1 ln(factor) + 1) not multiplied into cos / sin
    "cc_logit_scale_dropped",  # config.logit_scale never applied to the logits
    "cc_window_off_by_one",  # sliding mask keeps k >= q - W (W + 1 tokens) instead of k > q - W
    "cc_legacy_layer_pattern",  # layer types from the legacy sliding_window_pattern=4 rule ((i+1) % 4 -> sliding), not layer_types
    "cc_gqa_tiled",  # kv heads expanded with repeat (tile: head j uses kv j % n_kv) instead of repeat_interleave (j // group)
    "cc_ln_eps_hardcoded",  # LayerNorm eps hard-coded to 1e-5 instead of config.layer_norm_eps
    "cc_attn_bias_dropped",  # config.attention_bias ignored at load: q/k/v/o biases never loaded (zeros)
    "cc_gate_up_swapped",  # fused [gate; up] weight split as [up; gate]: silu applied to the up projection
    "cc_rope_angles_bf16",  # rotary angles pos * inv_freq computed in bfloat16 (autocast-style) before cos / sin
    "cc_pad_mask_ignored",  # attention_mask dropped: causal / sliding mask only, padding keys attended
]
PADDING_ONLY = ["cc_pad_mask_ignored"]
CLEAN = [
    "cc_clean_split_qkv",  # q, k, v as three matmuls on slices of the fused weight instead of one fused matmul
    "cc_clean_one_input_matmul",  # parallel block: [qkv | gate | up] from LN(h) in ONE matmul, split afterwards
    "cc_clean_sdpa",  # F.scaled_dot_product_attention with a boolean mask (padding queries may see themselves)
    "cc_clean_rope_complex",  # RoPE as complex multiplication of (x_j + i x_{j+d/2}) by attention_factor * e^{i theta}
    "cc_clean_logit_scale_in_norm",  # logit_scale folded into the final norm weight instead of scaling the logits
]


def _bug(name):
    return BUG == name


def _inv_freq(params, head_dim):
    """(inv_freq, attention_factor) of one layer type's rope parameters (default or YaRN)."""
    base = float(params["rope_theta"])
    dim = head_dim
    exps = torch.arange(0, dim, 2, dtype=torch.float32) / dim
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        return 1.0 / (base**exps), 1.0
    if rope_type != "yarn":
        raise NotImplementedError(rope_type)
    factor = float(params["factor"])
    orig = params["original_max_position_embeddings"]
    att = params.get("attention_factor")
    if att is None:
        mscale, mscale_all = params.get("mscale"), params.get("mscale_all_dim")

        def ms(s, m=1.0):
            return 1.0 if s <= 1 else 0.1 * m * math.log(s) + 1.0

        att = ms(factor, mscale) / ms(factor, mscale_all) if (mscale and mscale_all) else ms(factor)
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def corr_dim(rot):
        return (dim * math.log(orig / (rot * 2 * math.pi))) / (2 * math.log(base))

    low, high = corr_dim(beta_fast), corr_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base**exps
    extrap = 1.0 - ramp  # weight of the extrapolated (unscaled) frequency
    inv = (1.0 / (factor * pos_freqs)) * (1 - extrap) + (1.0 / pos_freqs) * extrap
    return inv, float(att)


def _rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


class Block(nn.Module):
    def __init__(self, sd, p, cfg):
        super().__init__()
        q, k, v = (sd[f"{p}.self_attn.{n}_proj.weight"] for n in "qkv")
        self.w_qkv_t = nn.Parameter(torch.cat([q, k, v], 0).t().contiguous())
        if cfg.attention_bias and not _bug("cc_attn_bias_dropped"):
            b = torch.cat([sd[f"{p}.self_attn.{n}_proj.bias"] for n in "qkv"])
            bo = sd[f"{p}.self_attn.o_proj.bias"]
        else:
            b = torch.zeros(self.w_qkv_t.shape[1])
            bo = torch.zeros(cfg.hidden_size)
        self.b_qkv = nn.Parameter(b.clone())
        self.w_out_t = nn.Parameter(sd[f"{p}.self_attn.o_proj.weight"].t().contiguous())
        self.b_out = nn.Parameter(bo.clone())
        self.w_gate_up = nn.Parameter(torch.cat([sd[f"{p}.mlp.gate_proj.weight"], sd[f"{p}.mlp.up_proj.weight"]], 0))
        self.w_down = nn.Parameter(sd[f"{p}.mlp.down_proj.weight"].clone())


class CompassText(nn.Module):
    def __init__(self, sd, cfg):
        super().__init__()
        self.cfg = cfg
        self.n_layers = cfg.num_hidden_layers
        self.n_heads = cfg.num_attention_heads
        self.n_kv = cfg.num_key_value_heads
        self.head_dim = cfg.hidden_size // cfg.num_attention_heads
        self.inter = cfg.intermediate_size
        self.window = cfg.sliding_window
        self.eps = 1e-5 if _bug("cc_ln_eps_hardcoded") else cfg.layer_norm_eps
        self.logit_scale = 1.0 if cfg.logit_scale is None else float(cfg.logit_scale)
        if _bug("cc_legacy_layer_pattern"):
            self.layer_types = ["sliding_attention" if (i + 1) % 4 else "full_attention" for i in range(self.n_layers)]
        else:
            self.layer_types = list(cfg.layer_types)
        self.tok_emb = nn.Parameter(sd["model.embed_tokens.weight"].clone())
        norms = [sd[f"model.layers.{i}.input_layernorm.weight"] for i in range(self.n_layers)]
        self.norm_w = nn.Parameter(torch.stack(norms + [sd["model.norm.weight"]]))
        self.blocks = nn.ModuleList(Block(sd, f"model.layers.{i}", cfg) for i in range(self.n_layers))
        self.rope_factor = {}
        rp = cfg.rope_parameters
        rope_types = [lt for lt in dict.fromkeys(cfg.layer_types) if rp.get(lt) is not None]
        for lt in dict.fromkeys(self.layer_types):
            params = rp.get(lt)
            if params is None and _bug("cc_rope_on_nope_layers") and rope_types:
                params = rp[rope_types[0]]  # "one rotary embedding for the whole model"
            if params is None:
                self.rope_factor[lt] = None
                continue
            inv, att = _inv_freq(params, self.head_dim)
            self.register_buffer(f"rope_inv_freq_{lt}", inv, persistent=False)
            self.rope_factor[lt] = 1.0 if _bug("cc_yarn_factor_dropped") else att
        self.taps = None  # a dict to record intermediates (debugging), else None

    def _tap(self, name, value):
        if self.taps is not None:
            self.taps[name] = value.detach().clone()

    def _norm(self, x, w):
        x = x.float()
        if _bug("cc_rmsnorm"):
            return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))
        mu = x.mean(-1, keepdim=True)
        var = (x - mu).pow(2).mean(-1, keepdim=True)
        return w * ((x - mu) * torch.rsqrt(var + self.eps))

    def _rope_tables(self, lt, pos):
        att = self.rope_factor[lt]
        if att is None:
            return None
        inv = getattr(self, f"rope_inv_freq_{lt}")
        if _bug("cc_rope_angles_bf16"):
            theta = (pos[..., None].to(torch.bfloat16) * inv.to(torch.bfloat16)).float()
        else:
            theta = pos[..., None].float() * inv
        return theta, att

    def _apply_rope(self, x, tables):
        theta, att = tables  # theta (B, S, d/2); x (B, h, S, d)
        theta = theta[:, None]
        if BUG == "cc_clean_rope_complex":
            h = x.shape[-1] // 2
            z = torch.complex(x[..., :h], x[..., h:]) * torch.polar(torch.full_like(theta, att), theta)
            return torch.cat([z.real, z.imag], -1)
        if _bug("cc_rope_interleaved"):
            c, s = theta.cos() * att, theta.sin() * att
            xe, xo = x[..., 0::2], x[..., 1::2]
            return torch.stack([xe * c - xo * s, xo * c + xe * s], -1).flatten(-2)
        cos = torch.cat([theta.cos(), theta.cos()], -1) * att
        sin = torch.cat([theta.sin(), theta.sin()], -1) * att
        return x * cos + _rotate_half(x) * sin

    def _mask(self, B, S, attention_mask, sliding, device):
        i = torch.arange(S, device=device)
        q, k = i[:, None], i[None, :]
        allowed = k <= q
        if sliding:
            allowed = allowed & ((k >= q - self.window) if _bug("cc_window_off_by_one") else (k > q - self.window))
        allowed = allowed[None, None].expand(B, 1, S, S)
        if attention_mask is not None and not _bug("cc_pad_mask_ignored"):
            allowed = allowed & attention_mask.bool()[:, None, None, :]
        return allowed

    def _attention(self, q, k, v, allowed):
        g = self.n_heads // self.n_kv
        if _bug("cc_gqa_tiled"):
            k, v = k.repeat(1, g, 1, 1), v.repeat(1, g, 1, 1)
        else:
            k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
        if BUG == "cc_clean_sdpa":
            S = q.shape[2]
            eye = torch.eye(S, dtype=torch.bool, device=q.device)[None, None]
            return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed | eye)
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(self.head_dim)
        scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
        return torch.softmax(scores.float(), -1) @ v

    def _attn_mlp_inputs(self, blk, a):
        Q, K = self.n_heads * self.head_dim, self.n_kv * self.head_dim
        if BUG == "cc_clean_split_qkv":
            w, b = blk.w_qkv_t, blk.b_qkv
            q = a @ w[:, :Q] + b[:Q]
            k = a @ w[:, Q : Q + K] + b[Q : Q + K]
            v = a @ w[:, Q + K :] + b[Q + K :]
            return q, k, v, None
        if BUG == "cc_clean_one_input_matmul":
            w = torch.cat([blk.w_qkv_t, blk.w_gate_up.t()], 1)
            b = torch.cat([blk.b_qkv, blk.b_qkv.new_zeros(2 * self.inter)])
            y = a @ w + b
            q, k, v, gu = y.split([Q, K, K, 2 * self.inter], -1)
            return q, k, v, gu
        q, k, v = (a @ blk.w_qkv_t + blk.b_qkv).split([Q, K, K], -1)
        return q, k, v, None

    def _mlp(self, i, blk, a, gu=None):
        if gu is None:
            gu = a @ blk.w_gate_up.t()
        if _bug("cc_gate_up_swapped"):
            up, gate = gu.split(self.inter, -1)
        else:
            gate, up = gu.split(self.inter, -1)
        self._tap(f"blk{i}.gate", gate)
        self._tap(f"blk{i}.up", up)
        act = F.silu(gate)
        self._tap(f"blk{i}.act", act)
        out = (act * up) @ blk.w_down.t()
        self._tap(f"blk{i}.mlp", out)
        return out

    def _attn(self, i, blk, a, tables, allowed):
        B, S, _ = a.shape
        q, k, v, gu = self._attn_mlp_inputs(blk, a)
        self._tap(f"blk{i}.q", q)
        self._tap(f"blk{i}.k", k)
        self._tap(f"blk{i}.v", v)
        d = self.head_dim
        q = q.view(B, S, self.n_heads, d).transpose(1, 2)
        k = k.view(B, S, self.n_kv, d).transpose(1, 2)
        v = v.view(B, S, self.n_kv, d).transpose(1, 2)
        if tables is not None:
            q, k = self._apply_rope(q, tables), self._apply_rope(k, tables)
        o = self._attention(q, k, v, allowed).transpose(1, 2).reshape(B, S, -1)
        out = o @ blk.w_out_t + blk.b_out
        self._tap(f"blk{i}.attn", out)
        return out, gu

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        B, S = input_ids.shape
        dev = input_ids.device
        h = self.tok_emb[input_ids]
        self._tap("emb", h)
        if position_ids is None:
            position_ids = torch.arange(S, device=dev)[None].expand(B, S)
        tables = {}
        for lt in dict.fromkeys(self.layer_types):
            tables[lt] = self._rope_tables(lt, position_ids)
            if tables[lt] is not None:
                theta, att = tables[lt]
                self._tap(f"rope.{lt}.cos", torch.cat([theta.cos(), theta.cos()], -1) * att)
                self._tap(f"rope.{lt}.sin", torch.cat([theta.sin(), theta.sin()], -1) * att)
        masks = {
            lt: self._mask(B, S, attention_mask, lt == "sliding_attention", dev)
            for lt in dict.fromkeys(self.layer_types)
        }
        for i, blk in enumerate(self.blocks):
            lt = self.layer_types[i]
            a = self._norm(h, self.norm_w[i])
            self._tap(f"blk{i}.norm", a)
            attn, gu = self._attn(i, blk, a, tables[lt], masks[lt])
            if _bug("cc_sequential_block"):
                h = h + attn
                h = h + self._mlp(i, blk, self._norm(h, self.norm_w[i]))
            else:
                h = h + attn + self._mlp(i, blk, a, gu)
            self._tap(f"blk{i}.out", h)
        if BUG == "cc_clean_logit_scale_in_norm":
            hf = self._norm(h, self.norm_w[-1] * self.logit_scale)
            self._tap("final_norm", hf / self.logit_scale)
            logits = hf @ self.tok_emb.t()
            self._tap("head", logits / self.logit_scale)
        else:
            hf = self._norm(h, self.norm_w[-1])
            self._tap("final_norm", hf)
            logits = hf @ self.tok_emb.t()
            self._tap("head", logits)
            if not _bug("cc_logit_scale_dropped"):
                logits = logits * self.logit_scale
        self._tap("logits", logits)
        return logits.float()


def build(state_dict, config):
    with torch.no_grad():
        model = CompassText(state_dict, config)
    return model.eval()
