"""Bad input against every command (issue 15): nothing lost, nothing silently wrong, one line per error."""

import importlib.util
import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import (
    QUESTIONS,
    ROOT,
    another_live_process,
    env,
    questions_file,
    tiny_chat_target,
    tiny_model,
    tiny_tokenizer,
    toy_data,
)
from transformers import AutoModelForCausalLM

import gorgon.train.recipe as recipe
from gorgon.decode import Sampling, speculative_generate
from gorgon.decode.bench import run_bench
from gorgon.decode.options import read_tree
from gorgon.decode.questions import load_questions
from gorgon.heads import DraftModelDrafter, EagleHead, GorgonError, MedusaDrafter, MedusaHeads, load_heads, load_target
from gorgon.heads.cli import main as gorgon
from gorgon.heads.errors import run_script
from gorgon.heads.files import atomic_write_text, check_output, new_temp
from gorgon.heads.target import resolve_device
from gorgon.heads.tree import build_tree, tree_from_accuracies
from gorgon.train.data import DataSettings, make_dataset
from gorgon.train.heads import HeadsTrainConfig, train
from gorgon.train.records import load_conversations, read_records


def snapshot(folder: Path) -> dict:
    return {p.relative_to(folder): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def foreign_folder(path: Path) -> Path:
    (path / "sub").mkdir(parents=True)
    (path / "precious.txt").write_text("mine")
    (path / "sub" / "notes.md").write_text("also mine")
    return path


def saved_heads(tmp_path) -> Path:
    folder = tmp_path / "heads"
    MedusaHeads.for_target(tiny_model(), shared_lm_head=False).save_pretrained(folder)
    return folder


def test_every_command_leaves_a_foreign_out_folder_alone(tmp_path, capsys):
    """Each command with --out, given a folder of someone else's files, refuses before any work."""
    questions = questions_file(tmp_path / "q.jsonl")
    heads = saved_heads(tmp_path)
    commands = {
        "data": ["data", "--prompts", str(questions), "--limit", "2", "--max-new-tokens", "4"],
        "train": ["train", "--data", str(questions), "--report-to", "none"],
        "draft": ["draft", "--data", str(questions), "--report-to", "none"],
        "export": ["export", "--heads", str(heads), "--format", "vllm"],
        "bench": ["bench", "--heads", str(heads), "--questions", str(questions)],
    }
    for name, argv in commands.items():
        folder = foreign_folder(tmp_path / f"victim-{name}")
        before = snapshot(folder)
        assert gorgon(argv + ["--out", str(folder)]) == 2, name
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"gorgon {name}: error: --out {folder}"), (name, err)
        assert snapshot(folder) == before, name
    # bench writes a file: an existing file it did not write is refused too, and kept.
    foreign = tmp_path / "victim-bench" / "precious.txt"
    assert gorgon(commands["bench"] + ["--out", str(foreign), "--overwrite"]) == 2
    assert "this command did not write" in capsys.readouterr().err and foreign.read_text() == "mine"
    # A report of gorgon's with an image of the user's where its plot goes: the image is not taken for the plot.
    report = tmp_path / "r.json"
    report.write_text('{"command": "gorgon bench --out r.json"}')
    (tmp_path / "r.png").write_bytes(b"\x89PNG\r\n\x1a\n a screenshot of mine")
    assert gorgon(commands["bench"] + ["--out", str(report), "--overwrite"]) == 2
    assert "r.png already holds files this command did not write" in capsys.readouterr().err


def test_a_checkpoint_in_an_engines_layout_is_not_taken_for_an_export(tmp_path, capsys):
    """A downloaded Medusa checkpoint with the user's notes beside it is not gorgon's to replace, even
    though it is in a layout gorgon exports to; a refused export leaves no empty --out behind."""
    heads = saved_heads(tmp_path)
    downloaded = tmp_path / "medusa-vicuna"
    downloaded.mkdir()
    (downloaded / "config.json").write_text(json.dumps({"medusa_num_heads": 4, "medusa_num_layers": 1}))
    (downloaded / "NOTES.md").write_text("mine")
    before = snapshot(downloaded)
    assert gorgon(["export", "--heads", str(heads), "--format", "medusa", "--out", str(downloaded), "--overwrite"]) == 2
    assert "already holds files this command did not write" in capsys.readouterr().err
    assert snapshot(downloaded) == before
    assert gorgon(["export", "--heads", str(tmp_path / "nowhere"), "--format", "vllm",
                   "--out", str(tmp_path / "new" / "v")]) == 2
    assert "nowhere" in capsys.readouterr().err and not (tmp_path / "new").exists()


def test_export_overwrite_replaces_the_earlier_exports_files_only(tmp_path, capsys):
    """--overwrite swaps an earlier export for a new one, in the other format too, and keeps the files
    the user put beside it; a file the new export would write over is refused."""
    target = tiny_chat_target(tmp_path)
    heads = tmp_path / "heads"
    MedusaHeads.for_target(AutoModelForCausalLM.from_pretrained(target), shared_lm_head=False).save_pretrained(heads)
    out = tmp_path / "export"
    export = ["export", "--heads", str(heads), "--target", str(target), "--out", str(out)]
    assert gorgon(export + ["--format", "medusa"]) == 0
    assert not list(tmp_path.glob(".export*"))  # written beside --out, then renamed into place
    (out / "README.md").write_text("how we serve it")
    assert gorgon(export + ["--format", "vllm", "--overwrite"]) == 0
    assert sorted(f.name for f in out.iterdir()) == [".gorgon-export", "README.md", "config.json", "model.safetensors"]
    assert (out / "README.md").read_text() == "how we serve it"
    (out / "medusa_lm_head.safetensors").write_text("mine")
    before = snapshot(out)
    assert gorgon(export + ["--format", "medusa", "--overwrite"]) == 2
    assert "holds medusa_lm_head.safetensors, which the earlier export did not write" in capsys.readouterr().err
    assert snapshot(out) == before and not list(tmp_path.glob(".export*"))
    (out / "medusa_lm_head.safetensors").unlink()
    (out / ".gorgon-export").write_text("")  # an older gorgon's marker, which lists nothing: refused, nothing removed
    before = snapshot(out)
    assert gorgon(export + ["--format", "medusa", "--overwrite"]) == 2
    assert "holds an export by an older gorgon, whose .gorgon-export does not list its files" in capsys.readouterr().err
    assert snapshot(out) == before and not list(tmp_path.glob(".export*"))


def test_an_empty_out_folder_is_filled_and_a_linked_or_input_out_refused(tmp_path, capsys):
    """A folder the user made (with permissions of their own) was replaced by a new one; a symbolic link as --out
    failed with a traceback after the work (and on every rerun); `gorgon data --out` could be its --prompts."""
    target = tiny_chat_target(tmp_path)
    heads = tmp_path / "heads"
    MedusaHeads.for_target(AutoModelForCausalLM.from_pretrained(target)).save_pretrained(heads)
    data = toy_data(tmp_path / "toy.jsonl", n=4)
    exports = {"export": ["export", "--heads", str(heads), "--target", str(target), "--format", "vllm"],
               "data": ["data", "--prompts", data, "--target", str(target), "--max-new-tokens", "2"]}
    for name, command in exports.items():
        out = tmp_path / f"made-{name}"
        out.mkdir(mode=0o750)
        os.chmod(out, 0o750)
        inode = out.stat().st_ino
        assert gorgon(command + ["--out", str(out)]) == 0
        assert out.stat().st_ino == inode and out.stat().st_mode & 0o777 == 0o750 and any(out.iterdir())
        assert not list(tmp_path.glob(f".made-{name}.*"))
        link = tmp_path / f"link-{name}"
        link.symlink_to(tmp_path / f"elsewhere-{name}")
        assert gorgon(command + ["--out", str(link)]) == 2
        assert capsys.readouterr().err.strip().endswith(f"--out {link} is a symbolic link (to {tmp_path}/elsewhere-"
                                                        f"{name}): pass the path it points to, or another --out")
    dataset = tmp_path / "made-data"
    assert gorgon(["data", "--prompts", str(dataset), "--target", str(target), "--out", f"{dataset}/"]) == 2
    assert capsys.readouterr().err.strip().endswith(f"--out {dataset} is the --prompts path: choose another --out")
    assert gorgon(["bench", "--heads", str(heads), "--target", str(target), "--questions",
                   str(questions_file(tmp_path / "q.jsonl")), "--out", f"{tmp_path}/reports/"]) == 2
    assert capsys.readouterr().err.strip().endswith(f"--out {tmp_path}/reports/ is a folder path: pass the report's "
                                                    f".json path, such as {tmp_path}/reports/report.json")


def test_an_out_filled_by_another_process_during_the_work_is_left_alone(tmp_path):
    """Two exports into one new --out: the second's swap failed with an OSError traceback, and had the folder
    counted as empty (the user's) it would have mixed its files into the first's."""
    from gorgon.heads.files import move_into_place

    out, tmp = tmp_path / "out", tmp_path / ".out.tmp"
    for made in (tmp, out):
        made.mkdir()
        (made / "config.json").write_text(made.name)
    with pytest.raises(GorgonError, match=rf"^--out {re.escape(str(out))} was written by another process while this "
                                          r"one worked \(.*\): nothing of this run's was put there; rerun with"):
        move_into_place(tmp, out, "config.json")
    assert (out / "config.json").read_text() == "out" and not tmp.exists()


def test_a_home_folder_path_in_an_option_is_expanded(tmp_path, monkeypatch):
    """`--out=~/x` (which the shell leaves as it is) made a folder named ~ here; the training scripts expand it."""
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    heads = tmp_path / "heads"
    MedusaHeads.for_target(AutoModelForCausalLM.from_pretrained(tiny_chat_target(tmp_path))).save_pretrained(heads)
    assert gorgon(["export", "--heads=~/heads", "--target=~/tiny-llama-0", "--format", "vllm", "--out=~/x"]) == 0
    assert (tmp_path / "x" / "config.json").is_file() and not (tmp_path / "~").exists()


def test_the_folders_written_beside_out_are_gorgons_own(tmp_path):
    """A dataset and an export are written in a folder beside --out and renamed into place. That folder had a
    fixed name (.OUT.writing, .OUT.exporting) and was removed first, whatever it held; it is now a new one with
    the writer's host and process in its name, so a folder of the user's by that name stays untouched."""
    target = tiny_chat_target(tmp_path)
    heads = tmp_path / "heads"
    MedusaHeads.for_target(AutoModelForCausalLM.from_pretrained(target), shared_lm_head=False).save_pretrained(heads)
    theirs = [foreign_folder(tmp_path / ".data.writing"), foreign_folder(tmp_path / ".export.exporting")]
    before = [snapshot(folder) for folder in theirs]
    make_dataset(DataSettings(prompts=toy_data(tmp_path / "toy.jsonl", n=2), target=str(target), max_new_tokens=4),
                 tmp_path / "data", progress=False)
    for out in (tmp_path / "export", tmp_path / "new" / "export"):  # the folder beside it is made too
        assert gorgon(["export", "--heads", str(heads), "--target", str(target), "--format", "vllm", "--out",
                       str(out)]) == 0
    assert [snapshot(folder) for folder in theirs] == before
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == [".data.writing",
                                                                                  ".export.exporting"]


def test_a_report_named_like_its_plot_is_refused(tmp_path, capsys):
    message = "--out is the JSON report, and its plot is written beside it with the suffix .png: pass a .json path"
    assert gorgon(["bench", "--context-draft", "--questions", "q.jsonl", "--out", str(tmp_path / "r.png")]) == 2
    assert capsys.readouterr().err.strip().endswith(message)
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "learning_curve.py"), "--heads", "h", "--questions",
                          "q.jsonl", "--out", str(tmp_path / "curve.png")], env=env(), capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 2 and run.stderr.strip().endswith(message), run.stderr[-2000:]
    assert not list(tmp_path.iterdir())


def test_a_card_update_that_cannot_be_made_is_refused_before_the_benchmark(tmp_path, capsys):
    """--update-card on heads without training's recipe.json and metrics.json (save_pretrained's, a download's)
    ran the whole benchmark, then failed, its figures lost; now it fails first (the questions file named here
    does not exist, an error of its own)."""
    heads = saved_heads(tmp_path)
    for folder in (str(heads), "someone/heads"):
        assert gorgon(["bench", "--heads", folder, "--questions", "nowhere.jsonl", "--update-card"]) == 2
        assert capsys.readouterr().err == (f"gorgon bench: error: {folder} has no recipe.json/metrics.json, so its "
                                           "card cannot be rebuilt: --update-card works on folders written by "
                                           "gorgon's training\n")


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


def test_outputs_are_checked_before_the_work(tmp_path, capsys):
    heads = saved_heads(tmp_path)
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    with pytest.raises(GorgonError, match="is a file: pass a folder path"):  # before any target is loaded
        train(HeadsTrainConfig(data="nowhere", out=str(a_file), target="nowhere", report_to="none"))
    questions = tmp_path / "q.jsonl"
    questions.write_text(json.dumps(QUESTIONS[0]) + "\n")
    assert gorgon(["bench", "--heads", "nowhere/x/y", "--questions", str(questions), "--out", str(tmp_path)]) == 2
    assert "is a folder: pass a file path" in capsys.readouterr().err
    fingerprint = (heads / "config.json").read_bytes()
    assert gorgon(["export", "--heads", str(heads), "--format", "vllm", "--out", str(heads), "--overwrite"]) == 2
    assert "is the heads folder itself" in capsys.readouterr().err
    assert (heads / "config.json").read_bytes() == fingerprint


def test_training_over_a_finished_run_needs_overwrite_and_leaves_nothing_stale(tmp_path):
    target = str(tiny_chat_target(tmp_path))
    data = toy_data(tmp_path / "toy.jsonl", n=8)
    cfg = dict(data=data, out=str(tmp_path / "run"), target=target, max_steps=1, report_to="none", save_every=0)
    out = train(HeadsTrainConfig(**cfg))
    (out / "bench.json").write_text('{"command": "gorgon bench --heads run --out run/bench.json"}')  # of the old heads
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = plt.figure()
    fig.savefig(out / "bench.png")  # its plot, as matplotlib writes one
    plt.close(fig)
    with pytest.raises(GorgonError, match="holds earlier gorgon output: pass --overwrite"):
        train(HeadsTrainConfig(**cfg))
    train(HeadsTrainConfig(**cfg, overwrite=True))
    assert (out / "model.safetensors").is_file() and not (out / "bench.json").exists()
    assert not (out / "bench.png").exists()


def test_a_card_the_user_edited_is_not_written_over(tmp_path):
    """`gorgon bench --update-card` and training a finished run again (--resume to train longer, --overwrite)
    wrote their card over one the user had edited, with no word; `gorgon push` already kept it. Each is
    refused before the work, the card as it was."""
    from gorgon.heads.card import check_card_folder

    target = str(tiny_chat_target(tmp_path))
    cfg = dict(data=toy_data(tmp_path / "toy.jsonl", n=8), out=str(tmp_path / "run"), target=target, max_steps=1,
               report_to="none", save_every=1)
    out = train(HeadsTrainConfig(**cfg))
    check_card_folder(out)  # the card as training wrote it
    card = (out / "README.md").read_text() + "\nMy notes.\n"
    (out / "README.md").write_text(card)
    edited = rf"^{re.escape(str(out / 'README.md'))} is not the card gorgon wrote \(edited\?\): "
    with pytest.raises(GorgonError, match=edited + "--update-card would write the new card over it"):
        check_card_folder(out)
    for again in (dict(resume=True, max_steps=2), dict(overwrite=True)):
        with pytest.raises(GorgonError, match=edited + "this run would write its own card over it"):
            train(HeadsTrainConfig(**{**cfg, **again}))
    assert (out / "README.md").read_text() == card


def test_an_overwrite_that_fails_or_is_cut_short_keeps_the_earlier_heads(tmp_path, monkeypatch):
    """--overwrite removed a finished run's heads before training: a run that then failed (or was killed) left
    none. Now they stay until the new run writes its own; a save cut short keeps them aside until one ends."""
    import gorgon.heads.card
    import gorgon.train.heads
    from gorgon.train.run_folder import EARLIER

    target = str(tiny_chat_target(tmp_path))
    data = toy_data(tmp_path / "toy.jsonl", n=8)
    cfg = dict(data=data, out=str(tmp_path / "run"), target=target, max_steps=1, report_to="none", save_every=0)
    out = train(HeadsTrainConfig(**cfg))
    (out / "bench.json").write_text('{"command": "gorgon bench --heads run --out run/bench.json"}')

    def files(folder):
        return {str(path): data for path, data in snapshot(folder).items() if path.name != ".gorgon-run"}

    earlier = files(out)

    def fails(*args, **kwargs):
        raise RuntimeError("out of memory")

    with monkeypatch.context() as patch:
        patch.setattr(gorgon.train.heads, "train_steps", fails)
        with pytest.raises(RuntimeError):
            train(HeadsTrainConfig(**cfg, overwrite=True, learning_rate=0.5))
    kept = files(out)
    assert {k: v for k, v in kept.items() if k != "recipe.json"} == {k: v for k, v in earlier.items() if k in kept}
    assert "model.safetensors" in kept and "recipe.json" not in kept  # loadable, no longer marked finished
    with monkeypatch.context() as patch:  # the new heads written, then a kill before the card
        patch.setattr(gorgon.heads.card, "write_model_card", fails)
        with pytest.raises(RuntimeError):
            train(HeadsTrainConfig(**cfg, learning_rate=0.5))
    assert files(out / EARLIER)["model.safetensors"] == earlier["model.safetensors"]
    train(HeadsTrainConfig(**cfg, learning_rate=0.5))  # an unfinished run of gorgon's: started again
    final = files(out)
    assert not (out / EARLIER).exists() and "bench.json" not in final and "recipe.json" in final
    assert final["model.safetensors"] != earlier["model.safetensors"]


def test_overwrite_refuses_a_file_of_the_users_inside_gorgons_output(tmp_path):
    """--overwrite replaced a run's folder or a dataset whole, notes or a serving config the user had put inside
    it included; now it is refused before any work, naming the file, and nothing is removed."""
    target = str(tiny_chat_target(tmp_path))
    data = toy_data(tmp_path / "toy.jsonl", n=8)
    run = HeadsTrainConfig(data=data, out=str(tmp_path / "run"), target=target, max_steps=1, report_to="none",
                           save_every=0, overwrite=True)
    dataset = DataSettings(prompts=data, target=target, max_new_tokens=4)
    for make in (lambda: train(run), lambda: make_dataset(dataset, tmp_path / "data", progress=False, overwrite=True)):
        out = make()
        (out / "serving").mkdir()
        (out / "serving" / "NOTES.md").write_text("mine")
        before = snapshot(out)
        with pytest.raises(GorgonError, match=rf"^--out {re.escape(str(out))} holds serving, which gorgon did not "
                                              r"write: move it away, or choose another --out$"):
            make()
        assert snapshot(out) == before
        shutil.rmtree(out / "serving")
        make()
    # A tokenizer's files are a draft model's own, but not in a heads folder (they were removed with no word),
    # and a draft run's from the moment its config.json is written (a run cut short before metrics.json).
    (tmp_path / "run" / "tokenizer.json").write_text("mine")
    with pytest.raises(GorgonError, match="holds tokenizer.json, which gorgon did not write"):
        train(run)
    assert (tmp_path / "run" / "tokenizer.json").read_text() == "mine"
    from gorgon.train.run_folder import in_run_folder

    draft = tmp_path / "draft-run"
    draft.mkdir()
    (draft / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}))
    assert in_run_folder(draft / "tokenizer.json") and not in_run_folder(tmp_path / "run" / "tokenizer.json")


def test_training_step_counts(tmp_path):
    with pytest.raises(GorgonError, match="max_steps must be at least 0"):
        HeadsTrainConfig(data="x", out="y", max_steps=-1).check()
    target = str(tiny_chat_target(tmp_path))
    out = train(HeadsTrainConfig(data=toy_data(tmp_path / "toy.jsonl", n=8), out=str(tmp_path / "run"), target=target,
                                 max_steps=0, report_to="none"))
    assert json.loads((out / "metrics.json").read_text())["steps"] == 0


def test_a_report_another_live_bench_writes_is_refused(tmp_path, capsys):
    """Two benches into one --out both wrote the report after each question, and one's figures were lost."""
    from gorgon.heads.files import host_name, process_start

    target = tiny_chat_target(tmp_path)
    heads = tmp_path / "heads"
    MedusaHeads.for_target(AutoModelForCausalLM.from_pretrained(target)).save_pretrained(heads)
    out = tmp_path / "r.json"
    bench = ["bench", "--heads", str(heads), "--target", str(target), "--questions",
             str(questions_file(tmp_path / "q.jsonl", QUESTIONS[:1])), "--max-new-tokens", "4", "--out", str(out)]
    with another_live_process() as pid:
        (tmp_path / ".r.json.lock").write_text(f"{host_name()} {pid} {process_start(pid)}\n")
        assert gorgon(bench) == 2
        assert capsys.readouterr().err.strip().endswith(f"{out} is being written by another gorgon bench "
                                                        f"(process {pid}, still running): wait for it to "
                                                        f"end, or stop it (kill {pid}), then retry")
    assert gorgon(bench) == 0 and out.is_file()  # its process gone, the lock is stale
    assert not (tmp_path / ".r.json.lock").exists()  # given back at the end


def test_bench_counts_only_the_questions_it_ran(tmp_path):
    target = load_target(str(tiny_chat_target(tmp_path)), device="cpu")  # context 512, one token per character
    drafter = MedusaDrafter(MedusaHeads.for_target(target.model), tree=[[0], [1], [0, 0]])
    too_long = {"question_id": 99, "category": "roleplay", "turns": ["x" * 600]}
    report = run_bench(target, drafter, [QUESTIONS[0], too_long], max_new_tokens=8, progress=False)
    assert report["prompts"] == 1 and report["identical"] == 1 and "roleplay" not in report["per_category"]
    assert report["speedup"] > 0 and report["speedup_median"] == report["questions"][0]["speedup"]
    assert [q["question_id"] for q in report["skipped"]] == [99]
    assert "exceeds the context" in report["skipped"][0]["reason"]
    with pytest.raises(GorgonError, match="no question fits the context"):
        run_bench(target, drafter, [too_long], max_new_tokens=8, progress=False)
    questions = tmp_path / "q.jsonl"
    questions.write_text(json.dumps(QUESTIONS[0]) + "\n")
    with pytest.raises(GorgonError, match="--limit must be at least 1"):
        load_questions(str(questions), limit=0)
    with pytest.raises(GorgonError, match="questions file .* is a folder: pass a .jsonl"):
        load_questions(str(tmp_path))
    with pytest.raises(GorgonError, match="--limit must be at least 1"):
        make_dataset(DataSettings(prompts=str(questions), limit=0), tmp_path / "data", progress=False)


def test_a_turn_fits_the_context_as_the_decoder_counts_it(tmp_path):
    """The bench asked a turn only with a position to spare, while the decoder takes a reply whose last token
    lands on the context's end (that token is never fed back): both now count as `fits_context` does."""
    from gorgon.decode.questions import ask

    target = load_target(str(tiny_chat_target(tmp_path)), device="cpu")  # context 512, one token per character
    base = target.chat_ids([{"role": "user", "content": "x"}]).shape[1]
    for extra, asked in [(0, 1), (1, 0)]:  # a prompt of 505 (+ 8 new - 1 = 512 positions), then of 506
        turn = "x" * (512 - 8 + 1 - base + 1 + extra)
        question = {"question_id": 1, "category": "writing", "turns": [turn]}
        assert ask(target, question, 8, lambda ids: [5] * 8) == asked


def test_arguments_are_range_checked(tmp_path, capsys):
    for bad, match in [(dict(temperature=-1), "temperature"), (dict(temperature=math.nan), "temperature"),
                       (dict(temperature=1, top_k=-1), "top-k"), (dict(temperature=1, top_p=2), "top-p"),
                       (dict(temperature=1, top_k=1.5), "top-k")]:
        with pytest.raises(GorgonError, match=match):
            Sampling(**bad)
    with pytest.raises(GorgonError, match="unknown device 'tpu9'"):
        resolve_device("tpu9")
    if not torch.cuda.is_available():
        with pytest.raises(GorgonError, match="device 'cuda' is not available"):
            resolve_device("cuda")
    with pytest.raises(GorgonError, match="whole numbers >= 0.*not 1.5"):
        build_tree([[0], [1.5]])
    with pytest.raises(GorgonError, match="from 2 .* to 256, not 10000"):
        tree_from_accuracies([[0.5, 0.1]], 10000)
    heads = MedusaHeads.for_target(tiny_model(), num_heads=2)  # a vocabulary of 64
    with pytest.raises(GorgonError, match="asks for rank 64 but the heads draft from 64 tokens"):
        MedusaDrafter(heads, tree=[[0], [64]])
    with pytest.raises(GorgonError, match="1 to 64 tokens per step, not 100000"):
        DraftModelDrafter(tiny_model(), 100000)
    # On the command line the same checks fail at once, before any model is loaded.
    assert gorgon(["generate", "--heads", "nowhere", "--prompt", "hi", "--temperature", "-1"]) == 2
    assert capsys.readouterr().err.strip() == ("gorgon generate: error: temperature must be a finite number >= 0 "
                                               "(0 is greedy), not -1.0")
    (tmp_path / "tree.json").write_text("[[0], [1]]")
    assert gorgon(["generate", "--draft", "nowhere", "--prompt", "hi", "--tree", str(tmp_path / "tree.json")]) == 2
    assert "--tree takes a node count with --draft, not rank paths" in capsys.readouterr().err
    assert gorgon(["generate", "--draft", "nowhere", "--prompt", "hi", "--draft-depth", "3"]) == 2
    assert "(a --draft model drafts --draft-tokens levels)" in capsys.readouterr().err
    assert gorgon(["generate", "--context-draft", "--prompt", "hi", "--draft-level-cost", "0.1"]) == 2
    assert "--draft-level-cost stops a search's levels: it needs --draft or --heads" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        gorgon(["generate", "--draft", "x", "--prompt", "hi", "--draft-level-cost", "cheap"])
    assert "--draft-level-cost: expected auto or a number of target steps >= 0, not 'cheap'" in capsys.readouterr().err
    with pytest.raises(GorgonError, match="to 256 nodes, not 300"):
        DraftModelDrafter(tiny_model(), 4, topk=2, nodes=300)
    with pytest.raises(GorgonError, match="top-k must be a whole number >= 1, not 0"):
        DraftModelDrafter(tiny_model(), 4, topk=0)
    with pytest.raises(SystemExit):
        gorgon(["bench", "--heads", "x", "--questions", "q", "--limit", "0"])
    assert "--limit: must be at least 1, not 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        gorgon(["generate", "--draft", "x", "--prompt", "hi", "--draft-tokens", "65"])
    assert "--draft-tokens: must be at most 64, not 65" in capsys.readouterr().err
    for bad in ("-3", "1", "300"):  # a node count (it was "tree file -3 not found"), checked before any model loads
        with pytest.raises(GorgonError, match=rf"^--tree {bad}: a tree needs 2 \(the root and one candidate\) to 256 "
                                              r"nodes$"):
            read_tree(bad)
    assert read_tree("8") == 8
    for argv, says in [(["--acceptance", "typical"], "--acceptance typical needs --temperature > 0"),
                       (["--stop", ""], "--stop '' would end the output at its first token"),
                       (["--system", "be brief", "--raw"], "--system goes through the chat template, which --raw "
                                                           "skips")]:
        # the target named does not exist: refused before it would load
        assert gorgon(["generate", "--target", str(tmp_path / "no-target"), "--context-draft", "--prompt", "hi",
                       *argv]) == 2
        assert says in capsys.readouterr().err
    with pytest.raises(GorgonError, match="from 2 .* to 256, not -3"):
        MedusaDrafter(heads, tree=-3)
    with pytest.raises(GorgonError, match="an empty stop string would end the output at its first token"):
        speculative_generate(tiny_model(), MedusaDrafter(heads), torch.tensor([[1, 2, 3]]), stop_strings=["", "."],
                             tokenizer=tiny_tokenizer())


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_written_files_follow_the_umask(tmp_path, umask):
    old = os.umask(umask)
    try:
        atomic_write_text(tmp_path / "a.json", "{}")
        MedusaHeads.for_target(tiny_model()).save_pretrained(tmp_path / "heads")
        folder = new_temp(tmp_path, ".converting-", is_dir=True)  # as the embedded target's copy is written
        assert os.umask(umask) == umask  # and the umask was never changed on the way
    finally:
        os.umask(old)
    for path in [tmp_path / "a.json", tmp_path / "heads" / "config.json", tmp_path / "heads" / "model.safetensors"]:
        assert path.stat().st_mode & 0o777 == 0o666 & ~umask, path
    assert folder.stat().st_mode & 0o777 == 0o777 & ~umask


@pytest.mark.parametrize("umask", [0o002, 0o022])
def test_weights_other_libraries_save_follow_the_umask(tmp_path, umask):
    """safetensors writes its files private (0600), and with it save_pretrained, peft and accelerate's save_state:
    a draft model, a Medusa-2 adapter (and the embedded target's copy) could not be read by a serving engine
    run as another user, nor a checkpoint by a teammate resuming in a shared folder."""
    from gorgon.heads.methods.draft_model.model import save_draft

    target = tiny_chat_target(tmp_path)
    old = os.umask(umask)
    try:
        save_draft(tiny_model(), tiny_tokenizer(), tmp_path / "draft")
        out = train(HeadsTrainConfig(data=toy_data(tmp_path / "toy.jsonl", n=8), out=str(tmp_path / "run"),
                                     target=str(target), mode="medusa2", lora_r=2, max_steps=2, save_every=1,
                                     report_to="none"))
    finally:
        os.umask(old)
    written = [tmp_path / "draft" / "model.safetensors", out / "adapter" / "adapter_model.safetensors",
               out / "checkpoints" / "step-1" / "model.safetensors"]
    assert {path: path.stat().st_mode & 0o777 for path in written} == {path: 0o666 & ~umask for path in written}


def test_a_write_killed_midway_leaves_nothing_behind_the_next_one(tmp_path):
    """A kill during an atomic write left its hidden temp file for good (an 8B model's weights, say);
    the next write of that file removes it, and keeps a live writer's, another machine's and the user's."""
    writer = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from pathlib import Path; from gorgon.heads.files import atomic_write\n"
        "atomic_write(Path(sys.argv[1]), lambda tmp: (Path(tmp).write_text('half'), print(flush=True), "
        "time.sleep(60)))"), str(tmp_path / "w.safetensors")], stdout=subprocess.PIPE)
    writer.stdout.readline()  # the temp file is written
    writer.kill()
    writer.wait()
    left = [p.name for p in tmp_path.iterdir()]
    assert len(left) == 1 and left[0].startswith(".w.safetensors.") and left[0].endswith(".tmp")
    live = new_temp(tmp_path, ".w.safetensors.")  # this process's, as if it were writing now
    kept = [tmp_path / ".w.safetensors.otherhost-1-0123abcd.tmp", tmp_path / ".w.safetensors.mine.tmp"]
    for path in kept:
        path.write_text("keep")
    atomic_write_text(tmp_path / "w.safetensors", "whole")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["w.safetensors", live.name, *(p.name for p in kept)])


def test_a_plot_killed_midway_leaves_the_earlier_one_whole(tmp_path, monkeypatch):
    """The plots (a bench report's, the heads' accuracy) were written in place by matplotlib: a kill or a full disk
    midway left half a PNG where the earlier one was. They are written atomically, like every other file."""
    from matplotlib.figure import Figure

    from gorgon.decode.bench import plot_report
    from gorgon.heads.card import plot_head_accuracy

    def killed_midway(self, fname, **kwargs):
        Path(fname).write_bytes(b"half")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Figure, "savefig", killed_midway)
    metrics = {"top1": [0.5], "top5": [0.8], "arch": "medusa"}
    report = {"accepted_histogram": {"1": 3, "2": 1}, "tau": 1.25, "per_category": {}, "speedup": 1.0}
    for plot, data in ((plot_head_accuracy, metrics), (plot_report, report)):
        png = tmp_path / f"{plot.__name__}.png"
        png.write_bytes(b"earlier")
        with pytest.raises(OSError):
            plot(data, png)
        assert png.read_bytes() == b"earlier"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plot_head_accuracy.png", "plot_report.png"]


def test_one_line_errors_instead_of_tracebacks(tmp_path, capsys):
    binary = tmp_path / "prompts.jsonl"
    binary.write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe")
    with pytest.raises(GorgonError, match="is not UTF-8 text"):
        load_conversations(str(binary))
    with pytest.raises(GorgonError, match="is not UTF-8 text"):
        load_questions(str(binary))
    heads = saved_heads(tmp_path)
    (heads / "trees.json").write_text('{"cpu": [[0], ')
    with pytest.raises(GorgonError, match="trees.json is not valid JSON"):
        MedusaHeads.from_pretrained(heads)
    (heads / "trees.json").write_text('{"cpu": 3}')
    with pytest.raises(GorgonError, match="trees.json must map"):
        MedusaHeads.from_pretrained(heads)
    import datasets

    datasets.DatasetDict().save_to_disk(str(tmp_path / "empty-dataset"))
    with pytest.raises(GorgonError, match="no splits"):
        read_records(str(tmp_path / "empty-dataset"))
    with pytest.raises(GorgonError, match="cannot write to /proc/gorgon"):
        check_output(Path("/proc/gorgon/out"), lambda o: False, False)
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    target = str(tiny_chat_target(tmp_path))
    capsys.readouterr()
    for argv in (["generate", "--heads", str(loop), "--prompt", "hi"], ["generate", "--target", str(loop), "--draft",
                 target, "--prompt", "hi"], ["generate", "--target", target, "--draft", str(loop), "--prompt", "hi"],
                 ["train", "--data", str(loop), "--out", str(tmp_path / "o"), "--target", target,
                  "--report-to", "none"]):
        assert gorgon(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert f"{loop} is a symlink loop" in err[-1] and not any("Traceback" in line for line in err), err
    with pytest.raises(GorgonError, match="no dataset 'runs/missing': no local folder by that name, and the local hub "
                                          r"cache \(HF_HUB_OFFLINE is set\)"):
        read_records("runs/missing")


def test_a_hub_that_does_not_resolve_is_not_retried(tmp_path):
    """With no network and HF_HUB_OFFLINE unset, huggingface_hub retried every file five times (48 s for a missing
    target) before its error or the cache: a command now finds the Hub's host unknown and works from the cache at
    once, saying why. The user's HF_HUB_OFFLINE, either way, is left as set."""
    from gorgon.heads.hub import PROXIES, resolves

    if resolves("hub.invalid"):  # a resolver that answers (or hangs) for the reserved .invalid
        pytest.skip("this machine's resolver does not fail on hub.invalid")
    unset = {**{k: v for k, v in env().items() if k not in ("HF_HUB_OFFLINE", *PROXIES)},
             "HF_ENDPOINT": "https://hub.invalid"}
    run = subprocess.run([sys.executable, "-m", "gorgon.heads.cli", "generate", "--target", "someone/model",
                          "--context-draft", "--prompt", "hi"], env=unset, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "Retrying" not in run.stderr, run.stderr
    assert run.stderr.strip().splitlines()[-1] == (
        "gorgon generate: error: no target 'someone/model': no local folder by that name, and the local hub cache "
        "(the Hub's hub.invalid does not resolve) has none (OSError): check the path or the hub id")
    probe = ("import os; from gorgon.heads.hub import offline_if_hub_unreachable as f; f(); "
             "print(os.environ.get('HF_HUB_OFFLINE'))")
    for extra, expected in [({}, "1"), ({"HF_HUB_OFFLINE": "0"}, "0"), ({"HTTPS_PROXY": "http://proxy:3128"}, "None")]:
        out = subprocess.run([sys.executable, "-c", probe], env={**unset, **extra}, capture_output=True, text=True,
                             check=True).stdout.strip()
        assert out == expected, extra


def test_a_model_passed_as_heads_says_so(tmp_path, capsys):
    """A draft model (or the target) given as --heads was "unknown key 'architectures' in config.json"."""
    target = tiny_chat_target(tmp_path)
    capsys.readouterr()
    assert gorgon(["generate", "--heads", str(target), "--target", str(tmp_path / "nowhere"), "--prompt", "hi"]) == 2
    assert capsys.readouterr().err.strip() == (f"gorgon generate: error: {target} holds a model (LlamaForCausalLM), "
                                               "not heads: a draft model goes to generate and bench as --draft "
                                               "(engines load its folder as it is, with no export), a target as "
                                               "--target")


def test_a_folder_that_is_not_a_model_says_what_it_holds(tmp_path, capsys):
    """Heads passed as the target, a model without its tokenizer, an empty folder: each named for what it is."""
    heads = saved_heads(tmp_path)
    no_tokenizer = tmp_path / "weights-only"
    tiny_model().save_pretrained(no_tokenizer)
    (tmp_path / "empty").mkdir()
    cases = {heads: "it holds draft heads; pass it as --heads", no_tokenizer: "has no tokenizer transformers can load",
             tmp_path / "empty": "it has no readable config.json"}
    capsys.readouterr()
    for folder, expected in cases.items():
        assert gorgon(["generate", "--target", str(folder), "--context-draft", "--prompt", "hi"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert expected in err[-1] and not any("Traceback" in line or "no local folder" in line for line in err), err


def test_a_full_disk_is_one_line(tmp_path, capsys, monkeypatch):
    def full():
        raise OSError(28, "No space left on device", "out/checkpoints/step-5")

    def checkpoint_on_a_full_disk(cfg):
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534")  # torch.save's way

    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**9, 10**9, 4096))
    with pytest.raises(GorgonError, match="the disk holding .*run is full .*RuntimeError while writing"):
        recipe.recipe_main(HeadsTrainConfig, checkpoint_on_a_full_disk, "", ["--data", "x", "--out",
                                                                               str(tmp_path / "run")])

    with pytest.raises(SystemExit) as exit_:
        run_script(full, "train/heads.py")
    assert exit_.value.code == 2
    assert capsys.readouterr().err == ("train/heads.py: error: cannot write out/checkpoints/step-5 (No space left on "
                                       "device): free some space\n")


def test_the_error_line_is_one_write(monkeypatch):
    """Unbuffered (PYTHONUNBUFFERED, as the multi-process tests run), each write reaches the pipe at once:
    a message written apart from its newline lets another rank's or the launcher's output in between."""
    writes = []
    monkeypatch.setattr(sys, "stderr", type("Pipe", (), {"write": lambda self, text: writes.append(text)})())

    def bad():
        raise GorgonError("no data")

    with pytest.raises(SystemExit):
        run_script(bad, "train/heads.py")
    assert gorgon(["bench", "--questions", "nowhere.jsonl", "--context-draft"]) == 2
    assert writes[0] == "train/heads.py: error: no data\n" and len(writes) == 2
    assert writes[1].startswith("gorgon bench: error: ") and writes[1].endswith("\n")


def test_ctrl_c_ends_without_a_traceback(monkeypatch, capsys):
    """Ctrl-C in a training script or a scripts/ tool, or in a gorgon command while it imports its stage (the
    first seconds), printed a KeyboardInterrupt traceback; it ends with status 130 and nothing else."""
    def interrupted(*args):
        raise KeyboardInterrupt

    with pytest.raises(SystemExit) as exit_:
        run_script(interrupted, "train/heads.py")
    assert exit_.value.code == 130
    monkeypatch.setattr("gorgon.heads.cli.importlib.import_module", interrupted)
    assert gorgon(["bench", "--help"]) == 130
    assert capsys.readouterr().err == ""


@pytest.mark.slow
def test_accelerate_launch_quiet_prints_the_message_alone(tmp_path):
    run = subprocess.run(
        [sys.executable, "-m", "accelerate.commands.launch", "-q", "--config_file",
         str(ROOT / "configs/accelerate/cpu.yaml"), str(ROOT / "train/heads.py"), "--data", "x", "--out", "y",
         "--max-steps", "-1"], env=env(), capture_output=True, text=True, cwd=tmp_path)
    assert run.returncode != 0
    assert run.stderr == "train/heads.py: error: max_steps must be at least 0 (0 saves the untrained heads), not -1\n"


@pytest.mark.parametrize("argv, says", [
    (["generate", "--prompt", "hi", "--max-new-tokens", "0"],
     "gorgon generate: error: argument --max-new-tokens: must be at least 1, not 0 (see gorgon generate --help)"),
    (["data", "--prompts", "p.jsonl", "--out", "o", "--seed", "abc"],
     "gorgon data: error: argument --seed: invalid int value: 'abc' (see gorgon data --help)"),
    (["bench", "--questions", "q.jsonl", "--heads", "h", "--draft", "d"],
     "gorgon bench: error: argument --draft: not allowed with argument --heads (see gorgon bench --help)"),
    (["export", "--heads", "h", "--out", "o", "--format", "onnx"], "gorgon export: error: argument --format: invalid "
     "choice: 'onnx'"),
    (["export", "--heads", "h", "--out", "o", "--format", "vllm", "--dtype", "fp8"], "gorgon export: error: argument "
     "--dtype: unknown dtype 'fp8': use one of auto, float32, fp32, bfloat16, bf16, float16, fp16"),
    # The training scripts' spelling, and a typo that argparse hid behind the missing --prompt it made.
    (["generate", "--context-draft", "--prompt", "hi", "--max_new_tokens", "4"], "gorgon generate: error: "
     "unrecognized option --max_new_tokens (did you mean --max-new-tokens?) (see gorgon generate --help)"),
    (["generate", "--context-draft", "--promt", "hi"], "gorgon generate: error: unrecognized option --promt (did you "
     "mean --prompt?) (see gorgon generate --help)"),
])
def test_a_bad_option_is_one_line_without_the_usage(argv, says, capsys):
    with pytest.raises(SystemExit) as exit:
        gorgon(argv)
    err = capsys.readouterr().err
    assert exit.value.code == 2 and err.count("\n") == 1 and err.startswith(says)


def test_a_mistaken_command_names_the_command_that_takes_it(tmp_path, capsys):
    """A draft recipe given to heads training was "unknown key 'student_layers': did you mean feature_layers"; a
    malformed --repo-id asked the user to connect to the Hub; the scripts' counts of 0 and a missing file ended
    in tracebacks."""
    assert gorgon(["train", "--config", str(ROOT / "configs" / "draft" / "smollm2-135m.yaml")]) == 2
    assert "has keys this script does not take (student_layers, beta, lmbda, ...): a heads recipe (configs/heads) " \
           "trains with gorgon train" in capsys.readouterr().err
    assert gorgon(["draft", "--config", str(ROOT / "configs" / "heads" / "smollm2-135m-eagle.yaml")]) == 2
    assert "a draft model's (configs/draft) with gorgon draft" in capsys.readouterr().err
    assert gorgon(["push", "--heads", str(tmp_path), "--repo-id", "bad id"]) == 2
    assert capsys.readouterr().err == ("gorgon push: error: --repo-id 'bad id' is not a Hub repo id: pass user/name "
                                       "(or org/name) of letters, digits, -, _ and .\n")
    for script, argv, says in [
        ("profile_step.py", ["--repeat", "0"], "argument --repeat: must be at least 1, not 0"),
        ("profile_step.py", ["--random-target", str(tmp_path / "none.json")], "is not a file: pass a model's"),
        ("attention_ab.py", ["--contexts", "0"], "argument --contexts: must be at least 1, not 0"),
        ("learning_curve.py", ["--heads", str(tmp_path), "--questions", "q", "--out", str(tmp_path / "c.json")],
         f"{tmp_path} has no metrics.json: pass heads folders that train/heads.py wrote"),
    ]:
        run = subprocess.run([sys.executable, str(ROOT / "scripts" / script)] + argv, env=env(), capture_output=True,
                             text=True, timeout=120)
        assert run.returncode == 2 and run.stderr.count("\n") == 1 and says in run.stderr, (script, run.stderr)


def test_gorgons_warnings_are_one_line_on_the_command_line(monkeypatch):
    """A CLI warning came with Python's file, line number and source line ("decode/options.py:134: UserWarning:
    gorgon: CPU fast kernels are off ...", then the line of code)."""
    import warnings

    from gorgon.heads.errors import exit_status

    monkeypatch.setattr(warnings, "formatwarning", warnings.formatwarning)  # restored after the test
    assert exit_status(lambda: 0, "gorgon generate") == 0
    assert warnings.formatwarning("gorgon: fast kernels are off", UserWarning, "x.py", 3) == \
        "gorgon generate: warning: fast kernels are off\n"
    assert warnings.formatwarning("another library's", UserWarning, "x.py", 3).startswith("x.py:3: UserWarning:")


def test_torchs_launcher_reports_the_error_line_as_the_failures_cause(tmp_path, monkeypatch, capsys):
    """Under `accelerate launch` with several processes, torch's launcher ends with a report of the failed
    processes whose cause read "To enable traceback see: https://pytorch.org/docs/...": the error file it names
    each process now holds the line, which its own reader takes as the cause. N processes that fail alike print
    the line once before the report, not N times."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    from gorgon.heads.errors import exit_status

    first, second = (tmp_path / "attempt_0" / rank / "error.json" for rank in ("0", "1"))  # torch's layout
    first.parent.mkdir(parents=True)
    second.parent.mkdir()
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(first))

    def refused():
        raise GorgonError("data source x not found: pass a file")

    assert exit_status(refused, "train/heads.py") == 2
    line = "train/heads.py: error: data source x not found: pass a file"
    assert capsys.readouterr().err == line + "\n"
    assert ProcessFailure(local_rank=0, pid=1, exitcode=2, error_file=str(first)).message == line
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(second))  # the next process, failing alike, prints nothing
    assert exit_status(refused, "train/heads.py") == 2 and capsys.readouterr().err == ""
    assert ProcessFailure(local_rank=1, pid=2, exitcode=2, error_file=str(second)).message == line
    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE")  # not launched by it: every process prints, and no file
    first.unlink()
    second.unlink()
    assert exit_status(refused, "train/heads.py") == 2 and capsys.readouterr().err == line + "\n"
    assert not first.exists() and not second.exists()


def test_help_into_a_pipe_closed_early_ends_without_a_traceback():
    """`python train/heads.py --help | head` ended in a BrokenPipeError traceback."""
    for argv in (["train/heads.py", "--help"], ["-m", "gorgon.heads.cli", "train", "--help"]):
        proc = subprocess.Popen([sys.executable, *argv], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                env=env())
        proc.stdout.close()  # the reader is gone before the help is written (at exit, stdout being a pipe)
        err = proc.stderr.read().decode()
        assert proc.wait() == 141 and "Traceback" not in err, err


def test_a_mistyped_command_is_named_with_the_closest(capsys):
    assert gorgon(["generat"]) == 2
    assert capsys.readouterr().err.startswith("gorgon: unknown command 'generat' (did you mean generate?)")


def test_training_data_is_checked_before_the_target_loads(tmp_path):
    """A bad --data fails first: an 8B target takes minutes to load. (The target here does not exist: the error
    is the data's, so it came first.)"""
    from gorgon.train.draft import DraftTrainConfig
    from gorgon.train.draft import train as train_draft

    (tmp_path / "empty.jsonl").write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    for data, says in [(tmp_path / "missing.jsonl", "missing.jsonl"), (tmp_path / "empty.jsonl", "no conversations "
                                                                        "with assistant answers to train on")]:
        for run, config in [(train, HeadsTrainConfig), (train_draft, DraftTrainConfig)]:
            with pytest.raises(GorgonError, match=re.escape(says)):
                run(config(data=str(data), out=str(tmp_path / "o"), target=str(tmp_path / "no-target"),
                           report_to="none"))


def test_resume_on_a_finished_run_with_nothing_more_to_train_is_refused(tmp_path):
    """It retrained the steps after the last checkpoint and replaced the finished heads with a copy, and with a
    smaller max_steps with an earlier state. A rerun without --resume names the finished run. (Also: --out that is
    the --data path is named as that.)"""
    target = str(tiny_chat_target(tmp_path))
    with pytest.raises(GorgonError, match=r"^--out .*d is the --data path: choose another --out$"):
        train(HeadsTrainConfig(data=str(tmp_path / "d"), out=str(tmp_path / "d"), report_to="none"))
    cfg = dict(data=toy_data(tmp_path / "toy.jsonl", n=8), out=str(tmp_path / "run"), target=target, max_steps=3,
               save_every=2, report_to="none")
    out = train(HeadsTrainConfig(**cfg))
    before = snapshot(out)
    for shorter in (3, 2):
        with pytest.raises(GorgonError, match=r"holds a finished run of 3 steps, and these settings train no longer: "
                                              r"there is nothing to resume \(raise epochs or max_steps"):
            train(HeadsTrainConfig(**{**cfg, "max_steps": shorter}, resume=True))
    with pytest.raises(GorgonError, match=r"holds a finished run: pass --overwrite true to train it again, --resume "
                                          r"true with more epochs or max_steps to train it longer"):
        train(HeadsTrainConfig(**cfg))
    assert snapshot(out) == before
    train(HeadsTrainConfig(**{**cfg, "max_steps": 4}, resume=True))  # longer: resumed from step 2
    assert json.loads((out / "metrics.json").read_text())["steps"] == 4


def test_a_run_replacing_finished_output_keeps_its_lock_while_it_saves(tmp_path, monkeypatch):
    """Setting the finished run's files aside moved the live run's lock with them: from then until the end a
    second run was let into the folder (found by a helper pausing a 2-process run in its save)."""
    import gorgon.train.run_folder as run_folder
    from gorgon.train.run_folder import LOCK

    cfg = dict(data=toy_data(tmp_path / "toy.jsonl", n=8), out=str(tmp_path / "run"), target=str(tiny_chat_target(
        tmp_path)), max_steps=1, report_to="none", save_every=0)
    train(HeadsTrainConfig(**cfg))
    set_aside = run_folder.set_aside_earlier_run
    locked = []
    monkeypatch.setattr(run_folder, "set_aside_earlier_run",
                        lambda out: (set_aside(out), locked.append((out / LOCK).is_file())))
    train(HeadsTrainConfig(**cfg, overwrite=True))
    assert locked == [True]


def test_a_folder_another_live_run_is_writing_is_refused(tmp_path):
    """Killing `accelerate launch` alone leaves its training processes running: a second run into the same folder
    would write beside them. A lock naming a live process of this machine refuses it; a dead one's does not."""
    from gorgon.heads.files import host_name
    from gorgon.train.run_folder import LOCK, RUN_MARKER

    cfg = dict(data=toy_data(tmp_path / "toy.jsonl", n=8), out=str(tmp_path / "run"), target=str(tiny_chat_target(
        tmp_path)), max_steps=1, report_to="none", save_every=0)
    out = Path(cfg["out"])
    out.mkdir()
    (out / RUN_MARKER).write_text("")
    with another_live_process() as pid:
        (out / LOCK).write_text(f"{host_name()} {pid}\n")
        with pytest.raises(GorgonError, match=rf"run is being written by another training run \(process {pid}, "
                                              rf"still running\): wait for it to end, or stop it \(kill {pid}\)"):
            train(HeadsTrainConfig(**cfg))
    train(HeadsTrainConfig(**cfg))  # its process gone, the lock is stale
    assert (out / "recipe.json").is_file() and not (out / LOCK).exists()


def test_a_lock_whose_process_id_was_given_to_another_process_is_stale(tmp_path):
    """Process ids are reused (here within minutes): a killed run's lock then named a live stranger, and the rerun
    was refused and told to kill it. The lock records when its process started."""
    from gorgon.heads.files import check_unlocked, host_name, process_start, take_lock

    lock = tmp_path / "lock"
    with another_live_process() as pid:
        lock.write_text(f"{host_name()} {pid} {process_start(pid)}\n")
        with pytest.raises(GorgonError, match=rf"being written by another gorgon run \(process {pid}"):
            check_unlocked(lock, "gorgon run")
        if process_start(pid):  # Linux: a start that is not this process's is another's lock
            lock.write_text(f"{host_name()} {pid} 1\n")
            check_unlocked(lock, "gorgon run")
    take_lock(lock)
    assert lock.read_text() == f"{host_name()} {os.getpid()} {process_start(os.getpid())}\n"


def test_a_refused_run_leaves_the_folder_another_run_made_meanwhile(tmp_path):
    """Two runs started together into a new --out: the refused one removed the folder as its own empty output,
    the running one's marker and lock with it (it then ran unlocked)."""
    from gorgon.heads.files import take_lock
    from gorgon.train.run_folder import LOCK, RUN_MARKER, no_empty_output_left

    out, mine = tmp_path / "run", tmp_path / "mine"
    with pytest.raises(GorgonError), no_empty_output_left(out):
        take_lock(out / LOCK)  # as the other run, which made the folder after this one looked
        (out / RUN_MARKER).write_text("")
        raise GorgonError("is being written by another training run")
    assert (out / LOCK).is_file() and (out / RUN_MARKER).is_file()
    with pytest.raises(GorgonError), no_empty_output_left(mine):  # a run's own failure leaves nothing
        mine.mkdir()
        (mine / RUN_MARKER).write_text("")
        raise GorgonError("bad data")
    assert not mine.exists()


def test_an_export_format_for_the_other_method_is_refused_before_the_target_loads(tmp_path, capsys):
    heads = tmp_path / "heads"
    MedusaHeads.for_target(tiny_model()).save_pretrained(heads)
    assert gorgon(["export", "--heads", str(heads), "--target", str(tmp_path / "no-target"), "--format", "eagle3",
                   "--out", str(tmp_path / "e3")]) == 2  # the target does not exist: the format's error came first
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.strip().endswith("holds Medusa heads, which export as vllm or medusa, not "
                                                         "eagle3")


def test_options_that_cannot_apply_are_refused_before_the_target_loads(tmp_path, capsys):
    """Each was refused only after the target had loaded (seconds here, minutes for a large target), or not at
    all (--top-p with greedy decoding did nothing). The target named here does not exist, so a refusal that
    came after its load would name it instead."""
    from helpers import QUESTIONS, questions_file

    heads, nowhere = tmp_path / "heads", str(tmp_path / "no-target")
    MedusaHeads.for_target(tiny_model()).save_pretrained(heads)
    questions = str(questions_file(tmp_path / "q.jsonl", QUESTIONS[:1]))
    medusa = ["--heads", str(heads), "--target", nowhere]
    bench = ["bench", "--questions", questions, "--target", nowhere]
    tiny, toy = tmp_path / "config-only", toy_data(tmp_path / "toy.jsonl", n=8)
    tiny.mkdir()  # a target whose config reads and whose weights do not load
    shutil.copy(tiny_chat_target(tmp_path) / "config.json", tiny)
    capsys.readouterr()
    cases = [
        (["generate", "--prompt", "hi", "--draft-depth", "3"] + medusa, "--draft-depth and --draft-topk shape a "
         "feature-level head's search; Medusa heads draft one level per head: choose their tree with --tree"),
        (["generate", "--prompt", "hi", "--draft", str(tmp_path / "no-draft"), "--target", nowhere],
         f"no draft model at {tmp_path / 'no-draft'}: pass an existing folder or a hub id"),
        (["generate", "--prompt", "hi", "--context-draft", "--tree", "8", "--target", nowhere],
         "--tree sizes a --heads or --draft tree: --context-draft alone proposes what the context repeats"),
        (["generate", "--prompt", "hi", "--top-p", "0.9"] + medusa, "--top-p shapes sampling, and --temperature 0 "
         "decodes greedily: pass a --temperature above 0 too, or drop it"),
        (bench + ["--heads", str(heads), "--baselines", "no-context", "--out", str(tmp_path / "d" / "r.json")],
         "--baselines no-context times the --heads or --draft drafter without the context draft"),
        (bench + ["--heads", str(heads), "--assistant", str(tmp_path / "no-assistant"), "--top-k", "5"],
         f"no assistant model at {tmp_path / 'no-assistant'}"),
        (bench + ["--heads", str(heads), "--top-k", "5", "--top-p", "0.9"], "--top-k and --top-p shape sampling"),
        (["data", "--prompts", questions, "--target", nowhere, "--top-p", "0.9", "--out", str(tmp_path / "o")],
         "--top-p 0.9 samples, and --temperature 0 answers greedily"),
        (["draft", "--data", toy, "--target", str(tiny), "--out", str(tmp_path / "dr"), "--student-layers", "2"],
         "student_layers must be between 1 and 1 (the target has 2 layers), not 2"),
    ]
    if importlib.util.find_spec("vllm") is None:
        cases.append((["data", "--prompts", questions, "--target", nowhere, "--engine", "vllm", "--out",
                       str(tmp_path / "o")], "--engine vllm needs vLLM"))
    for argv, says in cases:
        assert gorgon(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and says in err, (argv, err)
    assert not (tmp_path / "d").exists()  # the refused bench's --out folder is not left behind
    # A bench that fails after taking its report's place leaves no folder it made either.
    assert gorgon(bench + ["--heads", str(heads), "--out", str(tmp_path / "e" / "f" / "r.json")]) == 2
    assert "no target at" in capsys.readouterr().err and not (tmp_path / "e").exists()


def test_a_failed_command_removes_the_parent_folders_it_made_for_its_output(tmp_path, monkeypatch, capsys):
    """A failure left the empty folders made above --out (d/e of d/e/out): `gorgon data`, training and export."""
    from gorgon.heads.methods.medusa import formats
    from gorgon.train.heads import main as train_heads

    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hi"}\n')
    with pytest.raises(GorgonError, match="^no target"):
        make_dataset(DataSettings(prompts=str(prompts), target=str(tmp_path / "nowhere")), tmp_path / "d" / "e" / "o",
                     progress=False)
    with pytest.raises(GorgonError, match="has no conversations with assistant answers"):
        train_heads(["--data", str(prompts), "--out", str(tmp_path / "t" / "u" / "o"), "--report-to", "none"])
    target, heads = tiny_chat_target(tmp_path), tmp_path / "heads"
    MedusaHeads.for_target(AutoModelForCausalLM.from_pretrained(target)).save_pretrained(heads)

    def fails(*args):
        raise GorgonError("no space left")

    monkeypatch.setattr(formats, "export_heads", fails)
    assert gorgon(["export", "--heads", str(heads), "--target", str(target), "--format", "medusa",
                   "--out", str(tmp_path / "x" / "y" / "o")]) != 0
    assert "no space left" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["heads", "p.jsonl", Path(target).name])
    # A parent that holds anything else stays.
    (tmp_path / "d" / "e").mkdir(parents=True)
    (tmp_path / "d" / "mine.txt").write_text("mine")
    with pytest.raises(GorgonError, match="^no target"):
        make_dataset(DataSettings(prompts=str(prompts), target=str(tmp_path / "nowhere")),
                     tmp_path / "d" / "e" / "f" / "o", progress=False)
    assert sorted(p.name for p in (tmp_path / "d").iterdir()) == ["e", "mine.txt"]


def test_heads_are_not_saved_over_another_model(tmp_path):
    """save_pretrained into a transformers model's folder replaced its config.json and model.safetensors (and
    Medusa heads without trees removed a trees.json there): refused; heads saved before are saved over."""
    model = tiny_model()
    folder, file = tmp_path / "model", tmp_path / "notes.txt"
    model.save_pretrained(folder)
    (folder / "trees.json").write_text("mine")
    file.write_text("mine")
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    for heads in (MedusaHeads.for_target(model), EagleHead.for_target(model)):
        with pytest.raises(GorgonError, match=f"^{re.escape(str(folder))} holds another model's config.json, which "
                                              "saving heads there would replace: save them into a new or empty"):
            heads.save_pretrained(folder)
        with pytest.raises(GorgonError, match="is a file, not a folder: save the heads into a new or empty folder"):
            heads.save_pretrained(file)
        heads.save_pretrained(tmp_path / "heads")
        heads.save_pretrained(tmp_path / "heads")  # its own folder: saved over
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before and file.read_text() == "mine"
    (folder / "config.json").unlink()
    with pytest.raises(GorgonError, match="holds another model's model.safetensors"):
        MedusaHeads.for_target(model).save_pretrained(folder)


def test_the_python_api_takes_what_its_loaders_return_and_names_its_mistakes(tmp_path):
    """A `Target` where a model goes, loaded heads where a drafter goes, "bfloat16" or an absent device in
    from_pretrained, and Medusa heads in another dtype than the target failed inside torch or Python."""
    target = load_target(str(tiny_chat_target(tmp_path)), device="cpu")
    MedusaHeads.for_target(target.model).save_pretrained(tmp_path / "heads")
    ids = torch.randint(1, 50, (1, 5), generator=torch.Generator().manual_seed(0))
    heads = MedusaHeads.from_pretrained(tmp_path / "heads", target=target)
    assert speculative_generate(target, MedusaDrafter(heads), ids, 6).tokens == \
        speculative_generate(target.model, MedusaDrafter(heads), ids, 6).tokens
    with pytest.raises(GorgonError, match="^drafter must be a drafter, not a MedusaHeads: wrap loaded heads as "
                                          r"gorgon.heads.drafter_for\(heads\)$"):
        speculative_generate(target, heads, ids, 6)
    with pytest.raises(GorgonError, match="^the target to load must be a folder, a hub id or None, not a Target: "
                                          "for heads onto a target loaded already, use gorgon.heads.load_heads_for"):
        load_heads(tmp_path / "heads", target=target)
    assert next(MedusaHeads.from_pretrained(tmp_path / "heads", dtype="bfloat16").parameters()).dtype == torch.bfloat16
    assert next(MedusaHeads.from_pretrained(tmp_path / "heads", target=target, dtype="auto").parameters()).dtype == \
        torch.float32
    if not torch.cuda.is_available():
        with pytest.raises(GorgonError, match="^device 'cuda' is not available on this machine: use cpu, or auto"):
            MedusaHeads.from_pretrained(tmp_path / "heads", device="cuda")
    with pytest.raises(GorgonError, match=r"^unknown tree 'trees.json': pass a list of rank paths \(a JSON file of "
                                          r"them: json.load it\), a node count or 'auto'$"):
        MedusaDrafter(heads, "trees.json")  # the command line reads such a file; Python is given the paths
    drafter = MedusaDrafter(MedusaHeads.from_pretrained(tmp_path / "heads"))
    with pytest.raises(GorgonError, match=r"^the heads are in torch.float32 on cpu but the target in torch.bfloat16 on "
                                          r"cpu: move them to the target's \(heads.to\('cpu', torch.bfloat16\)\)$"):
        speculative_generate(target.model.to(torch.bfloat16), drafter, ids, 6)


def test_a_generator_on_another_device_than_the_model_is_named():
    """A generator on cuda:0 passed the device type check for a model on cuda:1 and failed inside torch."""
    from types import SimpleNamespace

    from gorgon.decode.generate import same_device

    model = tiny_model("llama")
    drafter = MedusaDrafter(MedusaHeads.for_target(model, num_heads=2))
    elsewhere = SimpleNamespace(device=torch.device("cuda", 0))  # only its device is read before a draw
    with pytest.raises(GorgonError, match=r"^the generator is on cuda:0 but the model on cpu: create it with "
                                          r"torch.Generator\(device='cpu'\)$"):
        speculative_generate(model, drafter, torch.ones(1, 4, dtype=torch.long), 4, generator=elsewhere)
    assert not same_device(torch.device("cuda", 0), torch.device("cuda", 1))
    assert same_device(torch.device("cuda"), torch.device("cuda", 1)) and same_device(torch.device("cpu"),
                                                                                      torch.device("cpu"))


def test_python_arguments_of_the_wrong_kind_are_named(tmp_path):
    """Float ids, an EOS given as text, a number as stop strings and a string temperature failed inside torch or
    Python (or named only the value); a token map given as a list failed at .to()."""
    from gorgon.heads.methods.draft_model import cut_to_draft_vocab

    model = tiny_model()
    drafter = MedusaDrafter(MedusaHeads.for_target(model, num_heads=2), tree=[[0], [0, 0]])
    ids = torch.randint(1, 50, (1, 5), generator=torch.Generator().manual_seed(0))
    for kwargs, says in [(dict(input_ids=ids.float()), r"^input_ids must be token ids \(an integer tensor\), not "
                                                       r"torch.float32: tokenizer\(text, return_tensors='pt'\)"),
                         (dict(eos_token_id="<|im_end|>"), r"^eos_token_id must be token ids, not '<\|im_end\|>': a "
                                                           r"token's id is tokenizer.convert_tokens_to_ids\(token\)$"),
                         (dict(stop_strings=123), r"^stop_strings must be text \(a string or a list of them\), not "
                                                  "123$")]:
        with pytest.raises(GorgonError, match=says):
            speculative_generate(model, drafter, **{"input_ids": ids, "max_new_tokens": 4, **kwargs})
    with pytest.raises(GorgonError, match=r"^temperature must be a finite number >= 0 \(0 is greedy\), not '0.7'$"):
        Sampling("0.7")
    with pytest.raises(GorgonError, match=r"^speculative_generate takes no temperature \(a generate argument\): pass "
                                          r"sampling=Sampling.like_generate\(model, temperature, top_k, top_p\)$"):
        speculative_generate(model, drafter, ids, 4, temperature=0.7)
    with pytest.raises(TypeError, match="unexpected keyword argument 'max_new_token'"):
        speculative_generate(model, drafter, ids, max_new_token=4)
    draft, token_map = tiny_model(), list(range(0, 64, 2))
    cut_to_draft_vocab(draft, torch.tensor(token_map))
    chain = DraftModelDrafter(draft, 3, token_map=token_map)
    assert speculative_generate(model, chain, ids, 6, eos_token_id=None).tokens == \
        model.generate(ids, max_new_tokens=6, do_sample=False, eos_token_id=None)[0, 5:].tolist()


def test_ctrl_c_says_what_was_kept_and_how_to_go_on(tmp_path, capsys):
    """Ctrl-C ended training and data generation silently (after a half-drawn progress bar): a user learnt of
    --resume only from the refusal of a plain rerun. (The first newline ends the bar's line.)"""
    from gorgon.heads.files import take_lock
    from gorgon.train.data import holding
    from gorgon.train.run_folder import LOCK, RUN_MARKER, lock_released_on_failure

    out = tmp_path / "run"
    (out / "checkpoints" / "step-20").mkdir(parents=True)
    (out / RUN_MARKER).write_text("")
    for kept, says in [(out / "checkpoints" / "step-20", f"{out / 'checkpoints' / 'step-20'} is kept: rerun the "
                                                         "command with --resume true to continue from it"),
                       (None, "no checkpoint was saved yet (save_every sets how often): a rerun starts over")]:
        with pytest.raises(KeyboardInterrupt), lock_released_on_failure(out, lambda kept=kept: kept):
            take_lock(out / LOCK)
            raise KeyboardInterrupt
        assert capsys.readouterr().err == f"\ngorgon: {says}\n" and not (out / LOCK).exists()
    # Stopped before it took the folder, which another run holds: that run's checkpoints are not looked
    # for (looking removes one cut short: the other run's, being written), and nothing is said of them.
    (out / LOCK).write_text("elsewhere 1 0\n")
    with pytest.raises(KeyboardInterrupt), lock_released_on_failure(out, lambda: pytest.fail("looked")):
        raise KeyboardInterrupt
    assert capsys.readouterr().err == "" and (out / LOCK).read_text() == "elsewhere 1 0\n"
    partial = tmp_path / "data.partial"
    with pytest.raises(KeyboardInterrupt), holding(partial):
        (partial / "shard-00000.jsonl").write_text("{}\n")
        raise KeyboardInterrupt
    assert capsys.readouterr().err == (f"\ngorgon data: the 1 shard(s) finished so far are kept in {partial}: rerun "
                                       "the same command to go on from them\n")


def test_a_drafter_on_another_device_than_the_target_is_named(tmp_path):
    """A feature-level head or a draft model left on another device than the target passed the check and failed
    inside torch at the first step ("Expected all tensors to be on the same device"); Medusa heads were named.
    The meta device stands in for a GPU here."""
    from gorgon.heads import EagleDrafter

    model = tiny_model()
    ids = torch.randint(1, 50, (1, 5), generator=torch.Generator().manual_seed(0))
    head = EagleHead.for_target(model).to("meta")
    with pytest.raises(GorgonError, match=r"^the head is on meta but the target on cpu: move it to the target's "
                                          r"device \(.to\('cpu'\)\)$"):
        speculative_generate(model, EagleDrafter(head, nodes=4), ids, 6)
    draft = tiny_model(seed=1).to("meta")
    with pytest.raises(GorgonError, match=r"^the draft model is on meta but the target on cpu: move it"):
        speculative_generate(model, DraftModelDrafter(draft), ids, 6)
