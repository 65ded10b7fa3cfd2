"""llama.cpp as a runtime parity compares, through llama-cpp-python's low-level API: every tensor its
graph names is read as it is computed, through the scheduler's eval callback
(``llama_context_params.cb_eval``), on a golden trace's inputs.

    parity dump llama-cpp TRACE/weights --trace TRACE --out DUMP   # pip install 'parity[llama-cpp]'
    parity compare TRACE --dump DUMP

The model is a GGUF file, or a Transformers checkpoint folder (a trace's ``weights/``) that the adapter
writes as a float32 GGUF first (:func:`write_gguf`, with the ``gguf`` package; llama, qwen3, olmo2 and
olmo3 checkpoints). llama.cpp's names (``attn_norm-0``, ``Qcur-0``, ``kq_soft_max-0``...) become node
names through the name map of the GGUF's architecture (``llama_cpp_names.json``: llama, qwen3, olmo2,
gemma3), which also says what llama.cpp does not name (an ``o_proj`` output: unavailable, not
missing). A name written several times keeps each write (``Qcur-0``, ``Qcur-0#1``, ``Qcur-0#2``).

Defaults, and why: the KV cache in float32 (llama.cpp's default is F16, which a float32 trace sees at
``scores``/``context``: ``cache_type="f16"`` runs it, with a note) and flash attention off (llama.cpp's
``ggml_flash_attn_ext`` casts float32 K and V to F16, and computes no ``kq``/``kq_soft_max``:
``flash_attn=True`` runs it, those nodes marked unavailable). Each row of a padded batch runs as its
own sequence on its real tokens, in one micro-batch, every token an output. A note names the weights'
quantization when they are not float32 (quantized matmuls quantize their activations too).
"""

from __future__ import annotations

import ctypes
import glob
import json
import math
import os
import tempfile
from collections.abc import Mapping
from importlib import resources
from pathlib import Path

import numpy as np

from parity.runtimes.common import RuntimeMissing, assemble, check_out, probe_of, write_dump
from parity.util.errors import ParityError

NAMES_FILE = "llama_cpp_names.json"
#: ggml_type values of the activations the callback reads (ggml.h)
GGML_F32, GGML_F16, GGML_BF16 = 0, 1, 30
CACHE_TYPES = {"f32": 0, "f16": 1, "bf16": 30, "q8_0": 8}
FLASH_REASON = "llama.cpp's flash attention (ggml_flash_attn_ext) computes no kq or kq_soft_max"


def names() -> dict:
    """The data table: ``{"maps": {arch: name map}, "convert": {...}}``."""
    return json.loads(resources.files(__package__).joinpath(NAMES_FILE).read_text(encoding="utf-8"))


def name_map(arch: str) -> dict:
    """The parity name map of llama.cpp's GGUF architecture ``arch``. Raises ParityError for one the
    table does not hold (give ``parity compare`` a --name-map of your own then)."""
    maps = names()["maps"]
    if arch not in maps:
        raise ParityError(
            f"no llama.cpp name map for GGUF architecture {arch!r} (known: {', '.join(sorted(maps))}); "
            "write one (see parity/runtimes/llama_cpp_names.json) and pass it to parity compare --name-map"
        )
    return maps[arch]


# --- a Transformers checkpoint as a float32 GGUF -------------------------------------------------------


def _llama3_factors(rope: Mapping, head_dim: int) -> np.ndarray:
    """Per-frequency divisors of Llama 3's RoPE scaling (llama.cpp's ``rope_freqs`` tensor): 1 for short
    wavelengths, ``factor`` for long ones, a smooth blend between."""
    base, factor = float(rope["rope_theta"]), float(rope["factor"])
    low, high = float(rope["low_freq_factor"]), float(rope["high_freq_factor"])
    old = float(rope["original_max_position_embeddings"])
    out = []
    for i in range(0, head_dim, 2):
        freq = 1.0 / base ** (i / head_dim)
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1.0 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, dtype=np.float32)


def _rope(config: Mapping) -> tuple[dict, dict]:
    """``(full-attention layers' RoPE, sliding layers' RoPE)`` from Transformers 5's rope_parameters
    (or the older rope_theta/rope_scaling)."""
    rope = config.get("rope_parameters")
    if isinstance(rope, Mapping) and any(isinstance(v, Mapping) for v in rope.values()):
        full = dict(rope.get("full_attention") or next(v for v in rope.values() if isinstance(v, Mapping)))
        return full, dict(rope.get("sliding_attention") or full)
    if isinstance(rope, Mapping):
        return dict(rope), dict(rope)
    legacy = dict(config.get("rope_scaling") or {})
    legacy.setdefault("rope_theta", config.get("rope_theta", 10000.0))
    return legacy, legacy


def write_gguf(checkpoint, out, *, config_changes: Mapping | None = None) -> tuple[Path, str]:
    """Write a Transformers checkpoint folder as a float32 GGUF llama.cpp loads (no tokenizer: token
    ids only); ``config_changes`` override config fields first (what-if runs). ``(path, GGUF arch)``.
    Raises ParityError for a model type the table does not convert, or RuntimeMissing without gguf."""
    try:
        import gguf
    except ImportError:
        raise RuntimeMissing("writing a GGUF needs the gguf package: pip install 'parity[llama-cpp]'") from None
    from safetensors.numpy import load_file

    checkpoint = Path(checkpoint).expanduser()
    config = {**json.loads((checkpoint / "config.json").read_text()), **dict(config_changes or {})}
    table = names()["convert"]
    model_type = config.get("model_type")
    kind = table["model_types"].get(model_type)
    if kind is None:
        raise ParityError(
            f"the llama.cpp adapter converts {', '.join(sorted(table['model_types']))} checkpoints, not model_type "
            f"{model_type!r}: convert it with llama.cpp's convert_hf_to_gguf.py --outtype f32 and pass the .gguf"
        )
    arch = kind["arch"]
    weights = {}
    for f in sorted(checkpoint.glob("*.safetensors")):
        weights.update(load_file(f))
    heads, kv_heads = int(config["num_attention_heads"]), int(config.get("num_key_value_heads") or 0)
    kv_heads = kv_heads or heads
    hidden = int(config["hidden_size"])
    head_dim = int(config.get("head_dim") or hidden // heads)
    layers = int(config["num_hidden_layers"])
    full, sliding = _rope(config)
    writer = gguf.GGUFWriter(str(out), arch)
    writer.add_name(f"parity {model_type} {checkpoint.name}")
    writer.add_block_count(layers)
    writer.add_context_length(int(config.get("max_position_embeddings") or 4096))
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(int(config["intermediate_size"]))
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(float(full.get("rope_theta", 10000.0)))
    writer.add_layer_norm_rms_eps(float(config["rms_norm_eps"]))
    writer.add_vocab_size(int(config["vocab_size"]))
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_tokenizer_model("none")
    if float(sliding.get("rope_theta", full.get("rope_theta", 10000.0))) != float(full.get("rope_theta", 10000.0)):
        writer.add_rope_freq_base_swa(float(sliding["rope_theta"]))
    window = config.get("sliding_window")
    layer_types = config.get("layer_types")
    if window and layer_types and "sliding_attention" in layer_types:
        writer.add_sliding_window(int(window))
        writer.add_sliding_window_pattern([t == "sliding_attention" for t in layer_types])
    rope_type = full.get("rope_type", full.get("type", "default"))
    if rope_type == "llama3":
        weights["rope_freqs.weight"] = _llama3_factors(full, head_dim)
    elif rope_type == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(float(full["factor"]))
        writer.add_rope_scaling_orig_ctx_len(int(full["original_max_position_embeddings"]))
    elif rope_type not in ("default", None):
        raise ParityError(f"the llama.cpp adapter does not convert rope_type {rope_type!r}")
    renames = table["tensors"]
    for key in sorted(weights):
        tensor = np.ascontiguousarray(weights[key].astype(np.float32))
        target = "rope_freqs.weight" if key == "rope_freqs.weight" else _gguf_name(key, renames, arch)
        if target is None:
            raise ParityError(f"the llama.cpp adapter has no GGUF name for checkpoint tensor {key}")
        if kind["permute_qk"] and key.endswith(("self_attn.q_proj.weight", "self_attn.k_proj.weight")):
            n = heads if "q_proj" in key else kv_heads
            # llama.cpp rotates interleaved pairs: row 2j of a head is dimension j, row 2j+1 is j + head_dim/2
            tensor = np.ascontiguousarray(tensor.reshape(n, 2, head_dim // 2, -1).swapaxes(1, 2).reshape(tensor.shape))
        writer.add_tensor(target, tensor)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(out), arch


def _gguf_name(key: str, renames: Mapping, arch: str) -> str | None:
    import re

    for pattern, target in renames.items():
        m = re.fullmatch(re.escape(pattern).replace(re.escape("{i}"), r"(\d+)"), key)
        if m is None:
            continue
        if isinstance(target, Mapping):
            target = target.get(arch, target.get("*"))
        return target.replace("{i}", m.group(1)) if m.groups() else target
    return None


# --- running llama.cpp with the eval callback ----------------------------------------------------------


class _GgmlTensor(ctypes.Structure):
    """``struct ggml_tensor`` of ggml.h (GGML_MAX_DIMS 4, GGML_MAX_OP_PARAMS 64, GGML_MAX_SRC 10,
    GGML_MAX_NAME 64), as far as the callback reads it."""

    _fields_ = [
        ("type", ctypes.c_int),
        ("buffer", ctypes.c_void_p),
        ("ne", ctypes.c_int64 * 4),
        ("nb", ctypes.c_size_t * 4),
        ("op", ctypes.c_int),
        ("op_params", ctypes.c_int32 * 16),
        ("flags", ctypes.c_int32),
        ("src", ctypes.c_void_p * 10),
        ("view_src", ctypes.c_void_p),
        ("view_offs", ctypes.c_size_t),
        ("data", ctypes.c_void_p),
        ("name", ctypes.c_char * 64),
        ("extra", ctypes.c_void_p),
        ("padding", ctypes.c_char * 8),
    ]


def _llama():
    try:
        import llama_cpp
        import llama_cpp.llama_cpp as lib
    except (ImportError, OSError, RuntimeError) as e:
        raise RuntimeMissing(
            f"the llama.cpp adapter needs llama-cpp-python ({e}): pip install 'parity[llama-cpp]' (it builds "
            "llama.cpp from source: allow about 45 minutes on 2 cores)"
        ) from None
    return llama_cpp, lib


def _ggml_base(lib) -> ctypes.CDLL:
    """ggml's base library next to libllama (``ggml_backend_tensor_get``, ``ggml_nbytes``)."""
    base = Path(getattr(lib, "_base_path", Path(lib.__file__).parent / "lib"))
    found = sorted(glob.glob(str(base / "*ggml-base*"))) + sorted(glob.glob(str(base / "*ggml*")))
    for candidate in found:
        try:
            dll = ctypes.CDLL(candidate)
            dll.ggml_backend_tensor_get  # noqa: B018 (present?)
        except (OSError, AttributeError):
            continue
        dll.ggml_backend_tensor_get.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t]
        dll.ggml_backend_tensor_get.restype = None
        dll.ggml_nbytes.argtypes = [ctypes.c_void_p]
        dll.ggml_nbytes.restype = ctypes.c_size_t
        return dll
    raise RuntimeMissing(f"ggml's base library (ggml_backend_tensor_get) is not beside libllama in {base}")


def _read(ggml, pointer: int, t: _GgmlTensor) -> np.ndarray | None:
    """The tensor's values as a numpy array in numpy's axis order (ggml's ``ne`` reversed, trailing
    axes of size 1 dropped), float32; None for a type the callback does not read (quantized)."""
    dtypes = {GGML_F32: np.float32, GGML_F16: np.float16, GGML_BF16: np.uint16}
    if t.type not in dtypes or not t.data:
        return None
    dims = max((d + 1 for d in range(4) if t.ne[d] > 1), default=1)
    nbytes = ggml.ggml_nbytes(pointer)
    raw = (ctypes.c_uint8 * nbytes)()
    ggml.ggml_backend_tensor_get(pointer, raw, 0, nbytes)
    flat = np.frombuffer(raw, dtype=dtypes[t.type])
    itemsize = flat.itemsize
    shape = tuple(int(t.ne[d]) for d in reversed(range(dims)))
    strides = tuple(int(t.nb[d]) for d in reversed(range(dims)))
    array = np.lib.stride_tricks.as_strided(flat, shape=shape, strides=strides).copy()
    if t.type == GGML_BF16:
        array = (array.astype(np.uint32) << 16).view(np.float32)
    del itemsize
    return array.astype(np.float32)


def capture(
    model_path,
    rows: list[np.ndarray],
    wanted,
    *,
    flash_attn: bool = False,
    cache_type: str = "f32",
    n_threads: int | None = None,
) -> list[dict[str, np.ndarray]]:
    """Run a GGUF model on each row of token ids (one sequence each, one micro-batch, every token an
    output) and read every computed tensor whose name ``wanted(name)`` accepts: per row, ``{name:
    array}`` with a name's later writes as ``name#1``, ``name#2``... Raises ParityError (load or
    decode failure) or RuntimeMissing."""
    _, lib = _llama()
    ggml = _ggml_base(lib)
    if cache_type not in CACHE_TYPES:
        raise ParityError(f"cache type {cache_type!r} is not one of {', '.join(CACHE_TYPES)}")
    lib.llama_backend_init()
    quiet = lib.llama_log_callback(lambda level, text, data: None)
    lib.llama_log_set(quiet, ctypes.c_void_p())
    mparams = lib.llama_model_default_params()
    mparams.n_gpu_layers = 0
    model = lib.llama_model_load_from_file(str(model_path).encode(), mparams)
    if not model:
        raise ParityError(f"llama.cpp cannot load {model_path}")
    out: list[dict[str, np.ndarray]] = []
    try:
        for tokens in rows:
            n = len(tokens)
            seen: dict[str, int] = {}
            values: dict[str, np.ndarray] = {}

            def callback(pointer, ask, user_data, seen=seen, values=values):
                t = _GgmlTensor.from_address(pointer)
                name = t.name.decode("utf-8", "replace")
                if ask:
                    return bool(wanted(name))
                if wanted(name):
                    array = _read(ggml, pointer, t)
                    if array is not None:
                        k = seen.get(name, 0)
                        seen[name] = k + 1
                        values[name if k == 0 else f"{name}#{k}"] = array
                return True

            cb = lib.ggml_backend_sched_eval_callback(callback)
            cparams = lib.llama_context_default_params()
            cparams.n_ctx = max(n, 16)
            cparams.n_batch = cparams.n_ubatch = max(n, 1)
            cparams.n_seq_max = 1
            cparams.n_threads = cparams.n_threads_batch = n_threads or min(4, os.cpu_count() or 1)
            cparams.type_k = cparams.type_v = CACHE_TYPES[cache_type]
            cparams.flash_attn_type = 1 if flash_attn else 0
            cparams.cb_eval = cb
            cparams.cb_eval_user_data = None
            cparams.no_perf = True
            ctx = lib.llama_init_from_model(model, cparams)
            if not ctx:
                raise ParityError(f"llama.cpp cannot create a context for {model_path}")
            batch = lib.llama_batch_init(n, 0, 1)
            try:
                for i, token in enumerate(tokens):
                    batch.token[i] = int(token)
                    batch.pos[i] = i
                    batch.n_seq_id[i] = 1
                    batch.seq_id[i][0] = 0
                    batch.logits[i] = 1
                batch.n_tokens = n
                code = lib.llama_decode(ctx, batch)
                if code != 0:
                    raise ParityError(f"llama_decode failed with code {code} on {model_path}")
            finally:
                lib.llama_batch_free(batch)
                lib.llama_free(ctx)
            out.append(values)
    finally:
        lib.llama_model_free(model)
    return out


def gguf_facts(path) -> tuple[str, list[str]]:
    """``(architecture, precision notes)`` read from a GGUF's header: the weights' types when not float32."""
    try:
        import gguf
    except ImportError:
        raise RuntimeMissing("reading a GGUF needs the gguf package: pip install 'parity[llama-cpp]'") from None
    reader = gguf.GGUFReader(str(path))
    field = reader.fields.get("general.architecture")
    if field is None:
        raise ParityError(f"{path} has no general.architecture: not a llama.cpp model")
    arch = bytes(field.parts[field.data[0]]).decode()
    types: dict[str, int] = {}
    for t in reader.tensors:
        if len(t.shape) >= 2:
            types[t.tensor_type.name] = types.get(t.tensor_type.name, 0) + 1
    notes = []
    lossy = {k: v for k, v in types.items() if k != "F32"}
    if lossy:
        shown = ", ".join(f"{v} {k}" for k, v in sorted(lossy.items()))
        quantized = [k for k in lossy if k not in ("F16", "BF16")]
        notes.append(
            f"the GGUF's matrices are not all float32 ({shown} of {sum(types.values())})"
            + (
                ": llama.cpp's quantized matmuls also quantize their activations (8-bit), so expect the first "
                "differences at the projections (q_proj, k_proj, v_proj) and after"
                if quantized
                else ": expect rounding from the first projection on"
            )
        )
    return arch, notes


def _wanted(rules) -> set[str]:
    return {r.runtime for r in rules}


def run(
    model,
    trace,
    *,
    flash_attn: bool = False,
    cache_type: str = "f32",
    config_changes: Mapping | None = None,
    raw: bool = False,
) -> tuple[dict[str, np.ndarray], dict, list[str], dict | None]:
    """Run ``model`` (a ``.gguf`` file, or a Transformers checkpoint folder written as a float32 GGUF
    first) on the trace's inputs: ``(tensors, unavailable: node glob -> reason, notes, name map)``.
    ``raw``: the tensors under llama.cpp's own names with the name map to read them (a trace of one
    unpadded row), else under node names."""
    import re

    from parity.golden.dumps import read_name_map
    from parity.golden.verdict import node_sizes

    probe = probe_of(trace)
    model = Path(model).expanduser()
    notes: list[str] = []
    with tempfile.TemporaryDirectory(prefix="parity-gguf-") as tmp:
        if model.is_dir():
            path, _ = write_gguf(model, Path(tmp) / "model-f32.gguf", config_changes=config_changes)
            notes.append(f"{model} was written as a float32 GGUF by parity (parity.runtimes.llama_cpp.write_gguf)")
            for key, value in (config_changes or {}).items():
                notes.append(f"config changed for this run: {key} = {value!r}")
        else:
            if config_changes:
                raise ParityError("config changes apply to a checkpoint folder the adapter converts, not to a .gguf")
            path = model
        arch, precision = gguf_facts(path)
        notes += precision
        table = dict(name_map(arch))
        rules = read_name_map(table)
        unavailable = dict(rules.unavailable)
        if flash_attn:
            unavailable.update({"*.self_attn.scores": FLASH_REASON, "*.self_attn.probs": FLASH_REASON})
            notes.append(
                "flash attention on: ggml_flash_attn_ext casts float32 K and V to F16 (expect rounding near 1e-3 "
                "from context on)"
            )
        if cache_type != "f32":
            notes.append(
                f"KV cache in {cache_type.upper()}: keys and values are rounded when stored (expect differences from "
                "scores/context on; per-node --tolerance keeps the rest tight)"
            )
        bases = _wanted(rules.rules)
        pattern = re.compile(
            "^(" + "|".join(re.escape(b).replace(re.escape("{i}"), r"\d+") for b in sorted(bases)) + ")$"
        )
        rows = probe.rows()
        per_row = capture(path, rows, pattern.match, flash_attn=flash_attn, cache_type=cache_type)
    notes.insert(0, f"GGUF architecture {arch}: llama.cpp's tensor names read through its name map")
    if raw:
        if probe.batch != 1 or probe.mask is not None:
            raise ParityError("a raw dump holds one unpadded row: record the trace with --batch 1")
        return per_row[0], unavailable, notes, table
    from parity.golden.dumps import map_dump

    sizes = node_sizes(probe.trace)
    kinds = {n["name"]: n.get("kind", "") for n in probe.nodes}
    shapes: dict[str, tuple[int, ...] | None] = {n["name"]: None for n in probe.nodes}
    mapped = []
    for tokens, values in zip(rows, per_row):
        n = len(tokens)
        tensors, _, _ = map_dump(
            {k: _torch(v) for k, v in values.items()},
            rules.rules,
            shapes,
            lambda node, n=n: {**sizes(node), "seq": n, "batch": 1},
        )
        mapped.append({k: v.unsqueeze(0).numpy() for k, v in tensors.items()})
    return assemble(probe, mapped, kinds), unavailable, notes, None


def _torch(array: np.ndarray):
    import torch

    return torch.from_numpy(np.ascontiguousarray(array))


def versions() -> str:
    llama_cpp, _ = _llama()
    return f"llama.cpp through llama-cpp-python {llama_cpp.__version__}"


def dump(
    model,
    trace,
    out,
    *,
    flash_attn: bool = False,
    cache_type: str = "f32",
    config_changes: Mapping | None = None,
    raw: bool = False,
) -> Path:
    """Run ``model`` (a GGUF, or a checkpoint folder such as a trace's ``weights/``) with llama.cpp on
    ``trace``'s inputs and write the dump folder ``out`` for ``parity compare TRACE --dump OUT``
    (``raw``: llama.cpp's own names, with the name map in ``parity-dump.json``). Raises ParityError
    (RuntimeMissing when llama-cpp-python is not installed)."""
    check_out(out)
    tensors, unavailable, notes, table = run(
        model, trace, flash_attn=flash_attn, cache_type=cache_type, config_changes=config_changes, raw=raw
    )
    settings = f"cache {cache_type}, flash attention {'on' if flash_attn else 'off'}"
    return write_dump(
        out,
        tensors,
        runtime=f"{versions()} ({settings})",
        name_map=table,
        unavailable=unavailable,
        notes=notes,
    )
