"""Scale without changing the answer: traces that spill to disk, ours compared as it runs and
dropped, checkpoints memory-mapped, the memory guard's numbers, and where the models run."""

from __future__ import annotations

import math
import os
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open

import parity
import parity.compare.metrics as metrics
from parity.cli import main
from parity.compare.metrics import tensor_metrics
from parity.record.store import Spill, TensorStore
from parity.run.memory import one_trace_bytes
from parity.run.options import CheckOptions
from parity.run.plan import plan
from parity.run.stages import trace_ours, trace_reference
from parity.util.errors import ConfigError, ParityError
from parity.util.resources import available_bytes
from reference_pairs.llama3 import build_pair as llama3_pair
from reference_pairs.olmo3 import build_pair as olmo3_pair

needs_accelerate = pytest.mark.skipif(
    __import__("importlib").util.find_spec("accelerate") is None,
    reason="--device-map needs accelerate (pip install accelerate)",
)


def spill_folders() -> set[str]:
    return {p.name for p in Path(tempfile.gettempdir()).glob(f"parity-trace-*-{os.getpid()}-*")}


def results(res) -> list[tuple]:
    """Every number and word of every node, chained and isolated (what a report shows)."""
    return [
        (
            n.name,
            n.status,
            n.max_abs,
            n.mean_abs,
            n.max_rel,
            n.cosine,
            n.rel_l2,
            n.atol_needed,
            n.rtol_needed,
            n.hint_text,
        )
        for n in (*res.nodes, *(res.isolated or ()))
    ]


def scale_q(pair):
    """A fault in ours only: the query projection's output times 1.01 (a new Parameter)."""
    att = pair.ours.blocks[1].att
    att.W_query.weight = torch.nn.Parameter(att.W_query.weight.detach() * 1.01, requires_grad=False)


# --- the same answer, whatever is kept in memory ----------------------------------------------------


def test_a_check_whose_traces_all_spill_to_disk_gives_the_same_result_and_leaves_no_files():
    pair = olmo3_pair("yarn")
    scale_q(pair)
    before = spill_folders()
    in_memory = parity.check(pair, mode="both", trace_memory=None)
    spilled = parity.check(pair, mode="both", trace_memory=0)
    assert spilled.meta["trace_spilled_bytes"] > 0 and in_memory.meta["trace_spilled_bytes"] == 0
    assert results(spilled) == results(in_memory)
    assert spilled.first_mismatch.hint is not None and spilled.profile == in_memory.profile
    assert spilled.logits == in_memory.logits
    assert spill_folders() == before


def test_ours_keeps_only_the_first_failure_and_what_its_diagnosis_reads():
    pair = olmo3_pair("tiny")
    scale_q(pair)
    run = plan(pair, CheckOptions(seq_len=16))
    ref = trace_reference(pair, run)
    ours = trace_ours(pair, run, reference=ref)
    try:
        first = min((r for r in ours.results.values() if r.failed), key=lambda r: r.index)
        assert first.name == "model.layers.1.self_attn.q_proj"
        assert set(ours.tensors) == {first.name}  # its input for the diagnosis, nothing else of ours
        assert set(ours.inputs) == {first.name}
        assert len(ours.results) == len(ref.tensors) and "logits" in ours.watched
    finally:
        ref.close()
        ours.close()


def test_a_failing_attention_node_keeps_q_and_k_of_its_own_attention():
    """softmax_temperature reads ours' q_rot and k_rot: they are kept with the failing probs."""
    pair = olmo3_pair("tiny")
    att = pair.ours.blocks[2].att
    att.scale = att.scale * 1.1
    run = plan(pair, CheckOptions(seq_len=16))
    ref = trace_reference(pair, run)
    ours = trace_ours(pair, run, reference=ref)
    try:
        stem = "model.layers.2.self_attn"
        assert set(ours.tensors) == {f"{stem}.scores", f"{stem}.q_rot", f"{stem}.k_rot"}
    finally:
        ref.close()
        ours.close()
    assert parity.check(pair).first_mismatch.hint.kind == "attention_scale"


def test_spilled_tensors_read_back_bit_for_bit_as_safetensors_files(tmp_path):
    store = TensorStore(Spill(budget=0))
    tensors = {
        "f32": torch.randn(3, 5),
        "bf16": torch.randn(4, 7).bfloat16(),
        "f64": torch.randn(2, 2).double(),
        "strided": torch.randn(6, 4).t(),
        "empty": torch.zeros(0, 3),
        "nan": torch.tensor([float("nan"), float("inf"), -0.0]),
    }
    for name, t in tensors.items():
        store[name] = t
    assert list(store) == list(tensors) and store.spill.in_memory == 0
    for name, t in tensors.items():
        back = store[name]
        assert back.dtype == t.dtype and back.shape == t.shape
        assert torch.equal(back.contiguous().view(-1).view(torch.uint8), t.contiguous().view(-1).view(torch.uint8))
    path = store._items["bf16"].path
    with safe_open(path, framework="pt") as fh:  # the files are ordinary safetensors
        assert torch.equal(fh.get_tensor("tensor"), tensors["bf16"])
    del store["bf16"]
    assert not path.exists()
    folder = store.spill.folder
    store.spill.close()
    assert not folder.exists()


def test_a_store_keeps_tensors_in_memory_up_to_its_budget():
    store = TensorStore(Spill(budget=100))
    store["a"] = torch.zeros(20)  # 80 bytes
    store["b"] = torch.zeros(20)  # would pass 100: to disk
    assert not store.spilled("a") and store.spilled("b")
    del store["a"]
    store["c"] = torch.zeros(20)
    assert not store.spilled("c")
    store.spill.close()


# --- comparison: exact where it decides, a chunk at a time ------------------------------------------


def oracle(a: torch.Tensor, b: torch.Tensor, atol: float, rtol: float) -> dict:
    """The metrics the slow, obvious way (whole tensors, float64 sums, mask indexing)."""
    work = torch.float64 if torch.float64 in (a.dtype, b.dtype) else torch.float32
    a, b = a.to(work).reshape(-1), b.to(work).reshape(-1)
    d, babs = (a - b).abs(), b.abs()
    allowed = babs * rtol
    over = (d - atol) > 0
    rtol_needed = 0.0
    if bool(over.any()):
        rtol_needed = math.inf if bool((babs[over] == 0).any()) else float(((d - atol)[over] / babs[over]).max())
    nonzero = babs > 0
    na, nb = float(a.double().norm()), float(b.double().norm())
    return dict(
        status="mismatch" if bool((d > allowed + atol).any()) else "ok",
        max_abs=float(d.max()),
        mean_abs=float(d.double().mean()),
        max_rel=float((d[nonzero] / babs[nonzero]).max()) if bool(nonzero.any()) else 0.0,
        cosine=1.0 if na == nb == 0 else 0.0 if 0 in (na, nb) else float((a.double() * b.double()).sum()) / (na * nb),
        rel_l2=float(d.double().norm()) / nb if nb else (0.0 if float(d.max()) == 0 else math.inf),
        atol_needed=max(0.0, float((d - allowed).max())),
        rtol_needed=rtol_needed,
    )


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 40),
    seed=st.integers(0, 10_000),
    kind=st.sampled_from(["equal", "noise", "zeros", "scaled", "part"]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float64]),
    tol=st.sampled_from([(0.0, 0.0), (1e-4, 1e-4), (1e-3, 0.0), (0.0, 1e-2)]),
)
def test_chunked_metrics_match_the_whole_tensor_computation(n, seed, kind, dtype, tol):
    g = torch.Generator().manual_seed(seed)
    ref = torch.randn(n, generator=g)
    ours = {
        "equal": ref.clone(),
        "noise": ref + 1e-4 * torch.randn(n, generator=g),
        "zeros": torch.where(torch.rand(n, generator=g) > 0.5, ref, 0.0),
        "scaled": ref * 1.5,
        "part": torch.cat([ref[: n // 2], ref[n // 2 :] * 1.001]),
    }[kind]
    if kind == "zeros":
        ref, ours = torch.where(torch.rand(n, generator=g) > 0.5, ref, 0.0), ours  # noqa: PLW0127 (ours unchanged, said)
    ours, ref = ours.to(dtype), ref.to(dtype)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(metrics, "CHUNK", 7)  # many chunks, and a short last one
        got = tensor_metrics(ours, ref, *tol).fields()
    want = oracle(ours, ref, *tol)
    for key in ("status", "max_abs", "max_rel", "atol_needed", "rtol_needed"):  # exact: they decide and bound
        assert got[key] == want[key], key
    for key in ("mean_abs", "cosine", "rel_l2"):
        assert got[key] == pytest.approx(want[key], rel=1e-6, abs=1e-12), key


def test_a_non_finite_value_in_any_chunk_is_reported_as_such(monkeypatch):
    monkeypatch.setattr(metrics, "CHUNK", 4)
    ref = torch.arange(10.0)
    ours = ref.clone()
    ours[9] = float("inf")
    m = tensor_metrics(ours, ref, 1e-4, 1e-4)
    assert m.status == "nonfinite" and "index (9,)" in m.detail
    both = ref.clone()
    both[5] = float("nan")
    assert tensor_metrics(both, both.clone(), 0.0, 0.0).status == "nonfinite"  # NaN never equals itself


# --- weights: memory-mapped from the checkpoint; in-place edits still refused ----------------------


def _mapped_file(tensor: torch.Tensor) -> str | None:
    address = tensor.untyped_storage().data_ptr()
    with open("/proc/self/maps") as fh:
        for line in fh:
            parts = line.split()
            start, end = (int(x, 16) for x in parts[0].split("-"))
            if start <= address < end:
                return parts[5] if len(parts) > 5 else None
    return None


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads /proc/self/maps (Linux)")
def test_checkpoint_weights_are_memory_mapped_from_their_shards_not_copied(checkpoint_of):
    folder = checkpoint_of(olmo3_pair("tiny"), sharded=True)
    pair = olmo3_pair(checkpoint=str(folder))
    key = "model.layers.1.mlp.up_proj.weight"
    mapped = _mapped_file(pair.loading.state_dict[key])
    assert mapped is not None and Path(mapped).parent == folder.resolve() and mapped.endswith(".safetensors")
    assert (
        pair.ours.blocks[1].ff.fc2.weight.untyped_storage().data_ptr()
        == pair.loading.state_dict[key].untyped_storage().data_ptr()
    )
    assert parity.check(pair).passed


def test_an_in_place_edit_during_the_forward_is_refused():
    pair = olmo3_pair("tiny")
    norm = pair.ours.final_norm
    forward = norm.forward

    def folding_forward(x):  # a forward that folds a scale into its weight, in place
        with torch.no_grad():
            norm.weight.mul_(1.0)
        return forward(x)

    norm.forward = folding_forward
    with pytest.raises(ParityError, match=r"changed in place during the forward passes \(model.norm.weight\)"):
        parity.check(pair)


# --- the memory guard -------------------------------------------------------------------------------


@pytest.mark.parametrize("build", [olmo3_pair, llama3_pair])
def test_the_trace_estimate_covers_the_traces_actually_recorded(build):
    pair = build("tiny")
    run = plan(pair, CheckOptions(seq_len=24, batch_size=2))
    ref = trace_reference(pair, run)
    recorded = sum(t.numel() * t.element_size() for store in (ref.tensors, ref.inputs) for t in store.values())
    ref.close()
    estimate = one_trace_bytes(pair.facts, 2, 24, 4)
    assert recorded <= estimate <= 4 * recorded


def test_a_check_past_memory_or_disk_is_refused_with_numbers(monkeypatch):
    pair = olmo3_pair("tiny")
    monkeypatch.setattr("parity.util.resources.available_bytes", lambda: 64 * 1024**2)
    with pytest.raises(ParityError, match=r"tracing 1 x 4000 tokens needs about [\d.]+ GiB but 0\.1 GiB are available"):
        parity.check(pair, seq_len=4000)
    monkeypatch.setattr("parity.util.resources.available_bytes", lambda: 1024**4)
    monkeypatch.setattr("parity.util.resources.disk_free_bytes", lambda folder=None: 2 * 1024**3)
    with pytest.raises(ParityError, match=r"needs about [\d.]+ GiB of disk in .* but 2\.0 GiB are free"):
        parity.check(pair, seq_len=4000, trace_memory=0)


def test_available_memory_is_known_without_psutil(monkeypatch):
    monkeypatch.setitem(sys.modules, "psutil", None)  # import psutil fails
    if not Path("/proc/meminfo").exists():
        pytest.skip("reads /proc/meminfo (Linux)")
    assert available_bytes() > 0


# --- devices ------------------------------------------------------------------------------------------


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present")
def test_a_device_that_is_not_there_is_one_line_of_bad_input(tmp_path, capsys):
    with pytest.raises(ConfigError, match=r"^device cuda cannot be used: this torch has no CUDA device"):
        olmo3_pair("tiny", device="cuda")
    assert main(["check", "olmo3", "--device", "cuda", "--report-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("parity: error: --device cuda cannot be used") and len(err.splitlines()) == 1
    assert main(["check", "olmo3", "--device", "cpu", "--device-map", "auto", "--report-dir", str(tmp_path)]) == 2
    assert "give one" in capsys.readouterr().err


def test_device_cpu_runs_the_check(tmp_path):
    assert main(["check", "olmo3", "--device", "cpu", "--report-dir", str(tmp_path)]) == 0
    pair = olmo3_pair("tiny", device="cpu")
    assert pair.source.device == "cpu" and parity.check(pair).meta["device"] == "cpu"


@needs_accelerate
def test_device_map_auto_runs_through_accelerate_and_still_shares_one_copy(tmp_path):
    pair = olmo3_pair("yarn", device_map="auto")
    assert hasattr(pair.reference, "_hf_hook") and hasattr(pair.ours, "_hf_hook")  # accelerate's dispatch hooks
    assert pair.source.device == "device_map=auto"
    res = parity.check(pair, mode="both")
    assert res.passed and res.coverage.ok
    scale_q(pair)
    assert parity.check(pair).first_mismatch.name == "model.layers.1.self_attn.q_proj"
    with torch.no_grad():
        pair.ours.tok_emb.weight.mul_(2.0)
    with pytest.raises(ParityError, match="changed in place before the check"):
        parity.check(pair)
    assert main(["check", "llama3", "--device-map", "auto", "--report-dir", str(tmp_path)]) == 0


@needs_accelerate
@pytest.mark.parametrize("placement", [{"device": "cpu"}, {"device_map": "auto"}])
def test_check_model_runs_a_users_model_where_it_is_placed(placement):
    sys.path.insert(0, str(Path(__file__).parent / "user_models"))
    try:
        import litgpt_llama
    finally:
        sys.path.pop(0)
    res = parity.check_model(litgpt_llama.build, "llama3", **placement)
    assert res.passed and res.coverage.ok, res.verdict()
    assert res.meta["device"] == ("cpu" if "device" in placement else "device_map=auto")


def test_a_failing_node_too_large_to_diagnose_is_reported_without_a_hint(monkeypatch):
    pair = olmo3_pair("tiny")
    scale_q(pair)
    monkeypatch.setattr(
        sys.modules["parity.run.stages"], "available_bytes", lambda: 1024
    )  # the run fits; its diagnosis not
    res = parity.check(pair)
    assert res.first_mismatch.name == "model.layers.1.self_attn.q_proj" and res.first_mismatch.hint is None
    assert any(note.startswith("model.layers.1.self_attn.q_proj was not diagnosed (no hint)") for note in res.notes)
    assert res.profile is not None and res.logits is not None
