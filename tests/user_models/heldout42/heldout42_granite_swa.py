"""Hand-written plain-PyTorch port of IBM's Granite-SWA (GraniteSWAForCausalLM, model_type granite_swa).

Architecture as this port implements it (all float32):
- x0 = E[ids] * embedding_multiplier  (E: token embedding, scaled once, before the first layer).
- per layer l (pre-norm, Granite residual multiplier m = residual_multiplier):
      h = RMS(x; g_attn)                       RMS(x; g) = g * x / sqrt(mean(x**2, last axis) + rms_norm_eps)
      q, k, v = h Wq + bq, h Wk + bk, h Wv + bv  (4 query heads, 2 KV heads, head_dim = hidden / heads = 16)
      q, k <- RoPE(q, k; theta_l, position_ids)  only when layer_rope_theta[l] != 0 (theta 0 means NoPE);
              rotate-half convention: the pair (i, i + d/2) is rotated by pos * theta_l ** (-2i/d)
      s = (q k^T) * attention_multiplier        (the scale replaces 1/sqrt(head_dim); KV head j serves query
                                                 heads j*G .. j*G+G-1, G = heads / kv_heads)
      mask: causal; a sliding layer (layer_types[l] == "sliding_attention") keeps the keys
            q_idx - sliding_window < k_idx <= q_idx (sliding_window keys, itself included);
            left padding removes the padded keys (attention_mask == 0). Masked scores are set to float32 min.
      a = softmax(s) v * sigmoid(logsumexp(s) - sink_head)
            the learned per-head sink is an extra logit in the softmax denominator:
            exp(s_j) / (sum_i exp(s_i) + exp(sink)); logsumexp is taken over the MASKED scores.
      x = x + m * (a Wo + bo)
      h = RMS(x; g_mlp)
      x = x + m * ((silu(h Wg + bg) * (h Wu + bu)) Wd + bd)
- logits = RMS(x; g_final) E^T / logits_scaling   (head tied to the embedding; an untied head is supported).
- RoPE bases per layer come from config.layer_rope_theta; the global rope_parameters["rope_theta"] is not
  used by any layer when that list is given.

Weight layout of this port (own names, built at load by `build`):
- `tok_emb` (V, H): embedding, also the output head (tied; `head_t` (H, V) exists only when untied).
- `final_gain` (H,): final RMSNorm gain.
- `sink_table` (L, heads): every layer's sinks stacked into one parameter on the top module.
- `inv_freq` (L, head_dim / 2) buffer: per-layer RoPE inverse frequencies (zeros for a NoPE layer) and
  `rope_on` (list of bools) saying which layers rotate.
- per layer `layers[l]` (a `GraniteSWABlock`):
    `gains` (2, H): rows [attention-input RMSNorm gain, MLP-input RMSNorm gain] stacked;
    `w_qkv` (H, Dq + 2 Dkv): q, k, v projections fused [q | k | v] and stored transposed (in, out);
    `b_qkv` (Dq + 2 Dkv,): the three biases fused the same way;
    `w_out` (Dq, H) transposed o_proj, `b_out` (H,);
    `w_gate_up` (H, 2 I): gate and up fused [gate | up], transposed; `b_gate_up` (2 I,);
    `w_down` (I, H) transposed, `b_down` (H,).
"""

import os

import torch
import torch.nn as nn
import torch.nn.functional as F

BUG = os.environ.get("BUG", "")

BUGS = [
    "emb_mult_missing",  # embedding_multiplier never applied: x0 = E[ids] instead of E[ids] * embedding_multiplier
    "logits_scale_inverted",  # logits multiplied by logits_scaling instead of divided by it
    "attn_scale_doubled",  # scores scaled by attention_multiplier AND 1/sqrt(head_dim) (Llama scale kept as well)
    "residual_mult_whole_sum",  # residual multiplier applied to the sum: x = m * (x + branch) instead of x + m * branch
    "sink_sign_flipped",  # sink gate sigmoid(sink - lse) instead of sigmoid(lse - sink)
    "sink_lse_unmasked",  # logsumexp for the sink gate taken over the scores before the causal/window mask
    "swa_off_by_one",  # sliding window keeps sliding_window + 1 keys (k_idx >= q_idx - window instead of >)
    "layer_types_default_pattern",  # config.layer_types ignored: full attention at i % 4 == 0, sliding elsewhere
    "nope_theta_zero_as_default",  # layer_rope_theta 0 read as "unset": NoPE layers get RoPE at the global rope_theta
    "rope_interleaved",  # RoPE rotates adjacent pairs (2i, 2i+1) (GPT-J layout) instead of halves (i, i + d/2)
    "gqa_tiled",  # KV heads expanded with repeat (tile: [0,1,0,1]) instead of repeat_interleave ([0,0,1,1])
    "qkv_split_kv_swapped",  # fused [q | k | v] output split as [q | v | k]: keys and values swapped
    "norm_weight_plus_one",  # RMSNorm gains converted Gemma-style as 1 + w at load (all norms, final included)
    "pad_mask_ignored",  # the attention_mask (left padding) is dropped: padded keys stay visible (only causal/window)
]
PADDING_ONLY = ["pad_mask_ignored"]
CLEAN = [
    "sink_as_extra_logit",  # sink appended as an extra score column, softmax, column dropped (GPT-OSS form)
    "rope_complex",  # RoPE as a complex product (x_i + i x_{i+d/2}) * exp(i pos theta_i)
    "residual_folded",  # residual_multiplier folded into w_out/b_out and w_down/b_down at load; plain residual adds
    "swa_chunked",  # attention in query chunks of 4, each against only its reachable key slice (window start .. end)
    "gqa_grouped",  # no KV repeat: queries viewed as (kv_heads, group) and broadcast against their KV head
]


def _rms_norm(x, gain, eps):
    var = x.pow(2).mean(-1, keepdim=True)
    return gain * (x * torch.rsqrt(var + eps))


def _linear(x, w_t, b=None):
    y = x @ w_t
    return y if b is None else y + b


def _embed(ids, table):
    return F.embedding(ids, table)


def _rope_tables(inv_freq, position_ids):
    freqs = position_ids[..., None].float() * inv_freq  # (B, T, d/2)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def _apply_rope(x, cos, sin):
    """x (B, heads, T, d); cos/sin (B, T, d) in the rotate-half layout [f | f]."""
    cos, sin = cos[:, None], sin[:, None]
    half = x.shape[-1] // 2
    if BUG == "rope_interleaved":
        c, s = cos[..., :half], sin[..., :half]
        xe, xo = x[..., 0::2], x[..., 1::2]
        return torch.stack([xe * c - xo * s, xo * c + xe * s], dim=-1).flatten(-2)
    if BUG == "rope_complex":
        z = torch.complex(x[..., :half], x[..., half:])
        rot = torch.complex(cos[..., :half], sin[..., :half])
        z = z * rot
        return torch.cat([z.real, z.imag], dim=-1)
    x1, x2 = x[..., :half], x[..., half:]
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def _attend(q, k, v, allowed, sink, scale):
    """Scores over the last two axes; `allowed` broadcasts to the scores, `sink` to the logsumexp."""
    scores = (q @ k.transpose(-1, -2)) * scale
    masked = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
    if BUG == "sink_as_extra_logit":
        col = sink[..., None].expand(*masked.shape[:-1], 1)
        probs = torch.softmax(torch.cat([masked, col], dim=-1), dim=-1)[..., :-1]
        return probs @ v
    lse = torch.logsumexp(scores if BUG == "sink_lse_unmasked" else masked, dim=-1)
    gate = torch.sigmoid(sink - lse) if BUG == "sink_sign_flipped" else torch.sigmoid(lse - sink)
    probs = torch.softmax(masked, dim=-1)
    return (probs @ v) * gate[..., None]


class GraniteSWABlock(nn.Module):
    def __init__(self, hidden, inter, n_heads, n_kv, head_dim, bias, mlp_bias):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = n_heads, n_kv, head_dim
        dq, dkv = n_heads * head_dim, n_kv * head_dim
        self.gains = nn.Parameter(torch.ones(2, hidden))
        self.w_qkv = nn.Parameter(torch.zeros(hidden, dq + 2 * dkv))
        self.b_qkv = nn.Parameter(torch.zeros(dq + 2 * dkv)) if bias else None
        self.w_out = nn.Parameter(torch.zeros(dq, hidden))
        self.b_out = nn.Parameter(torch.zeros(hidden)) if bias else None
        self.w_gate_up = nn.Parameter(torch.zeros(hidden, 2 * inter))
        self.b_gate_up = nn.Parameter(torch.zeros(2 * inter)) if mlp_bias else None
        self.w_down = nn.Parameter(torch.zeros(inter, hidden))
        self.b_down = nn.Parameter(torch.zeros(hidden)) if mlp_bias else None

    def attention(self, h, rope, allowed, sink, scale, window):
        B, T, _ = h.shape
        dq, dkv = self.n_heads * self.head_dim, self.n_kv * self.head_dim
        qkv = _linear(h, self.w_qkv, self.b_qkv)
        if BUG == "qkv_split_kv_swapped":
            q, v, k = qkv.split([dq, dkv, dkv], dim=-1)
        else:
            q, k, v = qkv.split([dq, dkv, dkv], dim=-1)
        q = q.view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        k = k.view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
        v = v.view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
        if rope is not None:
            q, k = _apply_rope(q, *rope), _apply_rope(k, *rope)
        groups = self.n_heads // self.n_kv
        if BUG == "gqa_grouped":
            qg = q.view(B, self.n_kv, groups, T, self.head_dim)
            out = _attend(
                qg, k[:, :, None], v[:, :, None], allowed[:, None, None], sink.view(self.n_kv, groups, 1), scale
            )
            out = out.reshape(B, self.n_heads, T, self.head_dim)
        else:
            if BUG == "gqa_tiled":
                k, v = k.repeat(1, groups, 1, 1), v.repeat(1, groups, 1, 1)
            else:
                k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
            sink_h = sink.view(self.n_heads, 1)
            if BUG == "swa_chunked":
                parts = []
                for s in range(0, T, 4):
                    e = min(T, s + 4)
                    k0 = max(0, s - window + 1) if window else 0
                    parts.append(
                        _attend(q[:, :, s:e], k[:, :, k0:e], v[:, :, k0:e], allowed[:, None, s:e, k0:e], sink_h, scale)
                    )
                out = torch.cat(parts, dim=2)
            else:
                out = _attend(q, k, v, allowed[:, None], sink_h, scale)
        out = out.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim)
        return _linear(out, self.w_out, self.b_out)

    def mlp(self, h):
        gate, up = _linear(h, self.w_gate_up, self.b_gate_up).chunk(2, dim=-1)
        return _linear(F.silu(gate) * up, self.w_down, self.b_down)

    def forward(self, x, rope, allowed, sink, scale, window, eps, resid_mult):
        a = self.attention(_rms_norm(x, self.gains[0], eps), rope, allowed, sink, scale, window)
        x = (x + a) * resid_mult if BUG == "residual_mult_whole_sum" else x + a * resid_mult
        f = self.mlp(_rms_norm(x, self.gains[1], eps))
        x = (x + f) * resid_mult if BUG == "residual_mult_whole_sum" else x + f * resid_mult
        return x


class GraniteSWAPort(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        H, L = cfg["hidden"], cfg["layers"]
        self.tok_emb = nn.Parameter(torch.zeros(cfg["vocab"], H))
        self.head_t = None if cfg["tied"] else nn.Parameter(torch.zeros(H, cfg["vocab"]))
        self.final_gain = nn.Parameter(torch.ones(H))
        self.sink_table = nn.Parameter(torch.zeros(L, cfg["heads"]))
        self.layers = nn.ModuleList(
            GraniteSWABlock(
                H, cfg["inter"], cfg["heads"], cfg["kv_heads"], cfg["head_dim"], cfg["bias"], cfg["mlp_bias"]
            )
            for _ in range(L)
        )
        d = cfg["head_dim"]
        inv, on = [], []
        for theta in cfg["thetas"]:
            if not theta and BUG == "nope_theta_zero_as_default":
                theta = cfg["global_theta"]
            on.append(bool(theta))
            inv.append(
                1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float) / d)) if theta else torch.zeros(d // 2)
            )
        self.register_buffer("inv_freq", torch.stack(inv), persistent=False)
        self.rope_on = on

    def _layer_kinds(self):
        if BUG == "layer_types_default_pattern":
            return ["full_attention" if i % 4 == 0 else "sliding_attention" for i in range(self.cfg["layers"])]
        return self.cfg["layer_types"]

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        cfg = self.cfg
        B, T = input_ids.shape
        dev = input_ids.device
        x = _embed(input_ids, self.tok_emb)
        if BUG != "emb_mult_missing":
            x = x * cfg["emb_mult"]
        if position_ids is None:
            position_ids = torch.arange(T, device=dev)[None].expand(B, T)

        idx = torch.arange(T, device=dev)
        causal = idx[None, :] <= idx[:, None]  # (q, k)
        w = cfg["window"]
        if BUG == "swa_off_by_one":
            in_window = idx[None, :] >= idx[:, None] - w
        else:
            in_window = idx[None, :] > idx[:, None] - w
        if attention_mask is None or BUG == "pad_mask_ignored":
            keys = torch.ones(B, T, dtype=torch.bool, device=dev)
        else:
            keys = attention_mask.to(torch.bool)
        allowed = {
            "full_attention": causal[None] & keys[:, None, :],
            "sliding_attention": (causal & in_window)[None] & keys[:, None, :],
        }

        tables = {}
        resid = 1.0 if BUG == "residual_folded" else cfg["resid_mult"]
        scale = cfg["attn_mult"]
        if BUG == "attn_scale_doubled":
            scale = scale * cfg["head_dim"] ** -0.5
        for i, (layer, kind) in enumerate(zip(self.layers, self._layer_kinds())):
            rope = None
            if self.rope_on[i]:
                key = tuple(self.inv_freq[i].tolist())
                if key not in tables:
                    tables[key] = _rope_tables(self.inv_freq[i], position_ids)
                rope = tables[key]
            window = w if kind == "sliding_attention" else None
            x = layer(x, rope, allowed[kind], self.sink_table[i], scale, window, cfg["eps"], resid)

        x = _rms_norm(x, self.final_gain, cfg["eps"])
        head_t = self.tok_emb.t() if self.head_t is None else self.head_t
        logits = _linear(x, head_t)
        if BUG == "logits_scale_inverted":
            return logits * cfg["logits_scaling"]
        return logits / cfg["logits_scaling"]


@torch.no_grad()
def build(state_dict, config):
    """Convert Transformers' GraniteSWA tensors (their names) into this port's layout."""
    sd = {k: v.detach().float() for k, v in state_dict.items()}
    H, nh, nkv = config.hidden_size, config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or H // nh
    L = config.num_hidden_layers
    assert config.hidden_act == "silu"
    thetas = config.layer_rope_theta
    if thetas is None:
        thetas = [config.rope_parameters["rope_theta"]] * L
    tied = bool(getattr(config, "tie_word_embeddings", True)) or "lm_head.weight" not in sd
    cfg = dict(
        vocab=config.vocab_size,
        hidden=H,
        layers=L,
        heads=nh,
        kv_heads=nkv,
        head_dim=head_dim,
        inter=config.intermediate_size,
        bias=bool(config.attention_bias),
        mlp_bias=bool(config.mlp_bias),
        tied=tied,
        thetas=list(thetas),
        global_theta=config.rope_parameters["rope_theta"],
        layer_types=list(config.layer_types),
        window=config.sliding_window,
        emb_mult=float(config.embedding_multiplier),
        resid_mult=float(config.residual_multiplier),
        attn_mult=float(config.attention_multiplier),
        logits_scaling=float(config.logits_scaling),
        eps=float(config.rms_norm_eps),
    )
    model = GraniteSWAPort(cfg)

    def gain(w):
        return 1.0 + w if BUG == "norm_weight_plus_one" else w

    fold = cfg["resid_mult"] if BUG == "residual_folded" else 1.0

    model.tok_emb.copy_(sd["model.embed_tokens.weight"])
    if not tied:
        model.head_t.copy_(sd["lm_head.weight"].t())
    model.final_gain.copy_(gain(sd["model.norm.weight"]))
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        a, m = p + "self_attn.", p + "mlp."
        model.sink_table[i].copy_(sd[a + "sinks"])
        layer.gains.copy_(
            torch.stack([gain(sd[p + "input_layernorm.weight"]), gain(sd[p + "post_attention_layernorm.weight"])])
        )
        layer.w_qkv.copy_(torch.cat([sd[a + "q_proj.weight"], sd[a + "k_proj.weight"], sd[a + "v_proj.weight"]]).t())
        layer.w_out.copy_(sd[a + "o_proj.weight"].t() * fold)
        if cfg["bias"]:
            layer.b_qkv.copy_(torch.cat([sd[a + "q_proj.bias"], sd[a + "k_proj.bias"], sd[a + "v_proj.bias"]]))
            layer.b_out.copy_(sd[a + "o_proj.bias"] * fold)
        layer.w_gate_up.copy_(torch.cat([sd[m + "gate_proj.weight"], sd[m + "up_proj.weight"]]).t())
        layer.w_down.copy_(sd[m + "down_proj.weight"].t() * fold)
        if cfg["mlp_bias"]:
            layer.b_gate_up.copy_(torch.cat([sd[m + "gate_proj.bias"], sd[m + "up_proj.bias"]]))
            layer.b_down.copy_(sd[m + "down_proj.bias"] * fold)
    return model.eval()
