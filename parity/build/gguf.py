"""Read a GGUF checkpoint (llama.cpp's single-file format) through Transformers' own GGUF support.

``--checkpoint model.gguf``, or a folder holding exactly one ``.gguf`` (and no ``config.json``): the
file's header is read first (no tensor data) to refuse, in one line, what cannot be checked: a file
that is not GGUF, an architecture Transformers does not read, an architecture of another family, a
tensor stored in a quantization type the installed ``gguf`` package cannot dequantize. Then
``AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=dtype)`` dequantizes every tensor
to the run's dtype, exactly as a Transformers user of that file gets it; its state dict (tied tensors
once) and its config become a :class:`~parity.build.checkpoint.Checkpoint`, and the Transformers model
that held them is dropped: both models of the pair then wrap that one dequantized copy.

GGUF stores float hyperparameters as float32: ``rms_norm_eps`` 1e-6 arrives as 9.99999997e-07. Such
values are kept (both models use what the file says, as Transformers does) and each is named in a
note (:func:`float32_config_notes`).

The file's embedded tokenizer is saved once per file (:func:`gguf_tokenizer`) as a Transformers
tokenizer folder, for ``--prompt``.

Needs the ``gguf`` package: ``pip install 'parity[gguf]'``.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import warnings
from pathlib import Path

import torch

from parity.build.checkpoint import Checkpoint, unreachable
from parity.util.errors import CheckpointError
from parity.util.resources import gib, require

SUFFIX = ".gguf"
#: float element bytes of the plain types (dequantized or not: their values are read as they are)
_PLAIN = {"F32", "F16", "BF16", "F64", "I8", "I16", "I32", "I64"}


def gguf_file(checkpoint: str | Path) -> Path | None:
    """The GGUF file ``checkpoint`` names: the file itself, or the one ``.gguf`` in a folder that holds
    no ``config.json``; None when ``checkpoint`` is a Transformers-format folder (or missing: the
    safetensors reader names that).

    Raises:
        CheckpointError: a folder without config.json holding several ``.gguf`` files (which one is meant).
    """
    path = Path(checkpoint)
    if path.is_file() and path.name.lower().endswith(SUFFIX):
        return path
    if not path.is_dir() or (path / "config.json").exists():
        return None
    try:
        found = sorted(p for p in path.iterdir() if p.name.lower().endswith(SUFFIX) and p.is_file())
    except OSError:  # an unreadable folder: the safetensors reader names the problem
        return None
    if len(found) > 1:
        raise CheckpointError(
            f"{path} holds {len(found)} GGUF files ({', '.join(p.name for p in found)}): pass the one to check "
            "with --checkpoint FILE.gguf"
        )
    return found[0] if found else None


def _require_gguf_package() -> None:
    try:
        import gguf  # noqa: F401
    except ImportError:
        raise CheckpointError("reading a GGUF checkpoint needs the gguf package: pip install 'parity[gguf]'") from None


def _model_types(architecture: str) -> set[str]:
    """The Transformers model_types a GGUF ``general.architecture`` can load as (Transformers renames a
    few: gemma3 -> gemma3_text, qwen3moe -> qwen3_moe; a llama file may be a Mistral)."""
    names = {architecture, f"{architecture}_text", architecture.replace("moe", "_moe"), architecture.replace("-", "_")}
    if architecture == "llama":
        names.add("mistral")
    return names


def read_header(path: Path) -> tuple[dict, dict[str, str]]:
    """``(metadata, {tensor name: ggml type name})`` of a GGUF file, without its tensor data or its
    tokenizer's string arrays (Transformers' own header reader).

    Raises:
        CheckpointError: not a GGUF file (or a GGUF version Transformers does not read), or truncated.
    """
    from gguf import GGMLQuantizationType
    from transformers.integrations.gguf.reader import _mapped, _read_metadata, _read_tensor_table

    try:
        blob = _mapped(str(path))
        metadata, count, pos = _read_metadata(blob, str(path))
        entries, _ = _read_tensor_table(blob, count, pos)
    except ValueError as e:
        raise CheckpointError(str(e).splitlines()[0]) from None
    except (IndexError, OSError) as e:  # struct.error is a subclass of neither; caught below
        raise CheckpointError(f"{path} is corrupt or truncated: {e}") from None
    except Exception as e:
        if type(e).__name__ == "error":  # struct.error: the header runs past the end of the file
            raise CheckpointError(f"{path} is corrupt or truncated: {e}") from None
        raise
    types = {}
    for name, _shape, ggml_type, _offset in entries:
        try:
            types[name] = GGMLQuantizationType(ggml_type).name
        except ValueError:
            types[name] = f"ggml type {ggml_type}"
    return metadata, types


def unreadable_types(types: dict[str, str]) -> dict[str, list[str]]:
    """``{type name: [tensor, ...]}`` of the quantization types the installed ``gguf`` package cannot
    dequantize (what Transformers' GGUF loader calls per tensor): tried on one zero block of each type."""
    import numpy as np
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, dequantize

    readable: dict[str, bool] = {}
    for type_name in set(types.values()):
        if type_name in _PLAIN:
            readable[type_name] = True
            continue
        try:
            qtype = GGMLQuantizationType[type_name]
            _block, nbytes = GGML_QUANT_SIZES[qtype]
            dequantize(np.zeros((1, nbytes), dtype=np.uint8), qtype)
            readable[type_name] = True
        except (KeyError, NotImplementedError, ValueError):
            readable[type_name] = False
    out: dict[str, list[str]] = {}
    for tensor, type_name in types.items():
        if not readable[type_name]:
            out.setdefault(type_name, []).append(tensor)
    return out


def inspect(path: Path, model_types: tuple[str, ...]) -> tuple[dict, dict[str, str]]:
    """Refuse, in one line and before any tensor is read, a GGUF this family cannot check.

    Raises:
        CheckpointError: not GGUF; an architecture Transformers does not read, or of another family than
            ``model_types``; tensors of a quantization type that cannot be dequantized (named, with a tensor).
    """
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    metadata, types = read_header(path)
    architecture = str(metadata.get("general.architecture"))
    readable_arch = architecture in GGUF_SUPPORTED_ARCHITECTURES or bool(
        _model_types(architecture) & set(GGUF_SUPPORTED_ARCHITECTURES)
    )
    if not readable_arch:
        raise CheckpointError(
            f"{path} is a GGUF of architecture {architecture!r}, which Transformers' GGUF loader does not read"
        )
    if model_types and not _model_types(architecture) & set(model_types):
        raise CheckpointError(
            f"{path} is a GGUF of architecture {architecture!r}, expected {' or '.join(map(repr, model_types))}"
        )
    bad = unreadable_types(types)
    if bad:
        shown = "; ".join(f"{t} ({len(ts)} tensors, e.g. {ts[0]})" for t, ts in sorted(bad.items()))
        raise CheckpointError(
            f"{path} stores tensors in a quantization type Transformers' GGUF loader cannot dequantize: {shown}"
        )
    return metadata, types


def _elements(path: Path) -> int:
    from transformers.integrations.gguf.reader import _mapped, _read_metadata, _read_tensor_table

    blob = _mapped(str(path))
    _metadata, count, pos = _read_metadata(blob, str(path))
    entries, _ = _read_tensor_table(blob, count, pos)
    return sum(math.prod(shape) for _name, shape, *_ in entries)


def float32_config_notes(config: dict) -> list[str]:
    """One line per float in ``config`` that is a float32 rounding of a shorter decimal (``rms_norm_eps``
    9.999999974752427e-07 for 1e-06): GGUF stores float hyperparameters as float32."""
    import numpy as np

    notes = []

    def visit(prefix: str, value) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                visit(f"{prefix}.{k}" if prefix else str(k), v)
        elif isinstance(value, float) and math.isfinite(value) and value != 0:
            short = str(np.float32(value))  # the shortest decimal that rounds to this float32
            if float(np.float32(value)) == value and float(short) != value:
                notes.append(
                    f"config {prefix} is {value!r} in the GGUF, the float32 rounding of {short} (GGUF stores "
                    "float hyperparameters as float32): both models use the file's value, as Transformers does"
                )

    visit("", config)
    return notes


def read_gguf(path: Path, dtype: torch.dtype, model_types: tuple[str, ...]) -> tuple[Checkpoint, list[str]]:
    """The GGUF at ``path`` dequantized to ``dtype`` by Transformers, as a Checkpoint (config dict of the
    model Transformers builds for it, state dict in that model's naming, tied tensors once), and the
    line saying what was done (the types dequantized); the float32 config values are the Checkpoint's notes.

    Raises:
        CheckpointError: as :func:`inspect`; the gguf package missing; Transformers failing to load it.
        ParityError: the dequantized weights would not fit in the available memory.
    """
    _require_gguf_package()
    problem = unreachable(path, "checkpoint file")
    if problem:
        raise CheckpointError(problem)
    _metadata, types = inspect(path, model_types)
    elements = _elements(path)
    element = torch.finfo(dtype).bits // 8
    # the dequantized copy in dtype, plus one tensor's float32 numpy copies while it is converted
    require(
        elements * element, f"GGUF {path} dequantized to {str(dtype).replace('torch.', '')}", "check a smaller model"
    )
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype)
    except (ValueError, NotImplementedError, KeyError, OSError) as e:
        raise CheckpointError(f"Transformers cannot load the GGUF {path}: {str(e).splitlines()[0]}") from None
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()
    config = model.config.to_dict()
    state_dict: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for key, tensor in model.state_dict().items():
        ptr = tensor.untyped_storage().data_ptr()
        if ptr in seen:  # a tied copy (lm_head.weight of a tied embedding): a checkpoint holds it once
            continue
        seen.add(ptr)
        state_dict[key] = tensor
    del model
    counts: dict[str, int] = {}
    for type_name in types.values():
        counts[type_name] = counts.get(type_name, 0) + 1
    lines = [
        f"GGUF {path.name} ({', '.join(f'{n} {t}' for t, n in sorted(counts.items()))} tensors): dequantized to "
        f"{str(dtype).replace('torch.', '')} by Transformers' GGUF loader ({gib(elements * element)}), one copy "
        "shared by both models"
    ]
    return Checkpoint(path, config, state_dict, [path], notes=float32_config_notes(config)), lines


def _cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "parity" / "gguf-tokenizers"


def file_hash(path: Path) -> str:
    """SHA-256 of a file, read in 1 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def gguf_tokenizer(checkpoint: str | Path, cache: str | Path | None = None) -> Path:
    """A Transformers tokenizer folder holding the tokenizer embedded in the GGUF ``checkpoint`` (a
    ``.gguf`` file or a folder holding one): converted once by ``AutoTokenizer.from_pretrained(folder,
    gguf_file=...)`` and saved under ``cache`` (default ``~/.cache/parity/gguf-tokenizers``), keyed by
    the file's SHA-256, so ``AutoTokenizer.from_pretrained(returned folder)`` loads it in a moment.

    Raises:
        CheckpointError: ``checkpoint`` is no GGUF; it embeds no tokenizer; the gguf package is missing.
    """
    _require_gguf_package()
    path = gguf_file(checkpoint)
    if path is None:
        raise CheckpointError(f"{checkpoint} is not a GGUF file or a folder holding one")
    folder = Path(cache) if cache is not None else _cache_root()
    target = folder / file_hash(path)[:32]
    if (target / "tokenizer_config.json").is_file():
        return target
    from transformers import AutoTokenizer

    previous = logging.getLogger("transformers").level
    try:
        logging.getLogger("transformers").setLevel(logging.ERROR)
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except (ValueError, KeyError, OSError) as e:
        raise CheckpointError(
            f"the GGUF {path} has no tokenizer Transformers can read: {str(e).splitlines()[0]}"
        ) from None
    finally:
        logging.getLogger("transformers").setLevel(previous)
    from parity.util.files import discard, staging_folder

    staging = staging_folder(folder)  # live: removed on SIGTERM, swept when a killed run left it
    try:
        tokenizer.save_pretrained(str(staging))
        os.replace(staging, target)  # atomic: a reader sees no folder or a whole one
    except OSError:
        if not (target / "tokenizer_config.json").is_file():
            raise
    finally:
        discard(staging)
    return target
