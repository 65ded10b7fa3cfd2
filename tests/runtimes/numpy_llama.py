"""A Llama 3 forward pass in NumPy: a second runtime whose dump ``parity compare`` reads.

Written from the formulas (no PyTorch, no Transformers; NumPy and safetensors' NumPy reader only),
for the configs of ``LlamaForCausalLM`` checkpoints, in float32:

    h_0       = E[tokens]                                              embedding rows
    per layer l:
      a       = rmsnorm(h, w_in)        rmsnorm(x, w) = x / sqrt(mean(x^2) + eps) * w
      q, k, v = a Wq^T, a Wk^T, a Wv^T                                 heads of head_dim D
      q', k'  = RoPE(q), RoPE(k)        (x_j, x_{j+D/2}) rotated by the angle p * f_j,
                                        f_j = theta^(-2j/D), with the Llama 3 scaling of f_j
      s       = q' k'^T / sqrt(D)       query head h reads KV head h // (heads / kv_heads)
      P       = softmax(s + causal mask)
      c       = P v, heads merged;  o = c Wo^T
      h'      = h + o
      m       = rmsnorm(h', w_post);  d = (silu(m Wg^T) * (m Wu^T)) Wd^T,  silu(x) = x / (1 + e^-x)
      h       = h' + d
    logits    = rmsnorm(h, w_final) W_head^T                           W_head = E when tied

Llama 3 frequency scaling (factor s, low/high frequency factors, original context L): a frequency
whose wavelength 2 pi / f is under L / high keeps f, over L / low becomes f / s, and in between
``(1 - t) f / s + t f`` with ``t = (L / wavelength - low) / (high - low)``.

Usage::

    python tests/runtimes/numpy_llama.py --weights TRACE/weights --inputs TRACE/inputs.safetensors --out DUMP
        [--names transformers|runtime] [--fault rope-interleaved|rope-unscaled|gate-up-swapped]

``--names transformers`` (default) writes one ``<node name>.npy`` per node, in the node's layout;
``--names runtime`` writes one ``dump.safetensors`` with this runtime's own names and layouts
(no batch axis, heads before the head dim: ``(seq, heads, head_dim)``), which
``numpy_llama_names.json`` maps back. ``--fault`` injects one bug, for the test suite to locate.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file, save_file

FAULTS = ("rope-interleaved", "rope-unscaled", "gate-up-swapped")


def load_weights(folder: Path) -> tuple[dict, dict[str, np.ndarray]]:
    config = json.loads((folder / "config.json").read_text())
    weights = {}
    for f in sorted(folder.glob("*.safetensors")):
        weights.update(load_file(f))
    return config, {k: v.astype(np.float32) for k, v in weights.items()}


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + np.float32(eps)) * w


def frequencies(config: dict, head_dim: int, scaled: bool = True) -> np.ndarray:
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    theta = float(rope.get("rope_theta", config.get("rope_theta", 10000.0)))
    f = theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    if scaled and rope.get("rope_type") == "llama3":
        s, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
        context = rope["original_max_position_embeddings"]
        wavelength = 2 * math.pi / f
        t = (context / wavelength - low) / (high - low)
        f = np.where(
            wavelength < context / high, f, np.where(wavelength > context / low, f / s, (1 - t) * f / s + t * f)
        )
    return f


def rope(x: np.ndarray, positions: np.ndarray, f: np.ndarray, interleaved: bool = False) -> np.ndarray:
    """``x``: (batch, heads, seq, D); ``positions``: (batch, seq)."""
    angle = (positions[:, None, :, None].astype(np.float64) * f).astype(np.float32)  # (batch, 1, seq, D/2)
    cos, sin = np.cos(angle), np.sin(angle)
    if interleaved:
        a, b = x[..., 0::2], x[..., 1::2]
        out = np.empty_like(x)
        out[..., 0::2], out[..., 1::2] = a * cos - b * sin, b * cos + a * sin
        return out
    half = x.shape[-1] // 2
    a, b = x[..., :half], x[..., half:]
    return np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def forward(
    config: dict, w: dict[str, np.ndarray], input_ids: np.ndarray, positions: np.ndarray, fault: str | None = None
) -> dict:
    """Every node of a Llama forward, by its Transformers node name, in execution order."""
    nodes = {}
    batch, seq = input_ids.shape
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    d = config.get("head_dim") or config["hidden_size"] // heads
    eps = config["rms_norm_eps"]
    f = frequencies(config, d, scaled=fault != "rope-unscaled")
    mask = np.triu(np.full((seq, seq), -np.inf, dtype=np.float32), k=1)
    h = w["model.embed_tokens.weight"][input_ids]
    nodes["model.embed_tokens"] = h
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}"
        a = rms_norm(h, w[f"{p}.input_layernorm.weight"], eps)
        q, k, v = (a @ w[f"{p}.self_attn.{n}_proj.weight"].T for n in "qkv")
        nodes.update(
            {
                f"{p}.input_layernorm": a,
                f"{p}.self_attn.q_proj": q,
                f"{p}.self_attn.k_proj": k,
                f"{p}.self_attn.v_proj": v,
            }
        )
        q = q.reshape(batch, seq, heads, d).transpose(0, 2, 1, 3)
        k = k.reshape(batch, seq, kv_heads, d).transpose(0, 2, 1, 3)
        v = v.reshape(batch, seq, kv_heads, d).transpose(0, 2, 1, 3)
        q = rope(q, positions, f, interleaved=fault == "rope-interleaved")
        k = rope(k, positions, f, interleaved=fault == "rope-interleaved")
        group = heads // kv_heads
        k_all, v_all = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
        s = q @ k_all.transpose(0, 1, 3, 2) / np.float32(math.sqrt(d))
        probs = softmax(s + mask)
        c = (probs @ v_all).transpose(0, 2, 1, 3).reshape(batch, seq, heads * d)
        o = c @ w[f"{p}.self_attn.o_proj.weight"].T
        nodes.update(
            {
                f"{p}.self_attn.q_rot": q,
                f"{p}.self_attn.k_rot": k,
                f"{p}.self_attn.scores": s,
                f"{p}.self_attn.probs": probs,
                f"{p}.self_attn.context": c,
                f"{p}.self_attn.o_proj": o,
            }
        )
        h = h + o
        m = rms_norm(h, w[f"{p}.post_attention_layernorm.weight"], eps)
        gate_w, up_w = w[f"{p}.mlp.gate_proj.weight"], w[f"{p}.mlp.up_proj.weight"]
        if fault == "gate-up-swapped" and i == config["num_hidden_layers"] - 1:
            gate_w, up_w = up_w, gate_w
        g, u = m @ gate_w.T, m @ up_w.T
        dn = (g / (1 + np.exp(-g)) * u) @ w[f"{p}.mlp.down_proj.weight"].T
        nodes.update(
            {
                f"{p}.post_attention_layernorm@input": h,
                f"{p}.post_attention_layernorm": m,
                f"{p}.mlp.gate_proj": g,
                f"{p}.mlp.up_proj": u,
                f"{p}.mlp.down_proj": dn,
            }
        )
        h = h + dn
        nodes[p] = h
    n = rms_norm(h, w["model.norm.weight"], eps)
    head = w.get("lm_head.weight", w["model.embed_tokens.weight"])
    nodes.update({"model.norm": n, "lm_head": n @ head.T})
    return {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in nodes.items()}


#: this runtime's own names (``{i}`` = layer) for ``--names runtime``, and how it lays tensors out
RUNTIME_NAMES = {
    "model.embed_tokens": "inp_embd",
    "model.layers.{i}.input_layernorm": "attn_norm-{i}",
    "model.layers.{i}.self_attn.q_proj": "Qcur-{i}",
    "model.layers.{i}.self_attn.k_proj": "Kcur-{i}",
    "model.layers.{i}.self_attn.v_proj": "Vcur-{i}",
    "model.layers.{i}.self_attn.q_rot": "Qrope-{i}",
    "model.layers.{i}.self_attn.k_rot": "Krope-{i}",
    "model.layers.{i}.self_attn.scores": "kq-{i}",
    "model.layers.{i}.self_attn.probs": "kq_softmax-{i}",
    "model.layers.{i}.self_attn.context": "kqv_out-{i}",
    "model.layers.{i}.self_attn.o_proj": "attn_out-{i}",
    "model.layers.{i}.post_attention_layernorm@input": "ffn_inp-{i}",
    "model.layers.{i}.post_attention_layernorm": "ffn_norm-{i}",
    "model.layers.{i}.mlp.gate_proj": "ffn_gate-{i}",
    "model.layers.{i}.mlp.up_proj": "ffn_up-{i}",
    "model.layers.{i}.mlp.down_proj": "ffn_out-{i}",
    "model.layers.{i}": "l_out-{i}",
    "model.norm": "result_norm",
    "lm_head": "result_output",
}


def runtime_layout(name: str, x: np.ndarray, heads: int) -> tuple[str, np.ndarray]:
    """A node in this runtime's own name and layout: batch row 0 only, q/k after RoPE as (seq, heads,
    D), the merged context as (seq, heads, D)."""
    layer = name.split(".")[2] if name.startswith("model.layers.") else None
    template = name if layer is None else name.replace(f"model.layers.{layer}", "model.layers.{i}", 1)
    own = RUNTIME_NAMES[template].replace("{i}", layer or "")
    x = x[0]
    if template.endswith(("q_rot", "k_rot")):
        x = x.transpose(1, 0, 2)
    elif template.endswith("context"):
        x = x.reshape(x.shape[0], heads, -1)
    return own, np.ascontiguousarray(x)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--weights", required=True, type=Path, help="Transformers checkpoint folder (config.json, safetensors)"
    )
    parser.add_argument("--inputs", required=True, type=Path, help="a trace's inputs.safetensors")
    parser.add_argument("--out", required=True, type=Path, help="dump folder to create")
    parser.add_argument("--names", choices=("transformers", "runtime"), default="transformers")
    parser.add_argument("--fault", choices=FAULTS)
    args = parser.parse_args(argv)
    config, weights = load_weights(args.weights)
    inputs = load_file(args.inputs)
    mask = inputs.get("attention_mask")
    if mask is not None and not mask.all():
        parser.error("padded inputs are not supported by this runtime")
    nodes = forward(config, weights, inputs["input_ids"], inputs["position_ids"], args.fault)
    args.out.mkdir(parents=True)
    if args.names == "transformers":
        for name, x in nodes.items():
            np.save(args.out / f"{name}.npy", x)
    else:
        if inputs["input_ids"].shape[0] != 1:
            parser.error("--names runtime dumps batch row 0 only: record the trace with batch 1")
        save_file(
            dict(runtime_layout(n, x, config["num_attention_heads"]) for n, x in nodes.items()),
            args.out / "dump.safetensors",
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
