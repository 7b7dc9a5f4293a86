"""Self-distillation data: prompt shapes, `self` prompts, multi-turn, resume after SIGKILL, bad input."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import datasets
import pytest
import torch
from helpers import (
    ARCHS,
    ROOT,
    VOCAB,
    another_live_process,
    foreign_folder,
    load_script,
    needs_embedded,
    tiny_chat_target,
    tiny_model,
    toy_data,
)

from gorgon.decode.kernels import fast_kernels_unavailable, use_cpu_kernels
from gorgon.heads import GorgonError, load_target
from gorgon.train.batching import continuous_generate
from gorgon.train.data import METADATA_NAME, DataSettings, make_dataset, read_metadata
from gorgon.train.records import load_conversations

SHAPES = {
    "mtbench": {"question_id": 7, "category": "x", "turns": ["first q", "second q"]},
    "sharegpt": {"id": "a", "conversations": [
        {"from": "system", "value": "be brief"}, {"from": "human", "value": "first q"},
        {"from": "gpt", "value": "old answer"}, {"from": "human", "value": "second q"}]},
    "openai": {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "first q"},
                            {"role": "assistant", "content": "old"}, {"role": "user", "content": "second q"}]},
    "prompt": {"prompt": "first q"},
    "alpaca": {"instruction": "first q", "input": "extra", "output": "ignored"},
}


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


@pytest.mark.parametrize("shape", SHAPES)
def test_each_prompt_shape(tmp_path, shape):
    (conv,) = load_conversations(write_jsonl(tmp_path / "p.jsonl", [SHAPES[shape]]))
    expected = {"mtbench": ["first q", "second q"], "sharegpt": ["first q", "second q"],
                "openai": ["first q", "second q"], "prompt": ["first q"], "alpaca": ["first q\n\nextra"]}[shape]
    assert conv["turns"] == expected
    assert conv["system"] == ("be brief" if shape in ("sharegpt", "openai") else None)


def test_unicode_line_separators_inside_strings_are_not_line_breaks(tmp_path):
    (tmp_path / "p.jsonl").write_text(json.dumps({"prompt": "a\u2028b\x85c"}, ensure_ascii=False) + "\n",
                                      encoding="utf-8")
    assert load_conversations(str(tmp_path / "p.jsonl"))[0]["turns"] == ["a\u2028b\x85c"]


def test_json_file_and_dataset_folder(tmp_path):
    (tmp_path / "p.json").write_text(json.dumps([SHAPES["prompt"], SHAPES["alpaca"]]))
    assert len(load_conversations(str(tmp_path / "p.json"))) == 2
    datasets.Dataset.from_list([SHAPES["openai"]] * 3).save_to_disk(str(tmp_path / "ds"))
    assert [c["turns"] for c in load_conversations(str(tmp_path / "ds"), limit=2)] == [["first q", "second q"]] * 2


def test_bad_prompt_files(tmp_path):
    with pytest.raises(GorgonError, match="record 1 has no shape gorgon reads.*accepted shapes: MT-Bench"):
        load_conversations(write_jsonl(tmp_path / "a.jsonl", [{"text": "hello"}]))
    (tmp_path / "b.jsonl").write_text('{"prompt": "ok"}\n{not json\n')
    with pytest.raises(GorgonError, match="line 2 is not valid JSON"):
        load_conversations(str(tmp_path / "b.jsonl"))
    with pytest.raises(GorgonError, match="not found"):
        load_conversations(str(tmp_path / "missing.jsonl"))
    with pytest.raises(GorgonError, match="holds no prompts"):
        load_conversations(write_jsonl(tmp_path / "c.jsonl", [{"prompt": "  "}]))
    (tmp_path / "folder").mkdir()
    with pytest.raises(GorgonError, match="not a saved `datasets` dataset"):
        load_conversations(str(tmp_path / "folder"))


def test_multi_turn_answers_with_the_targets_own_history(tmp_path):
    target = tiny_chat_target(tmp_path)
    src = write_jsonl(tmp_path / "p.jsonl", [SHAPES["sharegpt"], SHAPES["prompt"]])
    out = make_dataset(DataSettings(prompts=src, target=str(target), max_new_tokens=12, turns="all",
                                    batch_size=2), tmp_path / "out", progress=False)
    rows = list(datasets.load_from_disk(str(out)))
    roles = [[m["role"] for m in r["messages"]] for r in rows]
    assert roles == [["system", "user", "assistant", "user", "assistant"], ["user", "assistant"]]
    assert rows[0]["messages"][2]["content"] != "old answer"   # regenerated, not copied
    meta = json.loads((out / METADATA_NAME).read_text())
    assert meta["settings"]["turns"] == "all" and len(meta["target_fingerprint"]) == 16
    first_only = make_dataset(DataSettings(prompts=src, target=str(target), max_new_tokens=12),
                              tmp_path / "first", progress=False)
    assert [len(r["messages"]) for r in datasets.load_from_disk(str(first_only))] == [3, 2]


def test_self_prompts_are_written_by_the_target_and_deduplicated(tmp_path):
    target = tiny_chat_target(tmp_path)
    out = make_dataset(DataSettings(prompts="self", target=str(target), limit=5, max_new_tokens=10, batch_size=5),
                       tmp_path / "out", progress=False)
    rows = list(datasets.load_from_disk(str(out)))
    users = [r["messages"][0]["content"] for r in rows]
    assert len(rows) == 5 and len(set(users)) == 5
    with pytest.raises(GorgonError, match="needs --limit"):
        make_dataset(DataSettings(prompts="self", target=str(target)), tmp_path / "x", progress=False)


def test_a_shortfall_of_self_prompts_is_a_warning_on_stderr(tmp_path, capsys):
    """One-token prompts are under the 8 characters kept: the target writes fewer than asked, and says so
    beside its progress bar, not in the command's result on stdout."""
    from gorgon.heads.target import load_target
    from gorgon.train.data import Engine, self_prompts

    settings = DataSettings(prompts="self", max_new_tokens=1)
    prompts = self_prompts(Engine(load_target(tiny_chat_target(tmp_path)), settings), settings, 3, progress=False)
    out, err = capsys.readouterr()
    assert len(prompts) < 3 and "distinct prompts of the 3 asked for" in err and "distinct" not in out


def test_prompts_longer_than_the_context_are_skipped_and_counted(tmp_path):
    target = tiny_chat_target(tmp_path)  # context 512
    src = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "short"}, {"prompt": "y" * 60}, {"prompt": "x" * 600}])
    out = make_dataset(DataSettings(prompts=src, target=str(target), max_new_tokens=8), tmp_path / "o", progress=False)
    assert len(datasets.load_from_disk(str(out))) == 2
    assert json.loads((out / METADATA_NAME).read_text())["skipped_turns_too_long"] == 1
    capped = make_dataset(DataSettings(prompts=src, target=str(target), max_new_tokens=8, max_prompt_tokens=30),
                          tmp_path / "capped", progress=False)  # the 60 y's are over the cap, not the context
    assert len(datasets.load_from_disk(str(capped))) == 1
    assert json.loads((capped / METADATA_NAME).read_text())["skipped_turns_too_long"] == 2


def _alone(model, prompts, eos, max_new_tokens):
    """What plain greedy `generate` answers for each prompt alone, EOS and after dropped."""
    answers = []
    for p in prompts:
        tokens = model.generate(torch.tensor([p]), max_new_tokens=max_new_tokens, do_sample=False,
                                eos_token_id=sorted(eos), pad_token_id=0)[0, len(p):].tolist()
        answers.append(tokens[:next((j for j, t in enumerate(tokens) if t in eos), len(tokens))])
    return answers


def _ragged_prompts(n=(3, 150, 1, 60, 7, 200, 20, 2, 90, 33)):
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(30, VOCAB, (k,), generator=gen).tolist() for k in n]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("batch_size,batch_tokens", [(3, 10**6), (16, 10**6), (8, 400)])
def test_continuous_batching_equals_generate_alone(arch, batch_size, batch_tokens):
    """Rows of very different prompt and answer lengths join and leave; each greedy answer is what
    `generate` gives for its prompt alone (fp32). Tokens 5-8 end a row, so answers end early."""
    model = tiny_model(arch)
    eos = set(range(5, 9))
    prompts = _ragged_prompts()
    expected = _alone(model, prompts, eos, 40)
    lengths = sorted({len(e) for e in expected})
    assert len(lengths) >= 3 and lengths[-1] == 40, lengths  # the test needs short, long and cut-off rows
    finished = []
    with torch.inference_mode():
        got = continuous_generate(model, prompts, max_new_tokens=40, eos=eos, pad=0, batch_size=batch_size,
                                  batch_tokens=batch_tokens, on_done=lambda n, t: finished.append((n, t)))
    assert got == expected
    assert sum(n for n, _ in finished) == len(prompts) and sum(t for _, t in finished) == sum(map(len, got))


@pytest.mark.skipif(fast_kernels_unavailable(torch.float32) is not None, reason="no oneDNN fast path here")
def test_continuous_batching_on_fast_kernels_equals_generate_alone_on_them():
    """`gorgon data` runs on the prepacked oneDNN kernels by default; 1-row and many-row products
    there must still give each prompt the answer `generate` gives it alone on the same kernels."""
    model = tiny_model()
    use_cpu_kernels(model, "fast")
    eos = set(range(5, 9))
    prompts = _ragged_prompts()
    expected = _alone(model, prompts, eos, 40)
    with torch.inference_mode():
        for batch_size in (3, 16):
            assert continuous_generate(model, prompts, max_new_tokens=40, eos=eos, pad=0, batch_size=batch_size,
                                       batch_tokens=10**6) == expected


def test_sampled_answers_depend_on_their_seed_not_their_batch():
    """Each prompt samples from its own seed, so `gorgon data` may batch shards together (and a
    resumed run may batch them differently) without changing any answer."""
    model = tiny_model()
    prompts = [[40 + i] * (1 + 7 * i) for i in range(6)]

    def run(prompts, seeds, batch_size=4):
        with torch.inference_mode():
            return continuous_generate(model, prompts, max_new_tokens=12, eos=set(), pad=0, batch_size=batch_size,
                                       batch_tokens=10**6, temperature=1.0, top_p=0.9, seeds=seeds)

    together = run(prompts, list(range(6)))
    assert all(len(r) == 12 for r in together)
    assert together == run(prompts, list(range(6)))
    assert run(prompts[3:], [3, 4, 5], batch_size=1) == together[3:]
    assert run(prompts[::-1], list(range(6))[::-1], batch_size=2) == together[::-1]
    assert run(prompts, list(range(10, 16))) != together
    with pytest.raises(ValueError, match="one seed per prompt"):
        run(prompts, None)


def test_no_chat_template_is_a_clear_error(tmp_path):
    from helpers import tiny_model, tiny_tokenizer

    path = tmp_path / "plain"
    tiny_model(vocab=128).save_pretrained(path)
    tiny_tokenizer(chat_template=None).save_pretrained(path)
    src = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "hi"}])
    with pytest.raises(GorgonError, match="no chat template: pass --chat-template"):
        make_dataset(DataSettings(prompts=src, target=str(path)), tmp_path / "o", progress=False)
    # A broken one fails in one line before the unfinished run's folder is made, so a fixed one starts afresh.
    (tmp_path / "broken.jinja").write_text("{% for m in messages %}{{ m.content ")
    with pytest.raises(GorgonError, match=r"^--chat-template failed \(TemplateSyntaxError: unexpected end of template"):
        make_dataset(DataSettings(prompts=src, target=str(path), chat_template=str(tmp_path / "broken.jinja")),
                     tmp_path / "o", progress=False)
    assert not (tmp_path / "o.partial").exists() and not (tmp_path / "o").exists()


@pytest.mark.slow
def test_resume_after_sigkill_equals_an_uninterrupted_run(tmp_path):
    target = tiny_chat_target(tmp_path)
    src = write_jsonl(tmp_path / "p.jsonl", [{"prompt": f"question number {i}"} for i in range(40)])
    args = ["--prompts", src, "--target", str(target), "--max-new-tokens", "48", "--shard-size", "2",
            "--batch-size", "2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "gorgon.heads.cli", "data"]
    out, partial = tmp_path / "killed", tmp_path / "killed.partial"
    proc = subprocess.Popen(cmd + args + ["--out", str(out)], env=env, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while not list(partial.glob("shard-*.jsonl")) and time.time() < deadline and proc.poll() is None:
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (out / METADATA_NAME).exists(), "the run finished before it could be killed"
    shards_before = len(list(partial.glob("shard-*.jsonl")))
    assert 1 <= shards_before < 20
    subprocess.run(cmd + args + ["--out", str(out)], env=env, check=True, capture_output=True)
    subprocess.run(cmd + args + ["--out", str(tmp_path / "whole")], env=env, check=True, capture_output=True)
    resumed, whole = datasets.load_from_disk(str(out)), datasets.load_from_disk(str(tmp_path / "whole"))
    assert list(resumed) == list(whole) and len(whole) == 40
    assert sorted(r["id"] for r in resumed) == sorted(str(i) for i in range(40))
    assert not partial.exists()


def test_resume_with_other_settings_is_refused(tmp_path):
    target = tiny_chat_target(tmp_path)
    src = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "a"}])
    (tmp_path / "o.partial").mkdir()
    settings = DataSettings(prompts=src, target=str(target), max_new_tokens=4, dtype="float32")  # as recorded
    record = {"settings": {**settings.__dict__, "seed": 9}, "fingerprint": "x"}
    (tmp_path / "o.partial" / "settings.json").write_text(json.dumps(record))
    # Refused before the target loads: a target that cannot load would fail otherwise.
    elsewhere = DataSettings(**{**settings.__dict__, "target": str(tmp_path / "missing")})
    with pytest.raises(GorgonError, match=r"other settings \(seed, target\): rerun with the same options "
                                          r"to resume it, or pass --overwrite to start over"):
        make_dataset(elsewhere, tmp_path / "o", progress=False)
    (tmp_path / "o.partial" / "settings.json").write_text(json.dumps({**record, "settings": settings.__dict__}))
    with pytest.raises(GorgonError, match=r"other settings \(target fingerprint\)"):
        make_dataset(settings, tmp_path / "o", progress=False)
    out = make_dataset(settings, tmp_path / "o", progress=False, overwrite=True)  # the old run is started over
    assert read_metadata(out)["settings"]["seed"] == settings.seed and not (tmp_path / "o.partial").exists()
    # A finished dataset asked for again with other settings is not passed off as the one asked for.
    with pytest.raises(GorgonError, match=r"o holds a dataset made with other settings \(max_new_tokens\): pass "
                                          r"--overwrite to regenerate it"):
        make_dataset(DataSettings(prompts=src, target=str(target), max_new_tokens=5), out, progress=False)
    with pytest.raises(GorgonError, match=r"other settings \(cpu_kernels\)"):  # they may round a near-tie apart
        make_dataset(settings, out, progress=False, cpu_kernels="stock")
    # A run killed between swapping its dataset in and removing its shards left them: the next run removes them.
    partial = tmp_path / "o.partial"
    partial.mkdir()
    (partial / "settings.json").write_text(json.dumps(read_metadata(out)))
    (partial / "shard-00000.jsonl").write_text("{}\n")
    assert make_dataset(settings, out, progress=False) == out and not partial.exists()


def test_a_run_killed_while_moving_into_an_empty_folder_is_finished_by_the_next(tmp_path, monkeypatch):
    """Into an existing empty --out the dataset moves entry by entry, its metadata first: a kill then left
    the metadata alone, which the next run took for a complete dataset, removing the shards."""
    import gorgon.train.data as data_module

    target = tiny_chat_target(tmp_path)
    src = write_jsonl(tmp_path / "p.jsonl", [{"prompt": f"question {i}"} for i in range(6)])
    settings = DataSettings(prompts=src, target=str(target), max_new_tokens=6)
    whole = make_dataset(settings, tmp_path / "whole", progress=False)
    out, move = tmp_path / "mine", data_module.move_into_place
    out.mkdir()

    def killed_after_the_metadata(tmp, folder, marker):
        os.replace(tmp / marker, folder / marker)
        raise KeyboardInterrupt

    monkeypatch.setattr(data_module, "move_into_place", killed_after_the_metadata)
    with pytest.raises(KeyboardInterrupt):
        make_dataset(settings, out, progress=False)
    assert [p.name for p in out.iterdir()] == [METADATA_NAME] and (tmp_path / "mine.partial").is_dir()
    monkeypatch.setattr(data_module, "move_into_place", move)
    assert make_dataset(settings, out, progress=False) == out and not (tmp_path / "mine.partial").exists()
    assert list(datasets.load_from_disk(str(out))) == list(datasets.load_from_disk(str(whole)))


def test_the_targets_dtype_is_chosen_and_recorded_as_resolved(tmp_path, capsys):
    """--dtype bfloat16 answers with the target in bfloat16 (1.77x the tokens per second of float32 on a CPU with
    AMX); the record names the dtype, not "auto" (which differs by device), so a rerun in another is refused."""
    target = tiny_chat_target(tmp_path)
    src = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "question"}])
    bf16 = DataSettings(prompts=src, target=str(target), max_new_tokens=4, dtype="bfloat16")
    out = make_dataset(bf16, tmp_path / "o", progress=False, device="cpu")
    assert read_metadata(out)["settings"]["dtype"] == "bfloat16" and len(datasets.load_from_disk(str(out))) == 1
    assert make_dataset(bf16, out, progress=False) == out and "already complete" in capsys.readouterr().out
    with pytest.raises(GorgonError, match=r"holds a dataset made with other settings \(dtype\)"):
        make_dataset(DataSettings(**{**bf16.__dict__, "dtype": "auto"}), out, progress=False, device="cpu")
    with pytest.raises(GorgonError, match="unknown dtype 'fp8'"):
        make_dataset(DataSettings(**{**bf16.__dict__, "dtype": "fp8"}), tmp_path / "p", progress=False)


def test_out_dot_writes_the_dataset_into_the_current_folder(tmp_path, monkeypatch):
    """`--out .` staged OUT.partial and the dataset inside the folder (`.`'s parent is `.`), then failed at the
    move, after all the work, leaving a folder a rerun refused."""
    target = tiny_chat_target(tmp_path)
    src = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "question"}])
    (tmp_path / "here").mkdir()
    monkeypatch.chdir(tmp_path / "here")
    make_dataset(DataSettings(prompts=src, target=str(target), max_new_tokens=4), Path("."), progress=False)
    assert len(datasets.load_from_disk(".")) == 1 and not any(p.name.startswith(".") for p in Path(".").iterdir())


def test_an_unfinished_run_another_live_process_writes_is_refused(tmp_path):
    """Two `gorgon data` into one --out raced: the second wrote the same shards, one removed OUT.partial at its
    swap under the other, and --overwrite started the other's shards over. The writer's lock refuses a second
    run while its process lives; a killed run's lock is not in the way; a run that fails before writing anything
    leaves no OUT.partial."""
    from gorgon.heads.files import host_name
    from gorgon.train.data import LOCK

    target = tiny_chat_target(tmp_path)
    src = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "a"}])
    settings = DataSettings(prompts=src, target=str(target), max_new_tokens=4, dtype="float32")  # as recorded
    with pytest.raises(GorgonError, match="no target at"):
        make_dataset(DataSettings(**{**settings.__dict__, "target": str(tmp_path / "missing")}), tmp_path / "o",
                     progress=False)
    assert not (tmp_path / "o.partial").exists()
    partial = tmp_path / "o.partial"
    partial.mkdir()
    (partial / "settings.json").write_text(json.dumps({"settings": settings.__dict__}))
    with another_live_process() as pid:
        (partial / LOCK).write_text(f"{host_name()} {pid}\n")
        for overwrite in (False, True):
            with pytest.raises(GorgonError, match=rf"o.partial is being written by another gorgon data run \(process "
                                                  rf"{pid}, still running\): wait for it to end, or stop it"):
                make_dataset(settings, tmp_path / "o", progress=False, overwrite=overwrite)
            assert (partial / "settings.json").is_file()
    out = make_dataset(settings, tmp_path / "o", progress=False)  # its process gone, the lock is stale
    assert read_metadata(out)["conversations"] == 1 and not partial.exists()


def test_an_edited_prompts_file_is_not_taken_for_the_one_a_run_used(tmp_path):
    target = tiny_chat_target(tmp_path)
    src = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "a"}, {"prompt": "b"}])
    settings = DataSettings(prompts=src, target=str(target), max_new_tokens=4, shard_size=1)
    out = make_dataset(settings, tmp_path / "o", progress=False)
    old = read_metadata(out)
    write_jsonl(tmp_path / "p.jsonl", [{"prompt": "a"}, {"prompt": "c"}])
    with pytest.raises(GorgonError, match=r"o holds a dataset made with other settings \(prompts_sha256 \(the "
                                          r"prompts' contents\)\)"):
        make_dataset(settings, tmp_path / "o", progress=False)
    # Another --limit of the same file takes other prompts: the limit is named, not the contents as if edited.
    with pytest.raises(GorgonError, match=r"o holds a dataset made with other settings \(limit\):"):
        make_dataset(DataSettings(**{**settings.__dict__, "limit": 1}), tmp_path / "o", progress=False)
    # An unfinished run of the old prompts, resumed after the file changed.
    shutil.rmtree(out)
    (tmp_path / "o.partial").mkdir()
    (tmp_path / "o.partial" / "settings.json").write_text(json.dumps({**old, "fingerprint": old["target_fingerprint"]}))
    with pytest.raises(GorgonError, match=r"o.partial holds an unfinished run with other settings \(prompts_sha256"):
        make_dataset(settings, tmp_path / "o", progress=False)


def test_a_prompt_cap_is_at_least_one_token_and_named_when_it_skips_everything(tmp_path):
    target = tiny_chat_target(tmp_path)
    src = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "a long enough prompt"}])
    with pytest.raises(GorgonError, match="--max-prompt-tokens must be at least 1, not 0"):
        make_dataset(DataSettings(prompts=src, target=str(target), max_prompt_tokens=0), tmp_path / "o", progress=False)
    with pytest.raises(GorgonError, match="no prompt fit --max-prompt-tokens 2 and the context of 512 tokens"):
        make_dataset(DataSettings(prompts=src, target=str(target), max_new_tokens=4, max_prompt_tokens=2),
                     tmp_path / "o", progress=False)
    # Its shards held skipped turns only, and the corrected command was refused for other settings: none are kept.
    assert not (tmp_path / "o.partial").exists()
    make_dataset(DataSettings(prompts=src, target=str(target), max_new_tokens=4), tmp_path / "o", progress=False)
    with pytest.raises(GorgonError, match="^--max-new-tokens 512 leaves no room for a prompt in the context of 512 "
                                          "tokens: lower it$"):
        make_dataset(DataSettings(prompts=src, target=str(target), max_new_tokens=512), tmp_path / "o2",
                     progress=False)
    assert not (tmp_path / "o2.partial").exists()


def test_a_partial_folder_gorgon_did_not_write_is_left_alone(tmp_path):
    target = tiny_chat_target(tmp_path)
    src = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "a"}])
    mine = tmp_path / "o.partial"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    with pytest.raises(GorgonError, match="o.partial holds files gorgon did not write"):
        make_dataset(DataSettings(prompts=src, target=str(target), max_new_tokens=4), tmp_path / "o", progress=False,
                     overwrite=True)
    assert (mine / "notes.txt").read_text() == "mine" and not (tmp_path / "o").exists()


def test_a_partial_path_that_is_a_file_is_refused_before_the_target_loads(tmp_path, capsys):
    """OUT.partial, where an unfinished run is kept, as someone's file: a traceback (FileExistsError) once the
    target had loaded; now one line before it (--target nowhere would be an error of its own), the file kept."""
    from gorgon.heads.cli import main as gorgon

    src = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "a"}])
    (tmp_path / "o.partial").write_text("mine")
    assert gorgon(["data", "--prompts", src, "--target", "nowhere", "--out", str(tmp_path / "o")]) == 2
    assert capsys.readouterr().err == (f"gorgon data: error: {tmp_path / 'o.partial'} is a file, where gorgon data "
                                       "keeps an unfinished run: move it away or choose another --out\n")
    assert (tmp_path / "o.partial").read_text() == "mine" and not (tmp_path / "o").exists()


@needs_embedded
def test_small_run_on_the_embedded_target(tmp_path, embedded_target):
    src = write_jsonl(tmp_path / "p.jsonl", [{"turns": ["Name a colour."]}, {"prompt": "Say hello."}])
    out = make_dataset(DataSettings(prompts=src, max_new_tokens=8, batch_size=2), tmp_path / "o",
                       target=embedded_target, progress=False)
    rows = list(datasets.load_from_disk(str(out)))
    assert len(rows) == 2 and all(r["messages"][-1]["role"] == "assistant" and r["messages"][-1]["content"]
                                  for r in rows)


@pytest.mark.slow
def test_sharegpt_prompts_are_read_from_a_file_cut_off_mid_record(tmp_path):
    """scripts/sharegpt_prompts.py makes the recipes' prompt file from PyPI's ShareGPT, which is cut off inside a
    record: the complete records are kept, as each conversation's non-empty human turns, where a human starts."""
    sharegpt = load_script("sharegpt_prompts")
    records = [{"id": "a", "conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello"},
                                             {"from": "human", "value": " "}, {"from": "human", "value": "More"}]},
               {"id": "b", "conversations": [{"from": "gpt", "value": "I start"}, {"from": "human", "value": "No"}]},
               {"id": "c", "conversations": [{"from": "human", "value": ""}]},
               {"id": "d", "conversations": [{"from": "human", "value": "cut"}]}]
    text = json.dumps(records, indent=2)
    cut = text[: text.index('"cut"') + 3]
    assert [r["id"] for r in sharegpt.read_records(text)] == ["a", "b", "c", "d"]
    assert sharegpt.prompts(sharegpt.read_records(cut)) == [{"id": "a", "turns": ["Hi", "More"]}]
    # The script writes a new file only: one of the user's at --out is refused in one line, and kept.
    mine = tmp_path / "prompts.jsonl"
    mine.write_text("mine")
    run = subprocess.run([sys.executable, "scripts/sharegpt_prompts.py", "--out", str(mine)], capture_output=True,
                         text=True, cwd=ROOT)
    assert (run.returncode, run.stderr.strip()) == (2, f"scripts/sharegpt_prompts.py: error: --out {mine} exists: "
                                                       "choose a new path (this script writes a new file only)")
    assert mine.read_text() == "mine"


def test_the_bar_ends_with_every_prompt_saved(tmp_path, capsys):
    """The bar's `saved` (prompts in shards, which a rerun keeps) was set per batch only, before the shards were
    written: a finished run's bar ended showing saved=0."""
    target = tiny_chat_target(tmp_path)
    src = write_jsonl(tmp_path / "p.jsonl", [{"prompt": f"q{i}"} for i in range(3)])
    make_dataset(DataSettings(prompts=src, target=str(target), max_new_tokens=4), tmp_path / "o", progress=True)
    bar = capsys.readouterr().err.replace("\r", "\n").splitlines()
    assert [line for line in bar if line.startswith("gorgon data: 100%")][-1].count("saved=3") == 1


def test_data_refuses_a_foreign_folder_and_replaces_its_own_only_when_asked(tmp_path):
    target = str(tiny_chat_target(tmp_path))
    prompts = toy_data(tmp_path / "toy.jsonl", n=2)
    victim = foreign_folder(tmp_path / "victim")
    settings = DataSettings(prompts=prompts, target=target, max_new_tokens=4)
    with pytest.raises(GorgonError, match="already holds files this command did not write"):
        make_dataset(settings, victim, progress=False, overwrite=True)
    assert (victim / "precious.txt").read_text() == "mine"
    out = make_dataset(settings, tmp_path / "data", progress=False)
    (out / "gorgon_data.json").write_text((out / "gorgon_data.json").read_text().replace("{", '{"mark": 1, ', 1))
    make_dataset(settings, out, progress=False)  # already complete: left as is
    assert "mark" in json.loads((out / "gorgon_data.json").read_text())
    make_dataset(settings, out, progress=False, overwrite=True)  # replaced whole
    assert "mark" not in json.loads((out / "gorgon_data.json").read_text())


@pytest.mark.slow
def test_two_runs_agreement_counts_identical_answers_and_where_the_others_part(tmp_path, capsys, monkeypatch):
    """scripts/data_agreement.py: the same greedy run twice is all identical; an answer edited after its third
    token parts there; settings that differ are listed; runs of two targets are refused in one line."""
    from helpers import load_script

    target = tiny_chat_target(tmp_path)
    src = write_jsonl(tmp_path / "p.jsonl", [SHAPES["sharegpt"], SHAPES["prompt"]])
    a = make_dataset(DataSettings(prompts=src, target=str(target), max_new_tokens=12), tmp_path / "a", progress=False)
    b = make_dataset(DataSettings(prompts=src, target=str(target), max_new_tokens=12, batch_size=1), tmp_path / "b",
                     progress=False)
    agreement = load_script("data_agreement")
    monkeypatch.setattr(sys, "argv", ["data_agreement.py", str(a), str(b), "--json"])
    capsys.readouterr()  # what the runs printed
    agreement.main()
    report = json.loads(capsys.readouterr().out)
    assert report["identical"] == report["conversations"] == 2 and report["parted_at_tokens"] == []
    assert report["settings_that_differ"] == {"batch_size": [16, 1]}
    rows = list(datasets.load_from_disk(str(b)))
    tok = load_target(str(target), device="cpu").tokenizer
    answer = tok(rows[0]["messages"][-1]["content"], add_special_tokens=False).input_ids
    rows[0]["messages"][-1]["content"] = tok.decode(answer[:3] + [(answer[3] + 1) % 50 + 5])
    shutil.rmtree(b)
    datasets.Dataset.from_list(rows).save_to_disk(str(b))
    shutil.copy(a / METADATA_NAME, b / METADATA_NAME)
    capsys.readouterr()
    agreement.main()
    assert json.loads(capsys.readouterr().out)["parted_at_tokens"] == [3]
    other = make_dataset(DataSettings(prompts=src, target=str(tiny_chat_target(tmp_path, seed=1)), max_new_tokens=4),
                         tmp_path / "other", progress=False)
    monkeypatch.setattr(sys, "argv", ["data_agreement.py", str(a), str(other)])
    with pytest.raises(GorgonError, match="come from different targets"):
        agreement.main()
