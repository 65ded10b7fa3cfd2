"""Training parity (parity.run.backward): the loss, every node's gradient, every parameter's gradient,
one optimizer step and causality, on our families and on a user's model, clean and with the faults
training meets (a .detach() in RoPE, an untied copy of a tied embedding, a loss over padding, labels
not shifted, an in-place op, dropout left on, a causal mask that leaks)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jsonschema
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import parity
import parity.build
from parity.cli import main
from parity.model.registry import families, get_family
from parity.report.tables import result_schema
from parity.run.backward import (
    causal_lm_loss,
    causality,
    check_causality,
    default_labels,
    loss_and_logits,
    training,
)
from parity.selftest.run import run_fault
from reference_pairs.common import faults as common_faults

sys.path.insert(0, str(Path(__file__).parent / "user_models"))
import book_olmo3  # book style: trf_blocks, att.W_query, a copying loader

ATT = "model.layers.{}.self_attn"
MLP = "model.layers.{}.mlp"
TRAINING = ("train/", "grad/", "step/", "causal/")


def backward_nodes(res):
    return [n for n in res.nodes if n.name.startswith(TRAINING) or n.name == "loss"]


def assert_exact(res):
    """Every judged training node bit-identical (max_abs 0)."""
    judged = [n for n in backward_nodes(res) if n.judged and not n.name.startswith("causal/")]
    assert judged and all(n.max_abs == 0 for n in judged), [(n.name, n.max_abs) for n in judged if n.max_abs][:5]


# --- options ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(step="adamw"), "a step needs the gradients: add backward=True"),
        (dict(backward=True, step="adam"), "unknown step 'adam'; choose from adamw, sgd"),
        (dict(backward=True, lr=1e-3), "lr is the step's learning rate"),
        (dict(backward=True, step="sgd", lr=0.0), "must be > 0"),
        (dict(backward=True, decode="8x2"), "backward and causality run on the prompt"),
        (dict(causality=True, decode="8x2"), "backward and causality run on the prompt"),
        (dict(labels=torch.zeros(1, 4, dtype=torch.long)), "labels are the loss's: add backward=True"),
        (dict(backward=True, labels=torch.zeros(1, 4)), "labels must be an integer tensor (batch, seq)"),
        (dict(backward="yes"), "backward must be True or False"),
    ],
)
def test_training_options_are_refused_in_one_line(kwargs, message):
    with pytest.raises(parity.ParityError, match=None) as e:
        parity.CheckOptions(**kwargs)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_labels_that_cannot_serve_are_bad_input_before_anything_runs():
    pair = parity.build.build_pair(get_family("llama3"), "tiny")
    with pytest.raises(parity.ParityError, match=r"labels have shape \(1, 5\), input_ids \(1, 16\)"):
        parity.check(pair, backward=True, labels=torch.zeros(1, 5, dtype=torch.long))
    with pytest.raises(parity.ParityError, match=r"labels must be token ids in \[0, 257\) or -100, got \[-1, 0\]"):
        parity.check(pair, backward=True, labels=torch.zeros(1, 16, dtype=torch.long) - torch.eye(1, 16).long())


def test_cli_training_flags_in_their_own_words(capsys):
    assert main(["check", "llama3", "--step", "adamw"]) == 2
    assert "--step adamw needs the gradients: add --backward" in capsys.readouterr().err
    assert main(["check", "llama3", "--backward", "--lr", "0.1"]) == 2
    assert "--lr is the step's learning rate: give --step too" in capsys.readouterr().err
    assert main(["check", "llama3", "--causality", "--decode", "8x2"]) == 2
    assert "drop --decode" in capsys.readouterr().err


# --- the loss --------------------------------------------------------------------------------------


def test_the_loss_is_transformers_own_for_causal_lms():
    from transformers.loss.loss_utils import ForCausalLMLoss

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 7, 11, generator=gen)
    ids = torch.randint(0, 11, (2, 7), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    labels = default_labels(ids, mask)
    assert labels[1, :3].tolist() == [-100] * 3 and labels[0].tolist() == ids[0].tolist()
    assert torch.equal(causal_lm_loss(logits, labels, 11), ForCausalLMLoss(logits, labels, 11))


def test_what_a_forward_returns_is_read_as_loss_and_logits():
    loss, logits = torch.tensor(1.5), torch.zeros(1, 3, 5)
    assert loss_and_logits(logits) == (None, logits)
    assert loss_and_logits(loss) == (loss, None)
    assert loss_and_logits((loss, logits)) == (loss, logits)
    out = loss_and_logits(type("Out", (), {"loss": loss, "logits": logits})())
    assert out[0] is loss and out[1] is logits


def test_training_turns_dropout_off_and_restores_everything():
    model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.3))
    model[0].attention_dropout = 0.2
    model[0].weight.requires_grad_(False)
    model.eval()
    with training(model) as changed:
        assert model.training and model[1].p == 0 and model[0].attention_dropout == 0.0
        assert model[0].weight.requires_grad
        assert (changed.modules, changed.attributes) == (1, 1)
    assert not model.training and model[1].p == 0.3 and model[0].attention_dropout == 0.2
    assert not model[0].weight.requires_grad


# --- every family passes, bit-exact where it claims it --------------------------------------------

CI = [(name, config) for name, fam in families().items() for config in fam.ci_configs]


@pytest.mark.parametrize("family, config", CI, ids=[f"{n}-{c}" for n, c in CI])
def test_every_family_passes_backward_on_its_ci_configs(family, config):
    fam = get_family(family)
    pair = parity.build.build_pair(fam, config)
    res = parity.check(pair, backward=True)
    assert res.passed, res.verdict()
    names = {n.name for n in res.nodes}
    assert {"train/logits", "loss", "grad/logits"} <= names
    assert any(n.startswith("grad/") and n.endswith(".weight") for n in names)
    claimed = fam.exact_backward_dtypes if fam.exact_backward_dtypes is not None else fam.exact_dtypes
    if torch.float32 in claimed:
        assert_exact(res)
    else:  # judged on the dtype's tolerance, scaled to each gradient
        grads = [n for n in res.nodes if n.name.startswith("grad/") and n.judged]
        assert all(n.tol_source == "grad-scaled:float32" for n in grads)


@pytest.mark.parametrize("family, config", CI, ids=[f"{n}-{c}" for n, c in CI])
def test_every_family_is_causal(family, config):
    """Past the sliding windows of the tiny configs (8 tokens), not past a DeltaNet chunk (64)."""
    pair = parity.build.build_pair(get_family(family), config)
    res = parity.check(pair, causality=True, seq_len=12)
    causal = [n for n in res.nodes if n.name.startswith("causal/")]
    assert res.passed and causal and all(n.status in ("ok", "untapped") for n in causal), res.verdict()
    assert res.meta["causality"]["positions"] == list(range(11))


@pytest.mark.parametrize("family", ["olmo3", "llama3", "gemma4"])
def test_bfloat16_gradients_are_bit_exact(family):
    pair = parity.build.build_pair(get_family(family), "tiny", dtype=torch.bfloat16)
    res = parity.check(pair, backward=True, step="adamw")
    assert res.passed, res.verdict()
    assert_exact(res)


def test_a_left_padded_batch_trains_bit_exact_too():
    """Padding positions are -100; a padded query row attends to every key uniformly on both sides,
    its gradient reaching them through the additive mask as the reference's does."""
    pair = parity.build.build_pair(get_family("olmo3"), "tiny")
    res = parity.check(pair, backward=True, batch_size=3, left_pad=5)
    assert res.passed, res.verdict()
    assert_exact(res)
    assert res.meta["backward"]["labels"].startswith("input_ids, padding -100")


def test_given_labels_are_used():
    pair = parity.build.build_pair(get_family("llama3"), "tiny")
    ids = pair.make_inputs(16, 2)
    labels = ids.clone()
    labels[:, :6] = -100  # train on the completion only
    res = parity.check(pair, ids, backward=True, labels=labels, batch_size=2)
    assert res.passed and res.meta["backward"]["labels"] == "given"
    full = parity.check(pair, ids, backward=True, batch_size=2)
    loss = {r.name: r for r in res.nodes}["loss"]
    assert loss.max_abs == 0 and {r.name: r for r in full.nodes}["loss"].max_abs == 0


# --- faults in a family: located at the gradient node, with the hint -------------------------------

FAULTS = common_faults.training_faults(ATT, MLP)


@pytest.mark.parametrize("fault", FAULTS, ids=[f.id for f in FAULTS])
def test_training_faults_in_olmo3_are_located_with_their_hint(fault):
    row = run_fault(get_family("olmo3"), fault)
    assert row.passed, row.problems


def test_an_untied_copy_of_the_tied_embedding_fails_its_gradient_while_their_sum_matches():
    pair = parity.build.build_pair(get_family("llama3"), "tiny")
    common_faults.untied_embedding_copy(pair)
    res = parity.check(pair, backward=True)
    bad = res.first_mismatch
    assert bad.name == "grad/model.embed_tokens.weight" and bad.hint.kind == "untied_copy"
    assert set(bad.hint.evidence["copies"]) == {"tok_emb.weight", "out_head.weight"}
    # the forward agrees, every node's gradient agrees: only the parameter's does not
    assert all(n.passed for n in res.nodes if not n.name.endswith(".weight") and n.judged)


def test_a_detach_in_rope_is_found_at_the_rotated_queries():
    pair = parity.build.build_pair(get_family("olmo3"), "tiny")
    common_faults.detach_in_rope(1)(pair)
    res = parity.check(pair, backward=True)
    bad = res.first_mismatch
    assert bad.name == f"grad/{ATT.format(1)}.q_rot" and bad.status == "missing"
    assert bad.hint.kind == "detached" and bad.hint.evidence["cut"] == f"{ATT.format(1)}.q_rot"


def test_a_forward_that_fails_is_not_followed_by_a_backward_verdict():
    pair = parity.build.build_pair(get_family("olmo3"), "tiny")
    pair.ours.blocks[0].ff.fc1.weight = nn.Parameter(pair.ours.blocks[0].ff.fc1.weight.detach() * 2)
    res = parity.check(pair, backward=True)
    assert res.first_mismatch.name == f"{MLP.format(0)}.gate_proj"
    assert not backward_nodes(res) and any(n.startswith("backward not judged") for n in res.notes)
    assert res.meta["backward"]["judged"] is False


# --- the optimizer step ----------------------------------------------------------------------------


class SiluWithoutItsSecondTerm(torch.autograd.Function):
    """SiLU's forward (F.silu: the same bits) with a wrong backward, ``g * sigmoid(x)`` (the ``x s (1 - s)``
    term missing): a custom autograd function whose gradient is wrong."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return F.silu(x)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return grad * torch.sigmoid(x)


@pytest.mark.parametrize("step", ["adamw", "sgd"])
def test_one_optimizer_step_passes_clean_and_fails_on_a_gradient_fault(step):
    pair = parity.build.build_pair(get_family("llama3"), "tiny")
    clean = parity.check(pair, backward=True, step=step, lr=1e-2)
    assert clean.passed, clean.verdict()
    steps = [n for n in clean.nodes if n.name.startswith("step/")]
    assert len(steps) == len([n for n in clean.nodes if n.name.startswith("grad/") and n.name.endswith("weight")])
    assert clean.meta["backward"]["step"] == {"optimizer": step, "lr": 1e-2}
    pair.ours.blocks[1].ff.act = SiluWithoutItsSecondTerm.apply
    res = parity.check(pair, backward=True, step=step, lr=1e-2)
    assert res.first_mismatch.name == f"grad/{MLP.format(1)}.gate_proj"
    failing = {n.name for n in res.nodes if n.failed}
    assert (
        f"step/{MLP.format(1)}.gate_proj.weight" in failing and f"step/{MLP.format(1)}.down_proj.weight" not in failing
    )


def test_the_step_of_a_pair_judged_with_tolerances_allows_ambiguous_signs():
    """AdamW's first step is about lr * sign(g): where the reference's gradient is zero within
    tolerance the step may go either way (2 lr), elsewhere within lr * rtol."""
    from parity.run.backward import step_tolerance

    g = torch.tensor([1e-9, 0.5, -0.3])
    atol, ambiguous = step_tolerance("adamw", 1e-3, 1e-6, 1e-4, g, torch.ones(3))
    assert ambiguous.tolist() == [True, False, False] and atol < 1e-6
    assert step_tolerance("adamw", 1e-3, 0.0, 0.0, g, torch.ones(3)) == (0.0, None)
    sgd, none = step_tolerance("sgd", 1e-3, 1e-6, 1e-4, g, torch.ones(3))
    assert none is None and sgd == pytest.approx(1e-3 * (1e-6 + 1e-4 * 0.5) + 4 * 2**-23, rel=1e-6)


# --- causality -------------------------------------------------------------------------------------


def leak_one_ahead(layer: int):
    """Layer ``layer`` lets query t also see key t + 1."""

    def inject(pair):
        att = pair.ours.blocks[layer].att
        masked = att.mask_scores

        def mask_scores(scores, allowed, _masked=masked):
            q, k = allowed.shape[-2:]
            ahead = torch.ones(q, k, dtype=torch.bool, device=allowed.device).triu(1).tril(1)
            return _masked(scores, allowed | ahead)

        att.mask_scores = mask_scores

    return inject


def test_causality_finds_a_mask_that_lets_t_see_t_plus_1_at_its_layer():
    pair = parity.build.build_pair(get_family("olmo3"), "tiny")
    leak_one_ahead(2)(pair)
    res = parity.check(pair, causality=True)
    causal = [n for n in res.nodes if n.name.startswith("causal/")]
    first = next(n for n in causal if n.failed)
    assert first.name == f"causal/{ATT.format(2)}.probs" and first.hint.kind == "future_leak"
    assert all(n.passed for n in causal if n.layer is not None and n.layer < 2)
    assert any("the reference keeps every node causal" in note for note in res.notes)


def test_causality_of_our_model_alone_needs_no_reference():
    pair = parity.build.build_pair(get_family("llama3"), "tiny")
    ids = pair.make_inputs(12, 1)
    clean = check_causality(pair.ours, ids, vocab_size=pair.vocab_size)
    assert clean and all(n.status in ("ok", "untapped") for n in clean)
    leak_one_ahead(1)(pair)
    leaks = check_causality(pair.ours, ids, vocab_size=pair.vocab_size)
    first = next(n for n in leaks if n.failed)
    assert first.name == "causal/blocks.1.att.probs" and first.hint.kind == "future_leak"
    assert causality(pair.ours, ids, vocab_size=pair.vocab_size).positions == list(range(11))


# --- a user's model --------------------------------------------------------------------------------


def test_a_user_model_passes_backward_step_and_causality():
    res = parity.check_model(book_olmo3.build, "olmo3:yarn", backward=True, step="adamw", causality=True)
    assert res.passed, res.verdict()
    info = res.meta["backward"]
    assert info["loss_ours"].startswith("computed by parity") and info["tolerance"] == "grad-scaled:float32"
    assert any(n.name.startswith("step/") for n in res.nodes)


def tied_olmo3_config():
    fam = get_family("olmo3")
    cfg = fam.configs["tiny"](None)
    return fam.to_hf({**cfg, "tie_word_embeddings": True})


def _fast(**kwargs):
    return dict(semantic=False, backward=True, **kwargs)


def test_user_model_keeping_an_untied_copy_of_the_tied_embedding():
    def build(state_dict, hf_config):
        model = book_olmo3.build(state_dict, hf_config)
        model.out_head.weight = nn.Parameter(model.tok_emb.weight.detach().clone())  # copied, not tied
        return model

    res = parity.check_model(build, tied_olmo3_config(), **_fast())
    bad = res.first_mismatch
    assert bad.name == "grad/model.embed_tokens.weight" and bad.hint.kind == "untied_copy"
    assert any("a training step would update each copy apart" in u for u in res.coverage.untied)


def test_user_model_with_a_detach_in_rope(monkeypatch):
    rope = book_olmo3.apply_rope
    monkeypatch.setattr(book_olmo3, "apply_rope", lambda x, cos, sin: rope(x.detach(), cos, sin))
    res = parity.check_model(book_olmo3.build, "olmo3:tiny", **_fast())
    bad = res.first_mismatch
    assert bad.name.startswith("grad/model.layers.3.self_attn.") and bad.hint.kind == "detached"
    assert bad.hint.evidence["cut"] == "model.layers.3.self_attn.q_rot"


def _with_own_loss(loss):
    def build(state_dict, hf_config):
        model = book_olmo3.build(state_dict, hf_config)
        inner = model.forward

        def forward(in_idx, attention_mask=None, labels=None):
            logits = inner(in_idx, attention_mask)
            return logits if labels is None else (loss(logits, labels, in_idx), logits)

        model.forward = forward
        return model

    return build


def test_user_model_whose_own_loss_is_right():
    def right(logits, labels, ids):
        return causal_lm_loss(logits, labels, logits.shape[-1])

    res = parity.check_model(_with_own_loss(right), "olmo3:tiny", **_fast())
    assert res.passed, res.verdict()
    assert res.meta["backward"]["loss_ours"].startswith("ours' own")


def test_user_model_whose_loss_counts_ignored_positions():
    """The labels mask a prompt (-100); ours' loss replaces -100 by the token ids, so it trains the
    prompt too (as a loss over padding does)."""

    def over_ignored(logits, labels, ids):
        targets = torch.where(labels == -100, ids, labels)[:, 1:]
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), targets.reshape(-1))

    pair = parity.build.build_pair(get_family("olmo3"), "tiny")
    ids = pair.make_inputs(16, 1)
    labels = ids.clone()
    labels[:, :4] = -100
    res = parity.check_model(_with_own_loss(over_ignored), "olmo3:tiny", input_ids=ids, **_fast(labels=labels))
    bad = res.first_mismatch
    assert bad.name == "loss" and bad.hint.kind == "loss_mask" and bad.hint.evidence["extra_positions"] == 3


def test_user_model_whose_labels_are_shifted_twice():
    def shifted_twice(logits, labels, ids):  # the data shifted them already, and the loss shifts again
        return F.cross_entropy(logits[:, :-2].reshape(-1, logits.shape[-1]), labels[:, 2:].reshape(-1))

    res = parity.check_model(_with_own_loss(shifted_twice), "olmo3:tiny", **_fast())
    bad = res.first_mismatch
    assert bad.name == "loss" and bad.hint.kind == "label_shift" and bad.hint.evidence["shift"] == 1


def _patched_mlp(forward):
    def build(state_dict, hf_config):
        model = book_olmo3.build(state_dict, hf_config)
        ff = model.trf_blocks[1].ff
        ff.forward = lambda x: forward(ff, x)
        return model

    return build


def test_user_model_with_an_in_place_op():
    def overwrite(ff, x):
        up = ff.fc2(x)
        hidden = F.silu(ff.fc1(x)) * up
        up.mul_(0)  # a buffer reused: the product's backward reads it
        return ff.fc3(hidden)

    res = parity.check_model(_patched_mlp(overwrite), "olmo3:tiny", **_fast())
    bad = res.first_mismatch
    assert bad.name == "grad/model.layers.1.mlp.up_proj" and bad.hint.kind == "in_place"
    assert "modified by an inplace operation" in bad.hint.text


def test_user_model_with_dropout_written_into_its_forward():
    def dropout(ff, x):
        return ff.fc3(F.dropout(F.silu(ff.fc1(x)), 0.1, ff.training) * ff.fc2(x))

    res = parity.check_model(_patched_mlp(dropout), "olmo3:tiny", **_fast())
    bad = res.first_mismatch
    assert bad.name == "train/logits" and bad.hint.kind == "dropout" and bad.hint.evidence["models"] == ["ours"]
    assert not [n for n in res.nodes if n.name.startswith("grad/")]


def test_user_model_whose_mask_leaks_the_next_token(monkeypatch):
    def build_masks(self, seq_len, attention_mask, device):
        ones = torch.ones(seq_len, seq_len, dtype=torch.bool, device=device)
        future = torch.triu(ones, diagonal=2)  # j > i + 1: t sees t + 1
        return {t: future[None, None] for t in ("full_attention", "sliding_attention")}

    monkeypatch.setattr(book_olmo3.Olmo3Model, "build_masks", build_masks)
    res = parity.check_model(book_olmo3.build, "olmo3:tiny", semantic=False, causality=True)
    first = next(n for n in res.nodes if n.name.startswith("causal/") and n.failed)
    assert first.name == "causal/model.layers.0.self_attn.probs" and first.hint.kind == "future_leak"


# --- reports ---------------------------------------------------------------------------------------


def test_reports_carry_the_training_nodes(tmp_path):
    pair = parity.build.build_pair(get_family("llama3"), "tiny")
    common_faults.untied_embedding_copy(pair)
    res = parity.check(pair, backward=True, step="sgd")
    data = json.loads(res.write_json(tmp_path / "result.json").read_text())
    jsonschema.validate(data, result_schema(), cls=jsonschema.Draft202012Validator)
    assert data["first_mismatch"]["name"] == "grad/model.embed_tokens.weight"
    assert data["first_mismatch"]["hint_kind"] == "untied_copy" and "backward" in data["meta"]
    csv = res.write_csv(tmp_path / "nodes.csv").read_text()
    assert "grad/model.layers.0.mlp.up_proj" in csv and "step/lm_head.weight" not in csv  # tied: one parameter
    assert "step/model.embed_tokens.weight" in csv
    junit = res.write_junit(tmp_path / "junit.xml").read_text()
    assert "grad/model.embed_tokens.weight" in junit
    html = res.write_html(tmp_path / "report.html").read_text()
    assert 'id="plot-grad-heatmap"' in html and "grad/model.embed_tokens.weight" in html


def test_the_backward_is_refused_with_numbers_when_it_does_not_fit(monkeypatch):
    pair = parity.build.build_pair(get_family("llama3"), "tiny")
    monkeypatch.setattr("parity.run.backward.backward_bytes", lambda *a, **k: 1 << 50)
    with pytest.raises(
        parity.ParityError, match=r"the backward of 1 x 16 tokens .* needs about .* GiB but .* GiB are available"
    ):
        parity.check(pair, backward=True)
