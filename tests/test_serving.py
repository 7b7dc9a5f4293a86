"""Serving parity in a real engine: each export of heads for the embedded target loads in vLLM 0.32 (the venv
scripts/engines.sh builds), offline, and serves greedy output identical to vLLM alone and to gorgon's, with the
acceptance gorgon measures for the same chain (scripts/serving_parity.py).

Marked `engines`; skipped unless GORGON_ENGINES names the folder the engines were built in:
    bash scripts/engines.sh && GORGON_ENGINES=~/.cache/gorgon/engines bash scripts/test.sh -m engines
The heads are untrained (a Medusa head drafts the target's own next token again; an EAGLE head starts from
the target's last layer), which still accept some drafts, and the draft vocabulary of the recipes.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from helpers import load_script, needs_embedded


def engine(name: str) -> Path | None:
    """An engine's venv under $GORGON_ENGINES, None when absent."""
    folder = Path(os.environ.get("GORGON_ENGINES", "/nonexistent")) / name
    built = {"vllm": "bin/python", "llama.cpp": "bin/llama-server"}[name]
    return folder if (folder / built).is_file() else None


def needs_engine(name: str):
    """Marked `engines`, and skipped in one line where the engine's venv is absent."""
    reason = f"no {name} venv in GORGON_ENGINES ({os.environ.get('GORGON_ENGINES', 'unset')}): build it with " \
             f"`bash scripts/engines.sh {name}` and set GORGON_ENGINES to its folder"
    return lambda test: pytest.mark.engines(pytest.mark.skipif(engine(name) is None, reason=reason)(test))


@pytest.fixture(scope="module")
def untrained_heads(tmp_path_factory, embedded_target):
    """Medusa heads, an EAGLE head and a parallel drafter for the embedded target, each drafting from its 8192
    first tokens (the recipes' draft vocabulary size), saved as training saves them."""
    from gorgon.heads import EagleHead, MedusaHeads
    from gorgon.heads.methods.parallel import ParallelHead
    from gorgon.heads.target import EMBEDDED_NAME

    folder, target = tmp_path_factory.mktemp("heads"), embedded_target
    medusa = MedusaHeads.for_target(target.model, num_heads=3, target_name=EMBEDDED_NAME,
                                    target_fingerprint=target.fingerprint)
    medusa.set_draft_vocab(torch.arange(8192))
    medusa.save_pretrained(folder / "medusa")
    EagleHead.for_target(target.model, None, torch.arange(8192), EMBEDDED_NAME, target.fingerprint, depth=3,
                         topk=1).save_pretrained(folder / "eagle")
    ParallelHead.for_target(target.model, 3, None, torch.arange(8192), EMBEDDED_NAME,
                            target.fingerprint).save_pretrained(folder / "parallel")
    return folder


@pytest.fixture(scope="module")
def parity_out(tmp_path_factory):
    """One folder for the module's checks, so that they share vLLM's run without a draft."""
    return tmp_path_factory.mktemp("parity")


@needs_engine("vllm")
@needs_embedded
@pytest.mark.parametrize("fmt", ["vllm", "eagle3", "speculators", "peagle"])
def test_an_export_serves_in_vllm_as_gorgon_decodes_it(untrained_heads, parity_out, fmt):
    """vLLM refused the Medusa export with a draft vocabulary, and loaded the speculators export's verifier from the
    Hub; vLLM serves a parallel drafter (peagle) as EAGLE-3 with parallel drafting. Every export serves the
    target's own output, accepting what gorgon accepts (counted in the output: vLLM's counters also count drafts
    its last step accepts past the length), within the 3% issue 60 allows."""
    parity = load_script("serving_parity")
    heads = untrained_heads / {"vllm": "medusa", "peagle": "parallel"}.get(fmt, "eagle")
    report = parity.serving_parity(str(heads), fmt, engines=engine("vllm").parent, limit=2, max_new_tokens=24,
                                   out=parity_out)
    assert report["identical"] == {"engine+draft == engine": 2, "gorgon == engine": 2}, report["first_differences"]
    accept = report["acceptance_length"]
    assert accept["engine_kept"] == pytest.approx(accept["gorgon"], rel=0.03), report


@needs_engine("llama.cpp")
@needs_embedded
def test_an_eagle3_export_serves_in_llama_cpp_as_gorgon_decodes_it(untrained_heads, parity_out):
    """llama.cpp's converter reads the EAGLE-3 export (and the target, in float32); its server's greedy output with
    the draft equals its own without it and gorgon's, accepting what gorgon accepts (counted in the output)."""
    parity = load_script("serving_parity")
    report = parity.serving_parity(str(untrained_heads / "eagle"), "eagle3", engine="llama.cpp",
                                   engines=engine("llama.cpp").parent, limit=2, max_new_tokens=24, out=parity_out)
    assert report["identical"] == {"engine+draft == engine": 2, "gorgon == engine": 2}, report["first_differences"]
    accept = report["acceptance_length"]
    assert accept["engine_kept"] == pytest.approx(accept["gorgon"], rel=0.03), report
    assert report["engine_version"].startswith("llama.cpp ")


def test_an_engine_that_cannot_serve_the_format_is_refused_in_one_line(tmp_path):
    """Before anything loads: llama.cpp reads EAGLE-3 drafts only, and an engine gorgon does not drive is named."""
    from gorgon.heads.errors import GorgonError

    parity = load_script("serving_parity")
    for engine_name, fmt, says in (("llama.cpp", "vllm", "llama.cpp serves EAGLE-3 drafts: pass an EAGLE head with "
                                                          "--format eagle3, not vllm"),
                                   ("sglang", "eagle3", "no engine 'sglang': use vllm or llama.cpp")):
        with pytest.raises(GorgonError, match=says):
            parity.serving_parity(str(tmp_path), fmt, engine=engine_name, out=tmp_path / "out")


def test_the_engine_checks_write_only_into_a_folder_of_their_own(tmp_path):
    """serving_parity and llama_cpp_peer share one predicate for --out: new, empty, or holding only what the two
    write (a run goes on there); a user's file in it, or a file as --out, is refused before any work."""
    from gorgon.heads.errors import GorgonError

    parity, peer = load_script("serving_parity"), load_script("llama_cpp_peer")
    out = tmp_path / "out"
    parity.check_run_folder(out)  # new
    out.mkdir()
    for name in ("export-eagle3", "llama.cpp", "vllm-alone.json", "llama.cpp-eagle3.log", "parity-vllm-vllm.json",
                 "peer.json", ".peer.json.host-1-0123abcd.tmp"):
        (out / name).write_text("")
    parity.check_run_folder(out)
    (out / "notes.txt").write_text("mine")
    with pytest.raises(GorgonError, match="holds notes.txt, which these engine checks did not write"):
        parity.check_run_folder(out)
    with pytest.raises(GorgonError, match="holds notes.txt"):  # before the heads are even read
        peer.peer(str(tmp_path / "no-heads"), out=out)
    with pytest.raises(GorgonError, match="is a file: pass a folder"):
        parity.check_run_folder(out / "notes.txt")
    assert (out / "notes.txt").read_text() == "mine"


@needs_engine("llama.cpp")
@needs_embedded
def test_llama_cpp_peer_times_every_row_and_goes_on_from_its_report(untrained_heads, parity_out):
    """scripts/llama_cpp_peer.py: gorgon and llama.cpp (alone, prompt lookup, EAGLE-3; the float32 GGUF and the
    embedded target's own Q4_1) on the same prompts; each draft's output equals its own plain decoding; a second
    run with more questions keeps the first one's rows and times only the new question."""
    peer = load_script("llama_cpp_peer")
    heads = str(untrained_heads / "eagle")
    first = peer.peer(heads, limit=1, max_new_tokens=16, engines=engine("llama.cpp").parent, out=parity_out)
    report = peer.peer(heads, limit=2, max_new_tokens=16, engines=engine("llama.cpp").parent, out=parity_out)
    assert report["questions"][0] == first["questions"][0] and len(report["questions"]) == 2
    rows = report["summary"]["rows"]
    assert list(rows) == ["generate", "gorgon"] + [f"llama.cpp-{kind}{how}" for kind in ("f32", "Q4_1")
                                                   for how in ("", "-lookup", "-eagle3")]
    for name in ("gorgon", "llama.cpp-f32-eagle3", "llama.cpp-f32-lookup"):
        assert rows[name]["identical"] == 2, (name, report["questions"])
    assert all(row["tokens_per_s"] > 0 for row in rows.values())
    assert rows["llama.cpp-f32-eagle3"]["tau"] > 1  # the untrained head's drafts of the target's own features


def test_llama_cpp_peer_sums_each_row_against_its_own_plain_decoding():
    """Speedups and identical counts are taken against the row's own plain decoding: gorgon against `generate`,
    a llama.cpp draft against the same GGUF alone; tau counts the target's forwards (llama.cpp's: one per
    token it did not accept from the draft)."""
    peer = load_script("llama_cpp_peer")

    def row(tokens, seconds, **extra):
        return {"tokens": tokens, "seconds": seconds, **extra}

    questions = [{"busy_cores": 0.1, "rows": {
        "generate": row([1, 2, 3, 4], 4.0), "gorgon": row([1, 2, 3, 4], 2.0, target_forwards=2),
        "llama.cpp-f32": row([1, 2, 3, 5], 1.0), "llama.cpp-f32-eagle3": row([1, 2, 3, 5], 0.5, accepted=2)}},
        {"busy_cores": 0.3, "rows": {
            "generate": row([7, 8], 2.0), "gorgon": row([7, 9], 1.0, target_forwards=1),
            "llama.cpp-f32": row([7, 8], 1.0), "llama.cpp-f32-eagle3": row([7, 8], 0.5, accepted=0)}}]
    s = peer.summary(questions)
    assert s["rows"]["generate"] == {"tokens_per_s": 1.0, "speedup_over_generate": 1.0}
    assert s["rows"]["gorgon"] == {"tokens_per_s": 2.0, "speedup_over_generate": 2.0, "speedup": 2.0,
                                   "identical": 1, "tau": 2.0}
    assert s["rows"]["llama.cpp-f32-eagle3"] == {"tokens_per_s": 6.0, "speedup_over_generate": 6.0, "speedup": 2.0,
                                                 "identical": 2, "tau": 1.5}
    assert s["llama.cpp-f32 == generate"] == 1 and s["busy_cores"] == pytest.approx(0.2)
    assert "| gorgon | 2.0 | 2.00x | 2.00x | 2.00 | 1/2 |" in peer.table({"summary": s, "questions": questions,
                                                                          "llama.cpp": "b1"})


def test_llama_cpp_peer_goes_on_only_from_a_run_of_the_same_settings(tmp_path):
    """OUT/peer.json of the same settings is gone on from; one of other settings is refused in one line, and kept."""
    from gorgon.heads.errors import GorgonError

    peer = load_script("llama_cpp_peer")
    path, settings = tmp_path / "peer.json", {"heads": "/h", "max_new_tokens": 64}
    assert peer.earlier_report(path, settings) is None
    path.write_text('{"settings": {"heads": "/h", "max_new_tokens": 64}, "questions": [1]}')
    assert peer.earlier_report(path, settings)["questions"] == [1]
    with pytest.raises(GorgonError, match="holds a run of other settings: pass another --out, or the same options"):
        peer.earlier_report(path, {**settings, "max_new_tokens": 32})
    assert "questions" in path.read_text()
