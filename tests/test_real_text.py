"""Real text (issue 29): prompts tokenized with the checkpoint's own tokenizer, token ids from a file,
the prompt-set verdict (KL, top-k, margins, greedy divergence) and the tokens in every report.

A tiny WordLevel tokenizer (the `tokenizers` library, wrapped in PreTrainedTokenizerFast, with a
chat template) is saved next to a tiny random Llama 3 checkpoint; nothing comes from the Hub."""

from __future__ import annotations

import json
import shutil

import pandas as pd
import pytest
import torch

import parity
from parity.build import build_pair
from parity.cli import main
from parity.model.registry import get_family
from parity.run.inputs import tokenize

WORDS = [
    *[
        "the",
        "capital",
        "of",
        "france",
        "is",
        "paris",
        "a",
        "an",
        "and",
        "cat",
        "dog",
        "sat",
        "on",
        "mat",
        "hello",
        "world",
        "how",
        "are",
        "you",
        "today",
    ],
    *["i", "am", "fine", "what", "time", "it", ":", "user", "assistant"],
]
TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}assistant :{% endif %}"
)


def make_tokenizer(chat: bool = True):
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}
    for w in WORDS:
        vocab.setdefault(w, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>"
    )
    if chat:
        fast.chat_template = TEMPLATE
    return fast


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny random Llama 3 checkpoint (vocabulary 257) with the tokenizer saved beside it."""
    folder = tmp_path_factory.mktemp("text") / "llama3-tiny"
    pair = build_pair(get_family("llama3"), config="tiny")
    pair.reference.save_pretrained(folder)
    make_tokenizer().save_pretrained(folder)
    return folder


def _copy(checkpoint, tmp_path, name="copy"):
    target = tmp_path / name
    shutil.copytree(checkpoint, target)
    return target


def _cli(tmp_path, *args) -> int:
    return main(["check", "llama3", *args, "--report-dir", str(tmp_path / "reports")])


def _report(tmp_path):
    (folder,) = (tmp_path / "reports").iterdir()
    return folder


def test_cli_shows_tokens_and_bos_in_every_report(checkpoint, tmp_path, capsys):
    code = _cli(
        tmp_path,
        "--checkpoint",
        str(checkpoint),
        "--prompt",
        "the capital of france is",
        "--prompt",
        "hello world",
        "--batch",
        "2",
    )
    out = capsys.readouterr().out
    assert code == 0
    expected = make_tokenizer()("the capital of france is")["input_ids"]
    assert expected[0] == 1  # the tokenizer adds BOS
    assert "1:'<s>' 4:'the' 5:'capital'" in out
    flat = " ".join(out.split())  # notes wrap at the console's width
    assert "BOS '<s>' (id 1) added by the tokenizer" in flat
    assert "top-1 agreement 100.00%" in flat and "judgement:" in flat
    folder = _report(tmp_path)
    text = json.loads((folder / "result.json").read_text())["text"]
    assert [p["ids"] for p in text["prompts"]] == [expected, make_tokenizer()("hello world")["input_ids"]]
    assert text["prompts"][0]["pieces"][:3] == ["<s>", "the", "capital"]
    assert "BOS '<s>'" in text["bos"]
    rows = pd.read_csv(folder / "prompts.csv")
    assert list(rows["prompt"]) == [0, 1] and rows["ids"][0] == " ".join(map(str, expected))
    assert list(rows["top1_agreement"]) == [1.0, 1.0]
    html = (folder / "report.html").read_text()
    assert 'id="prompt-tokens"' in html and 'id="plot-prompt-kl"' in html
    assert "<code>capital</code>" in html  # the piece, per position


def test_padding_side_and_mask(checkpoint):
    texts = ["the capital of france is paris", "hello"]
    inputs = tokenize(texts, checkpoint)
    ((_, ids, mask),) = inputs.batches(2)  # the tokenizer pads on the right
    assert inputs.padding_side == "right"
    assert mask[1].tolist() == [1, 1] + [0] * 5 and ids[1, 2:].tolist() == [0] * 5
    ((_, ids, mask),) = inputs.batches(2, "left")
    assert mask[1].tolist() == [0] * 5 + [1, 1] and ids[1, -2:].tolist() == [1, 18]


@pytest.mark.slow
def test_padded_batches_pass_plain_and_decode(checkpoint):
    """The mask reaches both models: a bit-exact pair agrees on padded batches, right-padded for a
    plain check, left-padded for decoding."""
    texts = ["the capital of france is paris", "hello"]
    pair = build_pair(get_family("llama3"), checkpoint=str(checkpoint))
    plain = parity.check(pair, prompts=texts, batch_size=2)
    assert plain.passed and any("padded on the right" in n for n in plain.notes)
    # padding positions are left out of the logits verdict: 7 + 2 real positions
    assert plain.text["logits"]["positions"] == 9
    decode = parity.check(pair, prompts=texts, batch_size=2, decode="4x3")
    assert decode.passed and any("padded on the left" in n for n in decode.notes)
    assert any("the prefill is each batch's prompt (7 tokens)" in n for n in decode.notes)
    assert decode.text["decode_divergence"] is None


def test_chat_template_applied(checkpoint, tmp_path):
    tokenizer = make_tokenizer()
    messages = [{"role": "user", "content": "hello world"}]
    inputs = tokenize(["hello world"], checkpoint, chat=True)
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == "user : hello world assistant :"
    assert list(inputs.prompts[0].ids) == tokenizer(rendered)["input_ids"]
    assert inputs.chat and "chat template" in inputs.bos
    # JSONL messages go through the template too
    lines = tmp_path / "p.jsonl"
    lines.write_text(json.dumps({"messages": messages}) + "\n" + json.dumps({"text": "the cat"}) + "\n")
    from parity.run.inputs import read_prompts_file

    prompts = read_prompts_file(lines)
    assert prompts[1] == "the cat"
    assert list(tokenize(prompts, checkpoint).prompts[0].ids) == list(inputs.prompts[0].ids)


def _logits(model, ids, reference):
    with torch.no_grad():
        out = model(input_ids=ids) if reference else model(ids)
    return (out.logits if reference else out)[0].double()


def test_prompt_set_verdict_matches_logits_and_names_the_fault(checkpoint, tmp_path):
    """F02 (k_proj rows permuted) on the checkpoint: the verdict's KL, top-1/top-5 and margins equal
    what the two models' logits say, computed here from plain forwards, prompt by prompt."""
    family = get_family("llama3")
    pair = build_pair(family, checkpoint=str(checkpoint))
    next(f for f in family.faults if f.id == "F02").inject(pair)
    texts = ["the capital of france is paris", "the cat sat on the mat and the dog sat"]
    result = parity.check(pair, prompts=texts, batch_size=2)  # one right-padded batch
    assert not result.passed and result.first_mismatch.name == "model.layers.0.self_attn.k_proj"
    tokenizer = make_tokenizer()
    kls, top1, top5, disagreements = [], [], [], []
    for i, text in enumerate(texts):
        ids = torch.tensor([tokenizer(text)["input_ids"]])
        ref, ours = _logits(pair.reference, ids, True), _logits(pair.ours, ids, False)
        p, q = torch.log_softmax(ref, -1), torch.log_softmax(ours, -1)
        kl = (p.exp() * (p - q)).sum(-1)
        kls += kl.tolist()
        top1 += (ref.argmax(-1) == ours.argmax(-1)).tolist()
        top5 += [int(ref[t].argmax()) in ours[t].topk(5).indices.tolist() for t in range(len(ref))]
        for t in range(len(ref)):
            if ref[t].argmax() != ours[t].argmax():
                values = ref[t].topk(2).values
                disagreements.append((i, t, int(ref[t].argmax()), int(ours[t].argmax()), float(values[0] - values[1])))
    v = result.text["logits"]
    assert v["kl_mean"] == pytest.approx(sum(kls) / len(kls), rel=1e-6)
    assert v["kl_max"] == pytest.approx(max(kls), rel=1e-6)
    assert v["top1_agreement"] == pytest.approx(sum(top1) / len(top1))
    assert v["top5_agreement"] == pytest.approx(sum(top5) / len(top5))
    assert disagreements, "the fault must flip some top-1 token"
    got = [
        (d["prompt"], d["position"], d["token_ref"], d["token_ours"], d["margin"]) for d in result.text["disagreements"]
    ]
    assert [g[:4] for g in got] == [d[:4] for d in disagreements]
    assert [g[4] for g in got] == pytest.approx([d[4] for d in disagreements], rel=1e-5)
    assert all(d["near_tie"] is False for d in result.text["disagreements"])  # margins far above rounding
    assert "beyond the reference's own rounding" in v["judgement"]
    worst = result.text["worst"]["model.layers.0.self_attn.k_proj"]
    assert worst["prompt"] in (0, 1) and worst["position"] is not None
    # the same set through the command line's reports: the disagreements are in the HTML
    result.write("html", tmp_path / "r.html")
    html = (tmp_path / "r.html").read_text()
    assert 'id="disagreements"' in html
    assert 'id="card-tokens"' in html  # the tokens of the prompt where k_proj is worst, in the first-mismatch card


def test_input_ids_without_tokenizer(tmp_path, capsys):
    ids = tmp_path / "ids.json"
    ids.write_text("[[1, 5, 9, 200], [3, 4]]")
    assert _cli(tmp_path, "--input-ids", str(ids)) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "token ids given as such" in out and "2 prompt(s)" in out
    text = json.loads((_report(tmp_path) / "result.json").read_text())["text"]
    assert [p["ids"] for p in text["prompts"]] == [[1, 5, 9, 200], [3, 4]]


def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert err.startswith("parity: error:") and "\n" not in err and "Traceback" not in err
    return err


def test_no_tokenizer_says_how_to_pass_ids(tmp_path, capsys):
    assert _cli(tmp_path, "--prompt", "hello") == 2
    assert "--input-ids FILE" in _one_line_error(capsys)


@pytest.mark.parametrize(
    "spoil, words",
    [
        (lambda d: (d / "tokenizer.json").write_text("{not json"), "cannot be loaded"),
        (
            lambda d: (d / "tokenizer_config.json").write_text(
                json.dumps({"auto_map": {"AutoTokenizer": ["x.Tok", None]}})
            ),
            "needs remote code",
        ),
    ],
    ids=["broken", "remote-code"],
)
def test_bad_tokenizer_one_line(spoil, words, checkpoint, tmp_path, capsys):
    folder = _copy(checkpoint, tmp_path)
    spoil(folder)
    assert _cli(tmp_path, "--checkpoint", str(folder), "--prompt", "hello") == 2
    assert words in _one_line_error(capsys)


def test_no_chat_template_one_line(checkpoint, tmp_path, capsys):
    folder = _copy(checkpoint, tmp_path)
    make_tokenizer(chat=False).save_pretrained(folder)
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    assert _cli(tmp_path, "--checkpoint", str(folder), "--prompt", "hello", "--chat") == 2
    assert "no chat template" in _one_line_error(capsys)


def test_prompt_longer_than_positions_one_line(checkpoint, tmp_path, capsys):
    folder = _copy(checkpoint, tmp_path)
    config = json.loads((folder / "config.json").read_text())
    config["max_position_embeddings"] = 4
    (folder / "config.json").write_text(json.dumps(config))
    assert _cli(tmp_path, "--checkpoint", str(folder), "--prompt", "the capital of france is") == 2
    assert "longer than the model's 4 positions" in _one_line_error(capsys)


@pytest.mark.parametrize(
    "content, words",
    [
        ("[[1, 2", "not JSON"),
        ("[1, 2, 3]", "list of lists"),
        ("[[1, -2]]", "integers >= 0"),
        ("[[1, 999]]", "outside the model's vocabulary of 257"),
    ],
    ids=["not-json", "flat", "negative", "out-of-vocabulary"],
)
def test_bad_ids_file_one_line(content, words, tmp_path, capsys):
    ids = tmp_path / "ids.json"
    ids.write_text(content)
    assert _cli(tmp_path, "--input-ids", str(ids)) == 2
    assert words in _one_line_error(capsys)


def test_check_model_and_record_take_the_same_inputs(checkpoint, tmp_path):
    from parity import golden as traces

    trace = traces.record(checkpoint, tmp_path / "trace", prompts=["the cat sat", "hello"])
    from safetensors.torch import load_file

    inputs = load_file(str(trace.path / "inputs.safetensors"))
    assert inputs["input_ids"].tolist() == [[1, 4, 13, 15], [1, 18, 0, 0]]
    assert any("1:'<s>' 4:'the' 13:'cat'" in n for n in trace.manifest["notes"])
    ids = traces.record(checkpoint, tmp_path / "trace2", input_ids=[[1, 4], [1, 18, 19]])
    assert load_file(str(ids.path / "inputs.safetensors"))["input_ids"].tolist() == [
        [0, 1, 4],
        [1, 18, 19],
    ]  # ids given as such: left-padded


@pytest.mark.slow
def test_check_model_takes_prompts_and_id_lists(checkpoint):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent / "user_models"))
    import litgpt_llama

    result = parity.check_model(litgpt_llama.build, reference=str(checkpoint), prompts=["the cat sat", "hello"])
    assert result.passed and [p["ids"] for p in result.text["prompts"]] == [[1, 4, 13, 15], [1, 18]]
    assert result.text["logits"]["top1_agreement"] == 1.0
    ids = parity.check_model(litgpt_llama.build, reference=str(checkpoint), input_ids=[[1, 4], [1, 18, 19]])
    assert [p["pieces"] for p in ids.text["prompts"]] == [["<s>", "the"], ["<s>", "hello", "world"]]


def test_near_tie_is_a_margin_within_the_references_own_error():
    """A top-1 flip whose reference margin is within twice the reference's own logit error (against
    float64) is a near-tie; one with a wide margin is not."""
    from parity.run.prompt_set import _disagreements, position_stats

    ref = torch.tensor([[2.0, 1.9999, 0.0], [3.0, 1.0, 0.0]], dtype=torch.float64)
    ours = torch.tensor([[1.9, 2.0, 0.0], [0.0, 2.0, 0.0]], dtype=torch.float64)
    ref64 = ref + torch.tensor([[1e-4, -1e-4, 0.0], [1e-4, 0.0, 0.0]], dtype=torch.float64)
    stats = position_stats(ref, ours, ref64)
    assert stats["top1"] == [False, False] and stats["margin"] == pytest.approx([1e-4, 2.0])
    assert stats["ref_error"] == pytest.approx([1e-4, 1e-4])
    found = _disagreements([{"index": 7, "positions": stats}])
    assert [(d["prompt"], d["position"], d["near_tie"]) for d in found] == [(7, 0, True), (7, 1, False)]
    assert position_stats(ref, ours, None)["ref_error"] is None  # no float64 copy: not judged


def test_record_command_takes_prompts(checkpoint, tmp_path, capsys):
    out = tmp_path / "golden"
    code = main(["record", "--reference", str(checkpoint), "--out", str(out), "--prompt", "the cat sat"])
    assert code == 0
    printed = " ".join(capsys.readouterr().out.split())
    assert "1:'<s>' 4:'the' 13:'cat' 15:'sat'" in printed and "1 x 4 tokens" in printed
    assert main(["record", "--reference", str(checkpoint), "--out", str(tmp_path / "g2"), "--chat"]) == 2
    assert "--chat applies" in _one_line_error(capsys)


@pytest.mark.slow
def test_a_model_without_position_ids_runs_a_prompt_set_one_prompt_at_a_time(checkpoint):
    """litgpt_llama's forward takes a mask but no position_ids: a padded batch would judge positions it
    cannot follow (a false failure), so --batch 2 runs the prompts one at a time, and says so."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent / "user_models"))
    import litgpt_llama

    texts = ["the cat sat on the mat", "hello", "the dog"]
    result = parity.check_model(litgpt_llama.build, reference=str(checkpoint), prompts=texts, batch_size=2)
    assert result.passed, result.verdict()
    assert any("takes no position_ids" in n and "one at a time (--batch 2 asked)" in n for n in result.notes)
    assert result.text["logits"]["top1_agreement"] == 1.0
