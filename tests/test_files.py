"""Output files and folders, as every command writes them: --out checked before the work, a folder of
someone else's left alone, atomic writes, locks, the umask, nothing left behind by a failure."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import (
    QUESTIONS,
    another_live_process,
    foreign_folder,
    questions_file,
    saved_heads,
    snapshot,
    tiny_chat_target,
    tiny_model,
    tiny_tokenizer,
    toy_data,
)
from transformers import AutoModelForCausalLM

from gorgon.heads import GorgonError, MedusaHeads
from gorgon.heads.cli import main as gorgon
from gorgon.heads.files import atomic_write_text, new_temp
from gorgon.train.data import DataSettings, make_dataset
from gorgon.train.heads import HeadsTrainConfig, train


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
    from gorgon.heads.outputs import move_into_place

    out, tmp = tmp_path / "out", tmp_path / ".out.tmp"
    for made in (tmp, out):
        made.mkdir()
        (made / "config.json").write_text(made.name)
    with pytest.raises(GorgonError, match=rf"^--out {re.escape(str(out))} was written by another process while this "
                                          r"one worked \(.*\): nothing of this run's was put there; rerun with"):
        move_into_place(tmp, out, "config.json")
    assert (out / "config.json").read_text() == "out" and not tmp.exists()


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


@pytest.mark.slow
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


@pytest.mark.slow
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


def test_a_lock_whose_process_id_was_given_to_another_process_is_stale(tmp_path):
    """Process ids are reused (here within minutes): a killed run's lock then named a live stranger, and the rerun
    was refused and told to kill it. The lock records when its process started."""
    from gorgon.heads.files import host_name
    from gorgon.heads.outputs import check_unlocked, process_start, take_lock

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
