"""Real text as a check's input: prompts tokenized with the checkpoint's own tokenizer, or token ids
from a file, padded into batches with their attention mask.

One module serves :func:`parity.check`, :func:`parity.check_model`, ``parity record`` and the
command line, so a prompt is tokenized the same way wherever it is given. The tokenizer is the one
saved with the checkpoint (``AutoTokenizer.from_pretrained(folder, trust_remote_code=False)``):
one that needs remote code, or fails to load, is refused in one line. The BOS token is whatever
the tokenizer adds, and :attr:`TextInputs.bos` says what that was (a BOS added twice, by the chat
template and again by the tokenizer, is said too).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from parity.util.errors import ParityError
from parity.util.text import one_line

if TYPE_CHECKING:  # options are checked before torch loads: torch is imported where a tensor is made
    import torch

#: files one of which a folder holding a Transformers tokenizer has
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model")
#: how to pass token ids instead, said wherever no tokenizer is found
IDS_ADVICE = "pass token ids instead: --input-ids FILE (a JSON list of lists of ints), or input_ids= in Python"


@dataclass(frozen=True)
class Prompt:
    """One row of a prompt set: its text (None for ids given as such), token ids and the decoded
    piece of each id (empty strings without a tokenizer)."""

    index: int
    text: str | None
    ids: tuple[int, ...]
    pieces: tuple[str, ...]

    def to_dict(self) -> dict:
        return {"index": self.index, "text": self.text, "ids": list(self.ids), "pieces": list(self.pieces)}


@dataclass(frozen=True)
class TextInputs:
    """A tokenized prompt set: the rows, where they came from, what the tokenizer did with BOS, and
    how rows are padded (``pad_id`` on ``padding_side``; the mask is 0 there)."""

    prompts: tuple[Prompt, ...]
    source: str
    bos: str
    chat: bool
    pad_id: int
    padding_side: str

    def batches(
        self, size: int, side: str | None = None
    ) -> list[tuple[list[Prompt], torch.Tensor, torch.Tensor | None]]:
        """``size`` prompts at a time: ``(prompts, input_ids (batch, longest) int64, attention_mask or
        None when no row is padded)``, padded on ``side`` (default the tokenizer's)."""
        import torch

        side = side or self.padding_side
        out = []
        for start in range(0, len(self.prompts), size):
            rows = list(self.prompts[start : start + size])
            longest = max(len(p.ids) for p in rows)
            ids = torch.full((len(rows), longest), self.pad_id, dtype=torch.int64)
            mask = torch.zeros((len(rows), longest), dtype=torch.int64)
            for r, p in enumerate(rows):
                n = len(p.ids)
                span = slice(longest - n, longest) if side == "left" else slice(0, n)
                ids[r, span] = torch.tensor(p.ids, dtype=torch.int64)
                mask[r, span] = 1
            out.append((rows, ids, None if bool(mask.all()) else mask))
        return out

    def to_dict(self) -> dict:
        return {
            "source": self.source,
            "bos": self.bos,
            "chat": self.chat,
            "pad_id": self.pad_id,
            "padding_side": self.padding_side,
        }


def read_prompts_file(path: str | Path) -> tuple:
    """``--prompts FILE``: one prompt per non-empty line, or JSONL (the first non-empty line starts
    with ``{``) whose objects hold ``text`` (a string) or ``messages`` (a list of ``{"role",
    "content"}``, for the chat template). Returns a tuple of strings and message tuples. Raises
    ParityError naming the file and line."""
    p = Path(path).expanduser()
    try:
        lines = p.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise ParityError(f"--prompts {path}: {getattr(e, 'strerror', None) or one_line(e)}") from None
    numbered = [(i + 1, line) for i, line in enumerate(lines) if line.strip()]
    if not numbered:
        raise ParityError(f"--prompts {path} holds no prompt (one per line, or JSONL with text or messages)")
    if not numbered[0][1].lstrip().startswith("{"):
        return tuple(line for _, line in numbered)
    out: list = []
    for number, line in numbered:
        try:
            item = json.loads(line)
        except json.JSONDecodeError as e:
            raise ParityError(f"--prompts {path} line {number}: not JSON ({e.msg})") from None
        if not isinstance(item, dict) or not ("text" in item or "messages" in item):
            raise ParityError(f"--prompts {path} line {number}: a JSON object with a text or messages field is needed")
        try:
            out.append(prompt_item(item["text"] if "text" in item else item["messages"]))
        except ParityError as e:
            raise ParityError(f"--prompts {path} line {number}: {e}") from None
    return tuple(out)


def prompt_item(item) -> str | tuple:
    """A prompt as an option holds it: a string, or a tuple of ``{"role", "content"}`` messages."""
    if isinstance(item, str):
        if not item:
            raise ParityError("a prompt is an empty string")
        return item
    if isinstance(item, Sequence) and item and all(isinstance(m, Mapping) for m in item):
        for m in item:
            if not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise ParityError("each message needs a string role and a string content")
        return tuple(dict(m) for m in item)
    raise ParityError(f"a prompt is a string or a list of {{role, content}} messages, got {type(item).__name__}")


def read_ids_file(path: str | Path) -> tuple[tuple[int, ...], ...]:
    """``--input-ids FILE``: a JSON list of lists of non-negative ints (one list per prompt, any
    lengths). Raises ParityError in one line."""
    p = Path(path).expanduser()
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as e:
        raise ParityError(f"--input-ids {path}: {getattr(e, 'strerror', None) or one_line(e)}") from None
    except json.JSONDecodeError as e:
        raise ParityError(f"--input-ids {path}: not JSON ({e.msg}, line {e.lineno})") from None
    try:
        return id_rows(data)
    except ParityError as e:
        raise ParityError(f"--input-ids {path}: {e}") from None


def id_rows(data) -> tuple[tuple[int, ...], ...]:
    """Rows of token ids: a list of lists of ints >= 0, none empty. Raises ParityError."""
    if hasattr(data, "tolist") and hasattr(data, "dim"):  # a torch tensor
        if data.dim() != 2 or data.is_floating_point() or data.is_complex():
            raise ParityError(f"token ids must be an integer tensor (batch, seq), got shape {tuple(data.shape)}")
        data = data.tolist()
    if not isinstance(data, (list, tuple)) or not data or not all(isinstance(r, (list, tuple)) for r in data):
        raise ParityError("token ids must be a list of lists of ints, one list per prompt, e.g. [[2, 651, 6037]]")
    for i, row in enumerate(data):
        if not row:
            raise ParityError(f"row {i} of the token ids is empty")
        bad = next((v for v in row if isinstance(v, bool) or not isinstance(v, int) or v < 0), None)
        if bad is not None:
            raise ParityError(f"row {i} of the token ids holds {bad!r}: token ids are integers >= 0")
    return tuple(tuple(int(v) for v in row) for row in data)


def tokenizer_folder(checkpoint: str | Path | None) -> str | Path | None:
    """Where a checkpoint's tokenizer is: its folder, or for a GGUF checkpoint (a ``.gguf`` file or a
    folder holding one) the folder its embedded tokenizer is converted to
    (:func:`parity.build.gguf.gguf_tokenizer`). Raises ParityError for a GGUF without a readable tokenizer."""
    if checkpoint is None:
        return None
    try:
        from parity.build.gguf import gguf_file, gguf_tokenizer
    except ImportError:  # GGUF support not installed in this tree
        return checkpoint
    return gguf_tokenizer(checkpoint) if gguf_file(checkpoint) is not None else checkpoint


def has_tokenizer(folder: str | Path | None) -> bool:
    return folder is not None and Path(folder).is_dir() and any((Path(folder) / f).exists() for f in TOKENIZER_FILES)


def load_tokenizer(folder: str | Path | None, what: str = "the reference"):
    """The checkpoint's tokenizer, without remote code. Raises ParityError (one line) when there is
    none, when it needs remote code, or when it fails to load, saying how to pass ids instead."""
    if folder is None:
        raise ParityError(f"{what} has no tokenizer (random weights from a config, no checkpoint folder); {IDS_ADVICE}")
    if not has_tokenizer(folder):
        raise ParityError(f"no tokenizer in {folder} (none of {', '.join(TOKENIZER_FILES)}); {IDS_ADVICE}")
    config = Path(folder) / "tokenizer_config.json"
    try:
        auto_map = json.loads(config.read_text(encoding="utf-8")).get("auto_map") if config.is_file() else None
    except (OSError, ValueError, AttributeError):
        auto_map = None
    if auto_map:
        raise ParityError(
            f"the tokenizer in {folder} needs remote code (auto_map in tokenizer_config.json), which parity never "
            f"runs; {IDS_ADVICE}"
        )
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(folder), trust_remote_code=False)
    except Exception as e:  # a broken or foreign tokenizer file: bad input, named in one line
        reason = one_line(e)[:300]
        if "trust_remote_code" in reason:
            reason = "it needs remote code, which parity never runs"
        raise ParityError(f"the tokenizer in {folder} cannot be loaded: {reason}; {IDS_ADVICE}") from None


def _piece(tokenizer, token_id: int) -> str:
    if tokenizer is None:
        return ""
    try:
        return tokenizer.decode([token_id])
    except Exception:  # an id the tokenizer has no piece for (outside its vocabulary)
        return ""


def _bos_line(tokenizer, rows: Sequence[tuple[int, ...]], chat: bool) -> str:
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return "the tokenizer has no BOS token; none is added"
    name = tokenizer.bos_token
    starts = sum(1 for r in rows if r and r[0] == bos)
    twice = sum(1 for r in rows if len(r) > 1 and r[0] == bos and r[1] == bos)
    how = "the chat template and the tokenizer" if chat else "the tokenizer"
    if twice:
        return f"BOS {name!r} (id {bos}) appears twice at the start of {twice} of {len(rows)} prompts ({how})"
    if starts == len(rows):
        return f"BOS {name!r} (id {bos}) added by {how} at the start of every prompt"
    if starts == 0:
        return f"no BOS: {how} adds none ({name!r}, id {bos}, is not at the start of any prompt)"
    return f"BOS {name!r} (id {bos}) at the start of {starts} of {len(rows)} prompts"


def tokenize(
    prompts: Sequence,
    tokenizer_folder: str | Path | None,
    *,
    chat: bool = False,
    what: str = "the reference",
) -> TextInputs:
    """Tokenize ``prompts`` (strings, or message lists) with the tokenizer in ``tokenizer_folder``;
    ``chat``: through its chat template (with the generation prompt), one line when it has none
    (message lists always go through it). Raises ParityError."""
    tokenizer = load_tokenizer(tokenizer_folder, what)
    templated = chat or any(not isinstance(p, str) for p in prompts)
    if templated and not getattr(tokenizer, "chat_template", None):
        raise ParityError(
            f"the tokenizer in {tokenizer_folder} has no chat template"
            + (" (--chat)" if chat else " (a prompt given as messages needs one)")
            + "; drop --chat and give plain text"
        )
    rows: list[tuple[int, ...]] = []
    texts: list[str] = []
    for p in prompts:
        if templated:
            messages = [{"role": "user", "content": p}] if isinstance(p, str) else [dict(m) for m in p]
            try:
                text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            except Exception as e:
                raise ParityError(f"the chat template of {tokenizer_folder} failed: {one_line(e)[:300]}") from None
            ids = tokenizer(text, add_special_tokens=True)["input_ids"]
        else:
            text = p
            ids = tokenizer(p, add_special_tokens=True)["input_ids"]
        if not ids:
            raise ParityError(f"prompt {len(rows)} ({text[:40]!r}) gives no token")
        rows.append(tuple(int(i) for i in ids))
        texts.append(text)
    side = getattr(tokenizer, "padding_side", "right") or "right"
    pad = _pad_id(tokenizer)
    return TextInputs(
        prompts=tuple(
            Prompt(i, t, r, tuple(_piece(tokenizer, v) for v in r)) for i, (t, r) in enumerate(zip(texts, rows))
        ),
        source=f"tokenizer of {tokenizer_folder} ({type(tokenizer).__name__})",
        bos=_bos_line(tokenizer, rows, templated),
        chat=templated,
        pad_id=pad,
        padding_side=side,
    )


def _pad_id(tokenizer) -> int:
    for name in ("pad_token_id", "eos_token_id", "unk_token_id"):
        value = getattr(tokenizer, name, None)
        if isinstance(value, int):
            return value
    return 0


def given_ids(rows: Sequence[Sequence[int]], tokenizer_folder: str | Path | None, source: str) -> TextInputs:
    """Token ids given as such, their pieces decoded where the checkpoint has a tokenizer that loads
    (none needed); padded on the left, with id 0 where no tokenizer names a pad token."""
    tokenizer = None
    if has_tokenizer(tokenizer_folder):
        try:
            tokenizer = load_tokenizer(tokenizer_folder)
        except ParityError:
            tokenizer = None
    rows = id_rows(rows)
    return TextInputs(
        prompts=tuple(Prompt(i, None, r, tuple(_piece(tokenizer, v) for v in r)) for i, r in enumerate(rows)),
        source=source,
        bos="token ids given as such: BOS is whatever they hold"
        + (
            f" (the tokenizer's BOS {tokenizer.bos_token!r} is id {tokenizer.bos_token_id})"
            if tokenizer is not None and getattr(tokenizer, "bos_token_id", None) is not None
            else ""
        ),
        chat=False,
        pad_id=_pad_id(tokenizer) if tokenizer is not None else 0,
        padding_side="left",
    )


def check_fits(inputs: TextInputs, vocab_size: int, max_positions: int | None, extra: int = 0) -> None:
    """Every prompt's ids in ``[0, vocab_size)`` and, with the ``extra`` decode steps, within the
    model's ``max_positions``. Raises ParityError naming the prompt."""
    for p in inputs.prompts:
        bad = [v for v in p.ids if v >= vocab_size]
        if bad:
            raise ParityError(
                f"prompt {p.index} holds token id {bad[0]}, outside the model's vocabulary of {vocab_size} "
                "(a tokenizer of another model?)"
            )
        if max_positions and len(p.ids) + extra > max_positions:
            steps = f" plus {extra} decode steps" if extra else ""
            raise ParityError(
                f"prompt {p.index} is {len(p.ids)} tokens{steps}, longer than the model's {max_positions} positions "
                "(max_position_embeddings); shorten it"
            )


def text_inputs(options, checkpoint: str | Path | None, what: str = "the reference") -> TextInputs | None:
    """The prompt set ``options`` (a :class:`~parity.run.options.CheckOptions`) asks for: its
    ``prompts`` tokenized with the tokenizer of ``checkpoint`` (a folder, or a GGUF), or its
    ``prompt_ids``; None when it gives neither."""
    if options.prompts:
        return tokenize(options.prompts, tokenizer_folder(checkpoint), chat=options.chat, what=what)
    if options.prompt_ids:
        try:
            folder = tokenizer_folder(checkpoint)
        except ParityError:  # ids need no tokenizer: pieces are only shown where one loads
            folder = None
        return given_ids(options.prompt_ids, folder, "token ids given as such")
    return None
