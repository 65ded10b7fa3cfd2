"""A from-scratch PyTorch port of Mamba (selective state-space LM, ``MambaForCausalLM``).

Architecture (H = hidden_size, I = expand * H, N = state_size, R = time_step_rank, K = conv_kernel,
L = num_hidden_layers, V = vocab_size; tensors are kept channel-last, ``(batch, T, channels)``):

    h_0 = E[input_ids]                                                  (B, T, H)
    for each layer l:
        u    = RMSNorm(h) = h * rsqrt(mean(h^2, -1) + eps) * g_l         eps = config.layer_norm_epsilon
        u    = u * m                                                     m = attention_mask (0 at padding)
        x, z = u @ W_in[:, :I] (+b), u @ W_in[:, I:] (+b)                (B, T, I) each
        x    = SiLU(causal depthwise conv_K(x) + b_conv)                 x'_t,c = sum_k w[k, c] x_{t-K+1+k, c}
        x    = x * m                                                     (keeps padding out of the state)
        [dt_r | B | C] = x @ W_xdbc                                      (B, T, R), (B, T, N), (B, T, N)
        dt   = softplus(dt_r @ W_dt + b_dt)                              (B, T, I)
        A    = -exp(A_log)                                               (I, N)
        S_t  = exp(dt_t * A) * S_{t-1} + (dt_t * B_t) * x_t              S: (B, I, N), S_{-1} = 0
        y_t  = S_t . C_t + D * x_t                                       (B, T, I)
        y    = y * SiLU(z)
        h    = h + y @ W_out (+b)                                        residual kept in float32
    logits = RMSNorm_f(h) @ E^T                                          (tied head; untied if given)

Position ids are accepted and ignored (Mamba has no positional encoding).

Weight layout (all per-layer tensors are STACKED along a leading layer axis, matrices stored in -> out):
    tok_emb  (V, H)          backbone.embeddings.weight
    head     (V, H)          only when the checkpoint's lm_head is not tied to the embedding
    norm_g   (L, H)          layers.l.norm.weight
    w_in     (L, H, 2I)      layers.l.mixer.in_proj.weight^T   (columns: [x | z])
    b_in     (L, 2I)         in_proj.bias (zeros when use_bias is False)
    conv_k   (L, K, I)       conv1d.weight (I, 1, K) -> squeeze -> transpose: tap-major
    conv_b   (L, I)          conv1d.bias (zeros when use_conv_bias is False)
    w_xdbc   (L, I, R+2N)    x_proj.weight^T                    (columns: [dt | B | C])
    w_dt     (L, R, I)       dt_proj.weight^T
    b_dt     (L, I)          dt_proj.bias
    a_log    (L, N, I)       A_log^T                            (state-major)
    d_skip   (L, I)          D
    w_out    (L, I, H)       out_proj.weight^T
    b_out    (L, H)          out_proj.bias (zeros when use_bias is False)
    norm_f   (H,)            backbone.norm_f.weight
"""

import os

import torch
import torch.nn as nn
import torch.nn.functional as F

BUG = os.environ.get("BUG", "")

BUGS = [
    "a_missing_exp",  # A taken as -A_log (the checkpoint's log-parameterisation not exponentiated)
    "dt_bias_after_softplus",  # dt = softplus(dt_r @ W_dt) + b_dt: the bias added after the softplus, not inside
    "xproj_split_order",  # x_proj output split as [B | C | dt] instead of [dt | B | C] (sizes fit since R == N)
    "conv_wrong_trim",  # padded conv keeps its LAST T outputs, not the first: the window looks K-1 tokens ahead
    "conv_weight_reshape",  # loader: conv1d weight (I,1,K) reshaped to (K,I) instead of transposed (taps scrambled)
    "gate_sigmoid",  # output gate uses sigmoid(z) instead of silu(z) = z * sigmoid(z)
    "d_skip_after_gate",  # D * x skip added after the SiLU(z) gate instead of before it
    "norm_mean_centered",  # RMSNorm written as LayerNorm (mean subtracted before the variance)
    "residual_after_norm",  # residual branch taken from the normed hidden state instead of the block input
    "scan_output_before_update",  # y_t read from S_{t-1} (output before the state update): off-by-one in the scan
    "zoh_discretize_b",  # B discretised by exact ZOH ((exp(dt A) - 1) / A) instead of Mamba's Euler dt * B
    "dt_clamped_init_range",  # dt clamped to config.time_step_min/max (init-only fields) at inference
    "xproj_pre_conv",  # dt, B, C projected from the pre-conv x (in_proj output) instead of the conv+SiLU output
    "mask_post_conv_missing",  # padding mask applied to the mixer input only, not after the conv: pads leak into S
]

PADDING_ONLY = ["mask_post_conv_missing"]

CLEAN = [
    "softplus_manual",  # dt softplus written as log1p(exp(x)) (threshold-guarded) instead of F.softplus
    "ssd_parallel_scan",  # scan as a masked decay matrix exp(cumsum_t - cumsum_s) (SSD form) instead of a loop
    "conv_shifted_taps",  # depthwise conv as a sum of K shifted, left-zero-padded copies instead of F.conv1d
    "dt_fused_proj",  # W_xdbc[:, :R] @ W_dt folded into one (I, I) matrix, applied to x directly
    "in_proj_split",  # in_proj as two matmuls (x half and z half) instead of one fused (H, 2I) matmul
]


def _bug() -> str:
    return BUG


def _rms_norm(h: torch.Tensor, g: torch.Tensor, eps: float) -> torch.Tensor:
    h = h.float()
    if _bug() == "norm_mean_centered":
        h = h - h.mean(-1, keepdim=True)
    var = h.pow(2).mean(-1, keepdim=True)
    return h * torch.rsqrt(var + eps) * g


def _softplus(x: torch.Tensor) -> torch.Tensor:
    if _bug() == "softplus_manual":
        return torch.where(x > 20.0, x, torch.log1p(torch.exp(torch.clamp(x, max=20.0))))
    return F.softplus(x)


class MambaPort(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.H = config.hidden_size
        self.I = int(config.expand * config.hidden_size)
        self.N = config.state_size
        self.R = int(config.time_step_rank)
        self.K = config.conv_kernel
        self.L = config.num_hidden_layers
        self.V = config.vocab_size
        self.eps = config.layer_norm_epsilon
        self.time_step_min = config.time_step_min
        self.time_step_max = config.time_step_max
        H, I, N, R, K, L, V = self.H, self.I, self.N, self.R, self.K, self.L, self.V
        p = lambda *s: nn.Parameter(torch.zeros(*s))  # noqa: E731
        self.tok_emb = p(V, H)
        self.head = None
        self.norm_g = p(L, H)
        self.w_in = p(L, H, 2 * I)
        self.b_in = p(L, 2 * I)
        self.conv_k = p(L, K, I)
        self.conv_b = p(L, I)
        self.w_xdbc = p(L, I, R + 2 * N)
        self.w_dt = p(L, R, I)
        self.b_dt = p(L, I)
        self.a_log = p(L, N, I)
        self.d_skip = p(L, I)
        self.w_out = p(L, I, H)
        self.b_out = p(L, H)
        self.norm_f = p(H)

    # ---- pieces of the mixer -------------------------------------------------------------------
    def _conv(self, x: torch.Tensor, l: int) -> torch.Tensor:
        """Causal depthwise conv over time + bias + SiLU. x: (B, T, I)."""
        T, K = x.shape[1], self.K
        w, b = self.conv_k[l], self.conv_b[l]  # (K, I), (I,)
        if _bug() == "conv_shifted_taps":
            xp = F.pad(x, (0, 0, K - 1, 0))  # left-pad time with K-1 zeros
            y = sum(w[k] * xp[:, k : k + T] for k in range(K)) + b
        else:
            y = F.conv1d(x.transpose(1, 2), w.t().unsqueeze(1), b, padding=K - 1, groups=self.I)
            y = y[:, :, -T:] if _bug() == "conv_wrong_trim" else y[:, :, :T]
            y = y.transpose(1, 2)
        return F.silu(y)

    def _scan(self, x, dt, A, Bm, Cm):
        """x, dt: (B, T, I); A: (I, N); Bm, Cm: (B, T, N). Returns sum_n S_t C_t: (B, T, I)."""
        dA = torch.exp(dt[..., None] * A)  # (B, T, I, N)
        if _bug() == "zoh_discretize_b":
            dB = (dA - 1.0) / A * Bm[:, :, None, :]
        else:
            dB = dt[..., None] * Bm[:, :, None, :]
        dBx = dB * x[..., None]  # (B, T, I, N)
        if _bug() == "ssd_parallel_scan":
            T = x.shape[1]
            cum = torch.cumsum(dt[..., None] * A, dim=1)  # (B, T, I, N)
            seg = cum[:, :, None] - cum[:, None, :]  # (B, t, s, I, N)
            causal = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
            seg = seg.masked_fill(~causal[None, :, :, None, None], float("-inf"))
            S = (torch.exp(seg) * dBx[:, None]).sum(2)  # (B, T, I, N)
            return (S * Cm[:, :, None, :]).sum(-1)
        S = torch.zeros(x.shape[0], x.shape[2], A.shape[1], dtype=x.dtype, device=x.device)
        ys = []
        for t in range(x.shape[1]):
            if _bug() == "scan_output_before_update":
                ys.append((S * Cm[:, t, None, :]).sum(-1))
                S = dA[:, t] * S + dBx[:, t]
            else:
                S = dA[:, t] * S + dBx[:, t]
                ys.append((S * Cm[:, t, None, :]).sum(-1))
        return torch.stack(ys, dim=1)

    def _mixer(self, u: torch.Tensor, l: int, m) -> torch.Tensor:
        I, N, R = self.I, self.N, self.R
        if m is not None:
            u = u * m
        if _bug() == "in_proj_split":
            x = u @ self.w_in[l, :, :I] + self.b_in[l, :I]
            z = u @ self.w_in[l, :, I:] + self.b_in[l, I:]
        else:
            xz = u @ self.w_in[l] + self.b_in[l]
            x, z = xz[..., :I], xz[..., I:]
        x_pre = x
        x = self._conv(x, l)
        if m is not None and _bug() != "mask_post_conv_missing":
            x = x * m
        proj = (x_pre if _bug() == "xproj_pre_conv" else x) @ self.w_xdbc[l]
        if _bug() == "xproj_split_order":
            Bm, Cm, dt_r = proj[..., :N], proj[..., N : 2 * N], proj[..., 2 * N :]
        else:
            dt_r, Bm, Cm = proj[..., :R], proj[..., R : R + N], proj[..., R + N :]
        if _bug() == "dt_fused_proj":
            w_full = self.w_xdbc[l, :, :R] @ self.w_dt[l]  # (I, I)
            dt_lin = x @ w_full
        else:
            dt_lin = dt_r @ self.w_dt[l]
        if _bug() == "dt_bias_after_softplus":
            dt = _softplus(dt_lin) + self.b_dt[l]
        else:
            dt = _softplus(dt_lin + self.b_dt[l])
        if _bug() == "dt_clamped_init_range":
            dt = dt.clamp(self.time_step_min, self.time_step_max)
        a_log = self.a_log[l].t()  # (I, N)
        A = -a_log if _bug() == "a_missing_exp" else -torch.exp(a_log)
        y = self._scan(x, dt, A, Bm, Cm)
        skip = x * self.d_skip[l]
        gate = torch.sigmoid(z) if _bug() == "gate_sigmoid" else F.silu(z)
        if _bug() == "d_skip_after_gate":
            y = y * gate + skip
        else:
            y = (y + skip) * gate
        return y @ self.w_out[l] + self.b_out[l]

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        h = self.tok_emb[input_ids].float()
        m = None if attention_mask is None else attention_mask.to(h.dtype)[..., None]
        for l in range(self.L):
            u = _rms_norm(h, self.norm_g[l], self.eps)
            residual = u if _bug() == "residual_after_norm" else h.float()
            h = residual + self._mixer(u, l, m)
        h = _rms_norm(h, self.norm_f, self.eps)
        head = self.tok_emb if self.head is None else self.head
        return h @ head.t()


@torch.no_grad()
def build(state_dict, config) -> nn.Module:
    sd = {k: v.float() for k, v in state_dict.items()}
    model = MambaPort(config)
    I, K, L = model.I, model.K, model.L
    emb = sd.get("backbone.embeddings.weight", sd.get("backbone.embedding.weight"))
    model.tok_emb.copy_(emb)
    head = sd.get("lm_head.weight")
    if head is not None and not getattr(config, "tie_word_embeddings", True) and not torch.equal(head, emb):
        model.head = nn.Parameter(head.clone())
    model.norm_f.copy_(sd["backbone.norm_f.weight"])
    for l in range(L):
        pre = f"backbone.layers.{l}."
        mx = pre + "mixer."
        model.norm_g[l] = sd[pre + "norm.weight"]
        model.w_in[l] = sd[mx + "in_proj.weight"].t()
        if mx + "in_proj.bias" in sd:
            model.b_in[l] = sd[mx + "in_proj.bias"]
        cw = sd[mx + "conv1d.weight"]  # (I, 1, K)
        if _bug() == "conv_weight_reshape":
            model.conv_k[l] = cw.reshape(K, I)
        else:
            model.conv_k[l] = cw.squeeze(1).t()
        if mx + "conv1d.bias" in sd:
            model.conv_b[l] = sd[mx + "conv1d.bias"]
        model.w_xdbc[l] = sd[mx + "x_proj.weight"].t()
        model.w_dt[l] = sd[mx + "dt_proj.weight"].t()
        model.b_dt[l] = sd[mx + "dt_proj.bias"]
        model.a_log[l] = sd[mx + "A_log"].t()
        model.d_skip[l] = sd[mx + "D"]
        model.w_out[l] = sd[mx + "out_proj.weight"].t()
        if mx + "out_proj.bias" in sd:
            model.b_out[l] = sd[mx + "out_proj.bias"]
    return model.float().eval()
