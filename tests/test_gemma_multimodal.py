"""Multimodal Gemma checkpoints (Gemma 3 4B+, Gemma 4 E2B/E4B: config.json model_type gemma3/gemma4 with a
text_config, weights under model.language_model next to vision/audio towers and projectors) checked as
their text model against Gemma{3,4}ForConditionalGeneration: bit-exact in float32 and bfloat16, single
file and sharded, node names as the checkpoint names the weights, the towers counted as skipped by loader
coverage, a missing or misnamed text key refused in one line, placeholder token ids kept out of inputs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import parity
import parity.build
from parity.cli import main
from parity.model.registry import family_for_model_type
from parity.util.errors import CheckpointError, ConfigError, LoaderError, ParityError
from reference_pairs import gemma3, gemma4

DTYPES = [torch.float32, torch.bfloat16]
FAMILIES = {"gemma3": gemma3, "gemma4": gemma4}
#: Gemma 4's placeholders inside the tiny vocabulary (257), as the released ones lie inside 262144
IMAGE, AUDIO, VIDEO = 250, 251, 252


def multimodal_model(
    family: str,
    seed: int = 3,
    dtype=torch.float32,
    config: str = "tiny",
    placeholders=(IMAGE, AUDIO, VIDEO),
    **overrides,
):
    """A Gemma{3,4}ForConditionalGeneration with tiny towers (vision; Gemma 4 audio too) whose text model
    holds the probe weights of the family's ``config`` pair; ``(model, text-only pair)``."""
    import transformers

    text_pair = FAMILIES[family].build_pair(config, seed=seed, dtype=dtype, **overrides)
    tie = text_pair.source.cfg["tie_word_embeddings"]
    image, audio, video = placeholders
    text = text_pair.reference.config
    text.pad_token_id = 0  # the released text configs' pad id (Gemma 4 embeds it in place of placeholders)
    if family == "gemma4":
        vision = transformers.Gemma4VisionConfig(
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=2,
            head_dim=8,
            position_embedding_size=64,
            patch_size=4,
        )
        audio_config = transformers.Gemma4AudioConfig(
            hidden_size=16, num_hidden_layers=1, num_attention_heads=2, output_proj_dims=16
        )
        config = transformers.Gemma4Config(
            text_config=text.to_dict(),
            vision_config=vision.to_dict(),
            audio_config=audio_config.to_dict(),
            image_token_id=image,
            audio_token_id=audio,
            video_token_id=video,
            boi_token_id=253,
            eoi_token_id=254,
            boa_token_id=255,
            eoa_token_index=256,
            tie_word_embeddings=tie,
        )
        cls = transformers.Gemma4ForConditionalGeneration
    else:
        vision = transformers.SiglipVisionConfig(
            hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=8, patch_size=4
        )
        config = transformers.Gemma3Config(
            text_config=text.to_dict(),
            vision_config=vision.to_dict(),
            mm_tokens_per_image=1,
            image_token_id=256,
            boi_token_index=254,
            eoi_token_index=255,
            tie_word_embeddings=tie,
        )
        cls = transformers.Gemma3ForConditionalGeneration
    torch.manual_seed(seed)
    model = cls(config).to(dtype)
    model.model.language_model.load_state_dict(text_pair.reference.model.state_dict())
    if not tie:
        model.lm_head.load_state_dict(text_pair.reference.lm_head.state_dict())
    return model, text_pair


def save(model, directory: Path, sharded: bool = False) -> Path:
    model.save_pretrained(directory, **({"max_shard_size": "20KB"} if sharded else {}))
    return directory


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """``{(family, dtype, sharded): directory}``, saved once for the module, with the text-only pairs."""
    root = tmp_path_factory.mktemp("multimodal")
    out, pairs = {}, {}
    for family in FAMILIES:
        for dtype in DTYPES:
            model, pairs[family, dtype] = multimodal_model(family, dtype=dtype)
            for sharded in (False, True):
                name = f"{family}-{str(dtype)[6:]}-{'sharded' if sharded else 'single'}"
                out[family, dtype, sharded] = save(model, root / name, sharded)
    return out, pairs


@pytest.mark.parametrize("sharded", [False, True], ids=["single", "sharded"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("family", FAMILIES)
def test_multimodal_checkpoint_is_bit_exact_under_its_own_names(family, dtype, sharded, checkpoints):
    directory = checkpoints[0][family, dtype, sharded]
    text_pair = checkpoints[1][family, dtype]
    assert (len(list(directory.glob("*.safetensors"))) > 1) == sharded
    pair = FAMILIES[family].build_pair(checkpoint=directory, dtype=dtype)
    assert type(pair.reference).__name__ == f"{family.capitalize()}ForConditionalGeneration"
    assert pair.source.cfg == text_pair.source.cfg and pair.exact
    res = parity.assert_bit_exact(pair)
    # the text-only pair's nodes, each under the checkpoint's prefix; the head and the output as they were
    text_names = [n.name for n in text_pair.nodes]
    assert [n.name for n in pair.nodes] == [
        name.replace("model.", "model.language_model.", 1) if name.startswith("model.") else name for name in text_names
    ]
    assert res.nodes[0].name == "model.language_model.embed_tokens" and res.nodes[-1].name == "logits"
    assert res.meta["reference_class"].endswith(f".{family.capitalize()}ForConditionalGeneration")
    assert pair.facts.layer_prefix == "model.language_model.layers" and pair.facts.text_model == "model.language_model"
    # loader coverage: every text tensor consumed once, the towers named and counted as skipped, no gap
    cov = res.coverage
    assert cov.ok and not cov.unused and not cov.unwritten
    assert all(k.startswith("model.language_model.") for k in cov.consumed)
    assert len(cov.consumed) == len(text_pair.loading.state_dict)
    towers = (
        {"model.vision_tower", "model.embed_vision", "model.audio_tower", "model.embed_audio"}
        if family == "gemma4"
        else {"model.vision_tower", "model.multi_modal_projector"}
    )
    assert set(cov.skipped.values()) == towers
    assert len(cov.consumed) + len(cov.skipped) == len(pair.loading.state_dict)
    note = cov.skipped_note()
    assert note.startswith(f"{len(cov.skipped)} checkpoint tensors outside the text model, not used by design (")
    assert "model.vision_tower " in note and cov.to_dict()["skipped"] == note
    assert cov.tied == [
        "lm_head.weight -> model.language_model.embed_tokens.weight: one Parameter (tok_emb.weight = out_head.weight)"
    ]


def test_gemma3_checkpoint_in_the_released_layout_is_read_through_transformers_conversion(checkpoints):
    """save_pretrained writes Gemma 3 as the released files are (language_model.model.*); the pair reads them
    as Transformers does, into model.language_model.*, and says so."""
    from safetensors import safe_open

    directory = checkpoints[0]["gemma3", torch.float32, False]
    with safe_open(str(directory / "model.safetensors"), "pt") as f:
        keys = list(f.keys())
    assert "language_model.model.layers.0.mlp.up_proj.weight" in keys
    pair = gemma3.build_pair(checkpoint=directory)
    assert "model.language_model.layers.0.mlp.up_proj.weight" in pair.loading.loaded_keys
    renamed = [c for c in pair.loading.conversions if "renamed as from_pretrained renames them" in c]
    assert renamed == [
        f"language_model.model.embed_tokens.weight -> model.language_model.embed_tokens.weight and "
        f"{sum(k.startswith('language_model.model.') for k in keys) - 1} more keys: renamed as from_pretrained renames them (Transformers' checkpoint conversion)"
    ]
    # a Gemma 4 file is already in the model's naming: nothing renamed
    assert not any(
        "renamed" in c
        for c in gemma4.build_pair(checkpoint=checkpoints[0]["gemma4", torch.float32, False]).loading.conversions
    )


def test_isolated_mode_and_decode_on_a_multimodal_checkpoint(checkpoints):
    pair = gemma4.build_pair(checkpoint=checkpoints[0]["gemma4", torch.float32, False])
    res = parity.check(pair, mode="both", exact=True)
    assert res.passed and all(n.max_abs == 0.0 for n in res.isolated)
    decoded = parity.assert_bit_exact(pair, decode="8x3")
    assert any(n.name == "step2/model.language_model.layers.0.self_attn.cache.keys" for n in decoded.nodes)


def test_cli_check_of_a_multimodal_checkpoint(checkpoints, tmp_path, capsys):
    directory = checkpoints[0]["gemma4", torch.float32, True]
    assert (
        main(["check", "gemma4", "--checkpoint", str(directory), "--report-dir", str(tmp_path), "--format", "json"])
        == 0
    )
    out = capsys.readouterr().out
    assert "PASS: all" in out and "model.language_model.layers.5" in out
    assert "skipped: " in out and "outside the text model, not used by design (model.audio_tower" in out


@pytest.mark.parametrize(
    "change, key",
    [
        ("drop", "model.language_model.layers.2.mlp.up_proj.weight"),
        ("rename", "model.language_model.layers.0.self_attn.q_proj.weight"),
    ],
    ids=["missing", "misnamed"],
)
def test_missing_or_misnamed_text_weight_is_refused_in_one_line_naming_it(change, key, checkpoints, tmp_path):
    from safetensors.torch import load_file, save_file

    source = checkpoints[0]["gemma4", torch.float32, False]
    directory = tmp_path / change
    directory.mkdir()
    (directory / "config.json").write_bytes((source / "config.json").read_bytes())
    weights = load_file(source / "model.safetensors")
    tensor = weights.pop(key)
    if change == "rename":
        weights[key.replace("q_proj", "query")] = tensor
    save_file(weights, directory / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(LoaderError) as err:
        gemma4.build_pair(checkpoint=directory)
    message = str(err.value)
    assert "\n" not in message and f"missing checkpoint keys: {key}" in message
    if change == "rename":
        assert "unused checkpoint keys: model.language_model.layers.0.self_attn.query.weight" in message


def test_missing_text_weight_of_a_gemma3_file_is_named_as_transformers_reads_it(checkpoints, tmp_path):
    """A Gemma 3 file says language_model.model.*; the error names the key as Transformers reads it."""
    from safetensors.torch import load_file, save_file

    source = checkpoints[0]["gemma3", torch.float32, False]
    (tmp_path / "config.json").write_bytes((source / "config.json").read_bytes())
    weights = load_file(source / "model.safetensors")
    del weights["language_model.model.layers.2.mlp.up_proj.weight"]
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(
        LoaderError, match=r"^missing checkpoint keys: model\.language_model\.layers\.2\.mlp\.up_proj\.weight;"
    ):
        gemma3.build_pair(checkpoint=tmp_path)


def test_multimodal_checkpoint_of_the_other_family_is_refused_naming_both_model_types(checkpoints):
    with pytest.raises(CheckpointError, match=r"has model_type 'gemma3', expected 'gemma4_text' or 'gemma4'$"):
        gemma4.build_pair(checkpoint=checkpoints[0]["gemma3", torch.float32, False])


def test_placeholder_tokens_are_kept_out_of_inputs(checkpoints):
    """Gemma4Model embeds pad in place of image/audio/video placeholders: random inputs never hold them,
    and input_ids that do are refused in one line (a text-only check cannot compare them)."""
    pair = gemma4.build_pair(checkpoint=checkpoints[0]["gemma4", torch.float32, False])
    assert pair.facts.placeholder_tokens == (IMAGE, AUDIO, VIDEO)
    ids = pair.make_inputs(4096)
    assert not any(bool((ids == t).any()) for t in (IMAGE, AUDIO, VIDEO))
    assert int(ids.min()) == 0 and int(ids.max()) == 256  # the rest of the vocabulary is still drawn
    with pytest.raises(ParityError, match=rf"^input_ids hold token {AUDIO}, a multimodal placeholder the reference"):
        parity.check(pair, input_ids=torch.tensor([[1, 2, AUDIO, 3]]))
    # a text-only pair draws exactly the ids it always drew
    text_pair = gemma4.build_pair("tiny")
    expected = torch.randint(0, 257, (1, 64), generator=torch.Generator().manual_seed(0))
    assert torch.equal(text_pair.make_inputs(64), expected)


def test_gemma3_placeholder_past_the_vocabulary_is_no_placeholder_of_the_inputs(checkpoints):
    """Gemma3Model swaps its image token only when it lies past the vocabulary, where no input holds it."""
    pair = gemma3.build_pair(checkpoint=checkpoints[0]["gemma3", torch.float32, False])
    assert pair.facts.placeholder_tokens == ()


def test_registry_finds_the_family_of_a_multimodal_model_type():
    assert family_for_model_type("gemma4") is not None and family_for_model_type("gemma4").name == "gemma4"
    assert family_for_model_type("gemma3").name == "gemma3"
    assert family_for_model_type("gemma4_text").name == "gemma4"


@pytest.mark.parametrize(
    "family, fault_id", [("gemma4", "gemma3-norm"), ("gemma4", "kv-wrong-layer"), ("gemma3", "F09")]
)
def test_a_fault_in_ours_is_found_at_the_checkpoints_node_name(family, fault_id, checkpoints):
    """A fault of the family's catalogue (its tiny config) on a multimodal pair: found at the node the
    catalogue expects, named as the checkpoint names it."""
    fault = next(f for f in FAMILIES[family].FAMILY.faults if f.id == fault_id)
    assert fault.config == "tiny" and not fault.overrides
    pair = FAMILIES[family].build_pair(checkpoint=checkpoints[0][family, torch.float32, False])
    fault.inject(pair)
    res = parity.check(pair)
    assert not res.passed
    assert res.first_mismatch.name == fault.expected.replace("model.", "model.language_model.", 1)


def test_nonfinite_note_only_for_tensors_the_text_model_reads(checkpoints):
    """Gemma 4's audio clip bounds are saved as +-inf by a fresh model: not a note, since no node reads them."""
    pair = gemma4.build_pair(checkpoint=checkpoints[0]["gemma4", torch.float32, False])
    inf = [k for k, v in pair.loading.state_dict.items() if not bool(torch.isfinite(v).all())]
    assert inf and all(pair.loading.by_design.get(k) == "model.audio_tower" for k in inf)
    assert not any("non-finite" in note for note in pair.notes)


def test_multimodal_config_without_weights_is_refused_saying_what_to_pass(checkpoints):
    with pytest.raises(
        ConfigError,
        match=r"has model_type 'gemma4', expected 'gemma4_text' \(a multimodal config: pass its "
        r"checkpoint folder, or its text_config as a config.json\)$",
    ):
        gemma4.build_pair(str(checkpoints[0]["gemma4", torch.float32, False] / "config.json"))


def test_check_model_against_a_multimodal_checkpoint(checkpoints):
    """A user's text model built from the multimodal checkpoint's tensors and config: aligned to the
    reference's model.language_model nodes, the towers skipped by coverage, not refused as unused."""
    prefix = "model.language_model."

    def build(state_dict, hf_config):
        cfg = gemma4.FAMILY.from_hf(hf_config.get_text_config(), torch.float32)
        with torch.device("meta"):
            model = gemma4.Gemma4Model(cfg)
        text = {"model." + k[len(prefix) :]: v for k, v in state_dict.items() if k.startswith(prefix)}
        gemma4.load_weights_into_gemma4(model, cfg, text)
        return model

    res = parity.check_model(build, reference=str(checkpoints[0]["gemma4", torch.float32, False]), exact=True)
    assert (
        res.passed
        and res.coverage.ok
        and set(res.coverage.skipped.values()) >= {"model.vision_tower", "model.audio_tower"}
    )
    judged = [n for n in res.nodes if n.status == "ok"]
    assert len(judged) > 100 and all(n.max_abs == 0.0 for n in judged)
    assert all(n.name.startswith(prefix) or n.name in ("lm_head", "logits") for n in res.nodes)


@pytest.mark.slow
def test_e2b_shape_multimodal_checkpoint_with_the_released_placeholders(tmp_path):
    """E2B widths (2 layers, vocabulary 262144 for both tables) in a multimodal bfloat16 checkpoint whose
    placeholders are the released ids (258880 image, 258881 audio, 258884 video, inside the vocabulary)."""
    released = (258_880, 258_881, 258_884)
    model, text_pair = multimodal_model("gemma4", dtype=torch.bfloat16, config="e2b-shape", placeholders=released)
    directory = save(model, tmp_path / "e2b", sharded=False)
    del model
    pair = gemma4.build_pair(checkpoint=directory, dtype=torch.bfloat16)
    assert pair.source.cfg == text_pair.source.cfg and pair.facts.placeholder_tokens == released
    del text_pair
    res = parity.assert_bit_exact(pair)
    assert res.nodes[0].name == "model.language_model.embed_tokens" and res.coverage.ok and res.coverage.skipped


def test_decode_never_feeds_a_placeholder():
    """The reference's greedy choice is fed to both models in a decode check; a placeholder never is
    (Gemma4Model would swap it for pad and ours would not), so the next best token goes in its place."""
    from parity.run.decode import fed_token

    logits = torch.tensor([[0.0, 1.0, 5.0, 3.0], [4.0, 0.0, 0.0, 0.0]])
    assert fed_token(logits).tolist() == [2, 0]
    assert fed_token(logits, (2,)).tolist() == [3, 0]
    assert logits[0, 2] == 5.0  # the logits themselves are left as they are


def test_multimodal_config_whose_two_ties_disagree_is_refused_naming_both(checkpoints, tmp_path):
    import json

    source = checkpoints[0]["gemma4", torch.float32, False]
    raw = json.loads((source / "config.json").read_text())
    raw["tie_word_embeddings"] = False
    (tmp_path / "config.json").write_text(json.dumps(raw))
    (tmp_path / "model.safetensors").write_bytes((source / "model.safetensors").read_bytes())
    with pytest.raises(
        ConfigError,
        match=r"^config.json has tie_word_embeddings=False but text_config.tie_word_embeddings=True: "
        r"Gemma4ForConditionalGeneration ties its head by the first",
    ):
        gemma4.build_pair(checkpoint=tmp_path)


@pytest.mark.parametrize("family", FAMILIES)
def test_untied_multimodal_checkpoint(family, tmp_path):
    model, _ = multimodal_model(family, tie_word_embeddings=False)
    pair = FAMILIES[family].build_pair(checkpoint=save(model, tmp_path / family))
    assert "lm_head.weight" in pair.loading.state_dict and pair.ours.out_head.weight is not pair.ours.tok_emb.weight
    res = parity.assert_bit_exact(pair)
    assert res.coverage.ok and res.coverage.consumed["lm_head.weight"] == ["out_head.weight"] and not res.coverage.tied


def test_record_and_verify_a_multimodal_checkpoint(checkpoints, tmp_path, capsys):
    import json

    directory = checkpoints[0]["gemma4", torch.float32, False]
    assert main(["record", "--reference", str(directory), "--out", str(tmp_path / "golden")]) == 0
    manifest = json.loads((tmp_path / "golden" / "manifest.json").read_text())
    assert manifest["reference"]["class"] == "Gemma4ForConditionalGeneration"
    assert manifest["reference"]["layer_prefix"] == "model.language_model.layers"
    assert main(["record", "--verify", str(tmp_path / "golden"), "--report-dir", str(tmp_path)]) == 0
    assert "reproduces: every node bit for bit" in capsys.readouterr().out
