"""ArchFacts: everything the engine may know about an architecture, derived from a Transformers config.

The engine (check, diagnose, analysis, resources, reports) reads these facts and the NodeSpecs,
never a family's cfg dict, so a user's own model, which has no cfg dict of ours, gets the same
hints, guards and reports as a built-in family. The facts come from the *reference's* config: the
standard fields every decoder config has, plus one small rule per ``model_type`` where a model
decides something the config does not say (Cohere 2 applies no RoPE on full-attention layers,
GPT-2's layers live under ``transformer.h``, Gemma scales its embeddings).

RoPE is kept in Transformers 5's ``rope_parameters`` shape, per layer type, together with the
cos/sin scaling factor Transformers computes for it (``ROPE_INIT_FUNCTIONS``), so a hint can name
"the YaRN attention factor 1.2079" without knowing how any family spells it.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import cast

SLIDING, FULL, LINEAR = "sliding_attention", "full_attention", "linear_attention"


@dataclass(frozen=True)
class RopeFacts:
    """RoPE of one layer type.

    ``parameters``: the Transformers ``rope_parameters`` dict of that layer type (read-only).
    ``attention_factor``: the factor Transformers multiplies cos and sin by (1.0 unless YaRN or
    LongRoPE say otherwise). ``rotary_dim``: how many dims of a head the rotation spans (``head_dim *
    partial_rotary_factor``; the whole head for "proportional" RoPE, whose zero frequencies leave
    the pairs past the partial part unrotated). ``interleaved``: pairs ``(2i, 2i + 1)`` rotate together (RoFormer,
    Cohere) instead of ``(i, i + d/2)`` (GPT-NeoX, Llama).
    """

    rope_type: str
    theta: float
    parameters: Mapping[str, object]
    attention_factor: float = 1.0
    rotary_dim: int = 0
    interleaved: bool = False
    #: the inverse frequencies Transformers computes (``rotary_dim // 2`` of them), for hints
    inv_freq: tuple[float, ...] = ()

    @property
    def unscaled_theta(self) -> float:
        """The theta a forgotten scaling rotates with: the config's, before HunYuan's NTK ``alpha`` raises it."""
        base = self.parameters.get("rope_theta", self.theta)
        return float(cast(float, base)) if self.parameters.get("alpha") else self.theta

    def unscaled_inv_freq(self) -> tuple[float, ...]:
        """Plain RoPE frequencies ``theta^(-2i/d)`` with the unscaled theta (what a forgotten scaling gives)."""
        return default_inv_freq(self.unscaled_theta, self.rotary_dim)

    def with_theta(self, theta: float, head_dim: int, max_position_embeddings: int | None) -> tuple[float, ...]:
        """This RoPE's frequencies (same type and scaling) had its theta been ``theta``."""
        if self.rope_type == "default":
            return default_inv_freq(theta, self.rotary_dim)
        return self.with_parameters({"rope_theta": theta}, head_dim, max_position_embeddings)

    def with_parameters(
        self, changes: Mapping[str, object], head_dim: int, max_position_embeddings: int | None
    ) -> tuple[float, ...]:
        """This RoPE's frequencies had its ``rope_parameters`` held ``changes`` (Transformers' init function of
        its type, e.g. ``_compute_yarn_parameters``)."""
        params = {**self.parameters, **changes}
        theta = float(cast(float, params.get("rope_theta", self.theta)))
        inv_freq, _ = rope_init(
            RopeConfig(params, head_dim, max_position_embeddings), None, params, False, theta, self.rotary_dim
        )
        return inv_freq

    def get(self, key: str, default=None):
        return self.parameters.get(key, default)


class RopeConfig:
    """The attributes Transformers' RoPE init functions read, for one rope dict (no model config)."""

    def __init__(self, params: dict, head_dim: int, max_position_embeddings: int | None):
        self.rope_parameters = dict(params)
        self.head_dim, self.hidden_size, self.num_attention_heads = head_dim, head_dim, 1
        self.max_position_embeddings = max_position_embeddings or 2048
        self.partial_rotary_factor = float(params.get("partial_rotary_factor", 1.0))

    def standardize_rope_params(self) -> None:
        """Already standard: one rope dict."""


@dataclass(frozen=True)
class LayerFacts:
    """One decoder layer: its type, attention window (None = full causal), RoPE (None = no RoPE),
    head_dim, KV heads and softmax scale (``scores = q k^T * attention_scale``); a mixture-of-experts
    feed-forward has ``num_experts`` routed experts of which each token uses ``experts_per_token``
    (0 and 0: a dense feed-forward).

    ``kv_source``: the index of the earlier layer whose keys and values this layer attends to
    instead of computing its own (cross-layer KV sharing, Gemma 4 ``num_kv_shared_layers``); None
    when it computes them. ``k_eq_v``: its values are its key projection (no value projection).
    ``num_heads``: its query heads where they differ from the model's (Laguna's
    ``num_attention_heads_per_layer``), else 0: read with :meth:`ArchFacts.heads_at`."""

    index: int
    layer_type: str
    window: int | None
    rope: RopeFacts | None
    head_dim: int
    num_kv_heads: int
    attention_scale: float
    kv_source: int | None = None
    k_eq_v: bool = False
    num_experts: int = 0
    experts_per_token: int = 0
    num_heads: int = 0

    @property
    def sparse(self) -> bool:
        """True when this layer's feed-forward is a mixture of experts."""
        return self.num_experts > 0


@dataclass(frozen=True)
class ArchFacts:
    """What the engine knows about one architecture (see the module docstring).

    Node locations: ``layer_prefix`` is the module path of the decoder layers' ModuleList
    (``model.layers``, ``model.language_model.layers``, ``transformer.h``); ``embed_module`` and
    ``head_module`` are the token embedding and the output projection. Scalars the output may carry:
    ``logit_scale`` (Cohere multiplies the logits), ``final_softcap`` / ``attn_softcap`` (Gemma
    ``cap * tanh(x / cap)``), ``embed_scale`` (Gemma multiplies embeddings by sqrt(hidden)).
    ``norm_kind`` is ``"rmsnorm"`` or ``"layernorm"``; ``norm_weight_offset`` is 1.0 where the norm
    multiplies by ``(1 + w)``. ``qk_norm``: None, ``"head"`` (per head, Qwen3/Gemma) or
    ``"projection"`` (over the whole projection, OLMo 2/3). ``chunk_size``: linear-attention
    layers run their recurrence over the sequence in chunks of this many tokens (None: no such
    layers); only a sequence longer than one chunk exercises the state carried between chunks.
    ``conv_kernel``: the width of those layers' short causal convolution (a call continuing a cache
    reads the previous call's last ``conv_kernel - 1`` inputs).
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int | None
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    layers: tuple[LayerFacts, ...]
    layer_prefix: str = "model.layers"
    embed_module: str = "model.embed_tokens"
    head_module: str = "lm_head"
    norm_kind: str = "rmsnorm"
    norm_eps: float | None = None
    norm_weight_offset: float = 0.0
    qk_norm: str | None = None
    logit_scale: float | None = None
    #: the config's query_pre_attn_scalar (Gemma 2/3: the attention scales by its inverse square root, not head_dim's)
    query_pre_attn_scalar: float | None = None
    final_softcap: float | None = None
    attn_softcap: float | None = None
    #: OLMo's ``clip_qkv``: q, k and v clamped to [-c, c] right after their projections (None: no clip)
    clip_qkv: float | None = None
    embed_scale: float | None = None
    tie_word_embeddings: bool = False
    max_position_embeddings: int | None = None
    chunk_size: int | None = None
    conv_kernel: int | None = None
    #: named constants a constant ratio may equal (see :meth:`named_constants`)
    extra_constants: Mapping[str, float] = field(default_factory=dict)
    #: named parts of the architecture beyond the fields above (Gemma 4: "per-layer inputs", "KV
    #: sharing", "K = V", "double-wide MLP"): a node map's ``when`` and the gate's config coverage read them
    features: frozenset[str] = frozenset()
    #: a router's constants, for the hints that recompute its routing: a group-limited sigmoid router's
    #: (DeepSeek V3: ``routed_scaling_factor``, ``n_group``, ``topk_group``, ``norm_topk_prob``), SparseMixer's
    #: threshold eps (PhiMoE: ``sparsemixer_eps``)
    routing: Mapping[str, float] = field(default_factory=dict)
    #: token ids the reference swaps out before its text model sees them (a multimodal model's image,
    #: video and audio placeholders: Gemma 4 embeds pad in their place); random inputs avoid them
    placeholder_tokens: tuple[int, ...] = ()
    #: token ids the reference's own modules treat as a boundary in its forward (Qwen4-Exp's per-layer n-gram
    #: embedding restarts its context after ``eos_token_id``): random inputs hold each once, mid-sequence
    boundary_tokens: tuple[int, ...] = ()
    #: the config field that says which layers apply no RoPE, where a per-layer list does (SmolLM3's
    #: ``no_rope_layers``: 1 marks a layer that *uses* RoPE); "" where the layer types say it or none is NoPE
    nope_field: str = ""
    #: the position the reference's embedding gives the first token when it derives positions from the ids itself
    #: (RoBERTa's, XLM-R's ``create_position_ids_from_input_ids``: ``padding_idx + 1``, the padding at
    #: ``padding_idx``); 0 where positions count from 0 (every check hands both sides positions from this one)
    position_offset: int = 0
    #: further stacks of layers after the first (``layer_prefix``'s), in the order the model runs them: ``(module
    #: path of its ModuleList, the index its layer 0 takes in ``layers``)`` (BLT's global transformer and local
    #: decoder after its local encoder); each layer's facts (heads, head_dim, RoPE) are its own stack's
    stacks: tuple[tuple[str, int], ...] = ()
    #: a hash n-gram embedding's constants (BLT's ``encoder_hash_tok_embedding``): ``group_sizes`` (the n of each
    #: group), ``vocab`` (rows per group), ``functions`` (hash functions, each with its prime); empty where none
    ngram_hash: Mapping[str, object] = field(default_factory=dict)

    @property
    def text_model(self) -> str:
        """The module path of the text model that holds the decoder layers: ``model``, ``transformer``, or
        ``model.language_model`` in a multimodal checkpoint's model (``...ForConditionalGeneration``)."""
        return self.layer_prefix.rpartition(".")[0]

    # --- per layer -----------------------------------------------------------------------------

    @property
    def layer_types(self) -> tuple[str, ...]:
        return tuple(layer.layer_type for layer in self.layers)

    @property
    def windows(self) -> tuple[int | None, ...]:
        return tuple(layer.window for layer in self.layers)

    @property
    def sliding_window(self) -> int | None:
        """The largest attention window of any layer, or None when every layer is full causal."""
        windows = [w for w in self.windows if w]
        return max(windows) if windows else None

    def layer(self, index: int | None) -> LayerFacts | None:
        return self.layers[index] if index is not None and 0 <= index < len(self.layers) else None

    def heads_at(self, index: int | None) -> int:
        """Layer ``index``'s query heads: its own count where it has one, else the model's."""
        layer = self.layer(index)
        return layer.num_heads if layer is not None and layer.num_heads else self.num_heads

    def rope_of_type(self, layer_type: str) -> RopeFacts | None:
        return next((layer.rope for layer in self.layers if layer.layer_type == layer_type), None)

    # --- node names ----------------------------------------------------------------------------

    def locate(self, name: str) -> tuple[int | None, str]:
        """``(layer index or None, kind)`` of a canonical node name.

        The kind is the last path component without the layer prefix (``q_proj``, ``probs``,
        ``mlp@input``; a per-head norm's module of one head, ``q_layernorm.norms.0``, is ``q_layernorm``); a
        layer's own output is ``layer``; outside the layers the last component
        (``embed_tokens``, ``norm``, ``lm_head``, ``logits``). A ``stepN/`` prefix (decode checks) is
        ignored.
        """
        bare = name.split("/", 1)[1] if re.match(r"^step\d+/", name) else name
        prefix, offset = next(
            ((f"{p}.", o) for p, o in ((self.layer_prefix, 0), *self.stacks) if bare.startswith(f"{p}.")),
            (self.layer_prefix + ".", 0),
        )
        if bare.startswith(prefix):
            head, _, rest = bare[len(prefix) :].partition(".")
            layer_part, at, after_at = head.partition("@")
            if layer_part.isdigit():
                index = int(layer_part) + offset
                if at:
                    return index, "layer@" + after_at
                if not rest:
                    return index, "layer"
                if "@" in rest:
                    path, _, what = rest.partition("@")
                    return index, f"{path.rsplit('.', 1)[-1]}@{what}"
                parts = rest.split(".")
                if len(parts) >= 3 and parts[-1].isdigit() and "norm" in parts[-3]:
                    return index, parts[-3]  # one head's norm of a per-head norm (StableLM's q_layernorm.norms.0)
                if len(parts) >= 2 and parts[-1].isdigit() and "norm" in parts[-2]:
                    return index, parts[-2]  # one of a list of norms (LongCat-Flash's input_layernorm.1)
                if parts[-1] == "layer" and len(parts) >= 2:
                    return index, f"{parts[-2]}.layer"  # a module named layer (DBRX's router.layer), not the layer
                return index, parts[-1]
        if "@" in bare:
            path, _, what = bare.partition("@")
            return None, f"{path.rsplit('.', 1)[-1]}@{what}"
        return None, bare.rsplit(".", 1)[-1] if bare else "logits"

    def layer_path(self, index: int) -> str:
        """The module path of layer ``index`` (``model.layers.3``; in a model of several stacks, the stack's own
        numbering: BLT's ``model.global_transformer.layers.0``)."""
        prefix, offset = max(
            ((p, o) for p, o in ((self.layer_prefix, 0), *self.stacks) if o <= index), key=lambda item: item[1]
        )
        return f"{prefix}.{index - offset}"

    def named_constants(self) -> dict[str, float]:
        """Scalars a missing or extra factor is likely to equal, by name (for constant-ratio hints)."""
        named: dict[str, float] = {}
        for layer in self.layers:
            rope = layer.rope
            if rope is not None and rope.attention_factor != 1.0:
                f = rope.attention_factor
                named.setdefault(f"the {rope.rope_type} attention factor of {layer.layer_type} layers", f)
                named.setdefault(f"the {rope.rope_type} attention factor of {layer.layer_type} layers, squared", f * f)
            factor = rope.get("factor") if rope is not None and rope.rope_type == "yarn" else None
            if (
                isinstance(factor, (int, float)) and factor > 1
            ):  # YaRN's default, 0.1 ln(s) + 1 (arXiv:2309.00071 eq. 22)
                named.setdefault(
                    f"the default YaRN attention factor 0.1 ln({factor:g}) + 1", 0.1 * math.log(factor) + 1
                )
        if self.logit_scale not in (None, 1.0):
            named["logit_scale"] = float(self.logit_scale)
        if self.embed_scale not in (None, 1.0):
            named["the embedding scale"] = float(self.embed_scale)
        named[f"sqrt(hidden_size={self.hidden_size})"] = math.sqrt(self.hidden_size)
        named[f"sqrt(head_dim={self.head_dim})"] = math.sqrt(self.head_dim)
        if (
            self.num_heads
            and self.hidden_size % self.num_heads == 0
            and self.hidden_size // self.num_heads != self.head_dim
        ):
            alt = self.hidden_size // self.num_heads
            named[f"sqrt(head_dim / (hidden_size / num_heads)) = sqrt({self.head_dim}/{alt})"] = math.sqrt(
                self.head_dim / alt
            )
        for n, width in ((self.head_dim, "head_dim"), (self.hidden_size, "hidden_size")):
            if n and n > 1:  # a per-row factor of a LayerNorm (or a q/k norm) whose variance divides by N - 1
                named.setdefault(
                    f"sqrt(({width} - 1) / {width}) = sqrt({n - 1}/{n}) (a norm's variance taken unbiased, "
                    "sum / (N - 1): torch.var's default)",
                    math.sqrt((n - 1) / n),
                )
        named.update(self.extra_constants)
        return named


def default_inv_freq(theta: float, rotary_dim: int) -> tuple[float, ...]:
    """``theta^(-2i/d)`` for ``i < d/2``, computed as Transformers' default RoPE does (float32)."""
    import torch

    if rotary_dim < 2 or not theta > 0:
        return ()
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    return tuple((1.0 / (theta**exponents)).tolist())


def rope_init(
    config, layer_type: str | None, params: dict, per_type: bool, theta: float, rotary_dim: int
) -> tuple[tuple, float]:
    """``(inverse frequencies, cos/sin scale)`` as Transformers computes them for these parameters."""
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        return default_inv_freq(theta, rotary_dim), 1.0
    try:
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        fn = ROPE_INIT_FUNCTIONS[rope_type]
        inv_freq, factor = fn(config, "cpu", layer_type=layer_type) if per_type else fn(config, "cpu")
        return tuple(inv_freq.float().tolist()), float(factor)
    except Exception:  # a config Transformers itself cannot run; the build path reports it
        value = params.get("attention_factor")
        return (), float(value) if isinstance(value, (int, float)) else 1.0


def with_layers(facts: ArchFacts, **changes) -> ArchFacts:
    """``facts`` with every LayerFacts updated by ``fn(layer)`` for the given fields."""
    return replace(
        facts, layers=tuple(replace(layer, **{k: fn(layer) for k, fn in changes.items()}) for layer in facts.layers)
    )
