"""Faults injected into the long commands (data, train, export, bench, push): a disk that fills part-way
through a write, a SIGKILL mid-run (slow), damaged inputs, silly numbers. Each ends in one line naming the
problem and the fix, or in a clean resume, and nothing that existed before is changed (its checksums)."""

import errno
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import datasets
import pytest
import safetensors.torch
import torch
from helpers import LAUNCH, ROOT, chat_target_with_heads, env, questions_file, tiny_model
from matplotlib.figure import Figure
from safetensors import SafetensorError
from test_publish import FakeHub, hub, push  # noqa: F401 (hub: the fixture of the suite's local Hub)

from gorgon.decode import Sampling, speculative_generate
from gorgon.decode.acceptance import MIN_TEMPERATURE, target_probs
from gorgon.heads import ContextDrafter, EagleHead, GorgonError
from gorgon.heads.cli import main as gorgon
from gorgon.heads.loading import drafter_for
from gorgon.train.data import METADATA_NAME, DataSettings, make_dataset
from gorgon.train.records import read_records

NO_SPACE = "No space left on device"


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """What the commands read, made once: a tiny chat target, random Medusa and EAGLE heads for it, its
    `gorgon data` output (6 prompts) and 4 bench questions. Tests copy what they damage."""
    root = tmp_path_factory.mktemp("made")
    target, loaded, heads = chat_target_with_heads(root)
    EagleHead.for_target(loaded.model, target_fingerprint=loaded.fingerprint).save_pretrained(root / "eagle")
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"question {i}"}) + "\n" for i in range(6)))
    settings = DataSettings(prompts=str(prompts), target=str(target), max_new_tokens=6)
    data = make_dataset(settings, root / "data", progress=False)
    return {"target": target, "heads": heads, "eagle": root / "eagle", "data": data, "settings": settings,
            "questions": questions_file(root / "q.jsonl")}


def checksums(root: Path) -> dict[str, str]:
    """Every file under `root`, by its path from there, with a hash of its bytes."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def error_line(capsys, command: str) -> str:
    """The one error line a command printed last on stderr (after its progress, if any), with no traceback."""
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    line = err.strip().splitlines()[-1]
    assert line.startswith(f"gorgon {command}: error: "), err
    return line


def copy_of(folder: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(folder, tmp_path / folder.name))


def cut_in_half(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def full_disk(monkeypatch) -> None:
    """The disk reports 1 MiB free: what `full_disk_is_one_line` checks when a library words the failure its way."""
    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**9, 10**9 - 2**20, 2**20))


def fills_part_way(monkeypatch, owner, name: str, error: Exception) -> None:
    """`owner.name`, a writer whose second argument is its file (or a folder of .arrow shards), writes it, then
    fails with `error`, leaving half of it, as when the disk fills."""
    write = getattr(owner, name)

    def half_then_full(*args, **kwargs):
        write(*args, **kwargs)
        written = Path(args[1])
        cut_in_half(next(written.glob("*.arrow")) if written.is_dir() else written)
        raise error

    monkeypatch.setattr(owner, name, half_then_full)


def refused(args: list[str], capsys, root: Path) -> str:
    """The one error line of a command refused with status 2, which changed nothing under `root`."""
    before = checksums(root)
    assert gorgon(args) == 2
    line = error_line(capsys, args[0])
    assert checksums(root) == before
    return line


# Damaged `gorgon data` output: each is named as such, with the rerun that makes it again.

def truncate_shard(folder):
    cut_in_half(next(folder.glob("data-*.arrow")))


def delete_shard(folder):
    next(folder.glob("data-*.arrow")).unlink()


def name_a_missing_shard(folder):
    state = json.loads((folder / "state.json").read_text())
    state["_data_files"][0]["filename"] = "data-00003-of-00004.arrow"
    (folder / "state.json").write_text(json.dumps(state))


def edit_state(folder):
    (folder / "state.json").write_text("{\"_data_files\": [")


def edit_metadata(folder):
    (folder / METADATA_NAME).write_text("{\"target\": ")


def list_metadata(folder):
    (folder / METADATA_NAME).write_text("[]")


@pytest.mark.parametrize("damage", [truncate_shard, delete_shard, name_a_missing_shard, edit_state, edit_metadata,
                                    list_metadata])
def test_damaged_data_is_named_with_the_rerun_that_makes_it_again(made, tmp_path, capsys, damage):
    """A truncated .arrow shard ended training in a pyarrow traceback; a deleted shard was "not a saved datasets
    dataset", though gorgon wrote it."""
    data = copy_of(made["data"], tmp_path)
    damage(data)
    line = refused(["train", "--data", str(data), "--out", str(tmp_path / "run"), "--target", str(made["target"])],
                   capsys, tmp_path)
    assert f"{data} is `gorgon data` output, damaged (" in line
    assert line.endswith("make it again by rerunning the `gorgon data` command that wrote it, with --overwrite")


def test_another_datasets_folder_cut_short_is_one_line(made, tmp_path):
    data = copy_of(made["data"], tmp_path)
    (data / METADATA_NAME).unlink()  # saved by `datasets` itself
    truncate_shard(data)
    with pytest.raises(GorgonError, match=rf"^{data} is a `datasets` folder that cannot be read \(.*\): save it again"):
        read_records(str(data))


def test_the_rerun_the_damage_message_advises_makes_the_data_again(made, tmp_path):
    """A truncated shard leaves every file in place, so a rerun without --overwrite took the data for complete."""
    data = copy_of(made["data"], tmp_path)
    truncate_shard(data)
    make_dataset(made["settings"], data, progress=False, overwrite=True)
    assert read_records(str(data)) == read_records(str(made["data"]))


# A disk that fills part-way through a write.

def test_data_on_a_full_disk_is_one_line_and_the_rerun_finishes_from_its_shards(made, tmp_path, capsys, monkeypatch):
    fills_part_way(monkeypatch, datasets.Dataset, "save_to_disk", OSError(errno.ENOSPC, NO_SPACE))
    out = tmp_path / "data"
    args = ["data", "--prompts", made["settings"].prompts, "--target", str(made["target"]), "--max-new-tokens", "6",
            "--out", str(out)]
    assert gorgon(args) == 2
    assert error_line(capsys, "data").endswith(f"cannot write {out} ({NO_SPACE}): free some space")
    assert not out.exists() and [p.name for p in tmp_path.iterdir()] == ["data.partial"]
    monkeypatch.undo()
    assert gorgon(args) == 0
    assert read_records(str(out)) == read_records(str(made["data"])) and not (tmp_path / "data.partial").exists()


def test_export_onto_a_full_disk_is_one_line_and_leaves_nothing(made, tmp_path, capsys, monkeypatch):
    """safetensors words a full disk its own way (a SafetensorError): it was a traceback."""
    fills_part_way(monkeypatch, safetensors.torch, "save_file", SafetensorError(f"I/O error: {NO_SPACE} (os error 28)"))
    full_disk(monkeypatch)
    line = refused(["export", "--heads", str(made["heads"]), "--target", str(made["target"]), "--format", "vllm",
                    "--out", str(tmp_path / "export")], capsys, tmp_path)
    assert line.endswith(f"the disk holding {tmp_path / 'export'} is full (1 MiB free; SafetensorError while writing): "
                         "free some space, then rerun")


def test_training_on_a_full_disk_is_one_line_and_resumes_from_its_checkpoint(made, tmp_path, capsys, monkeypatch):
    fills_part_way(monkeypatch, safetensors.torch, "save_file", SafetensorError(f"I/O error: {NO_SPACE} (os error 28)"))
    full_disk(monkeypatch)
    out, inputs = tmp_path / "run", made["data"].parent
    args = ["train", "--data", str(made["data"]), "--target", str(made["target"]), "--out", str(out), "--max_steps",
            "2", "--save_every", "1", "--report_to", "none"]
    line = refused(args, capsys, inputs)
    assert line.endswith(f"the disk holding {out} is full (1 MiB free; SafetensorError while writing): free some "
                         "space, then rerun (--resume true if a checkpoint was saved)")
    assert (out / "checkpoints" / "step-1").is_dir() and not (out / "model.safetensors").exists()
    monkeypatch.undo()
    assert gorgon(args + ["--resume", "true"]) == 0
    assert "resumed from" in capsys.readouterr().err and safetensors.torch.load_file(out / "model.safetensors")


def bench(made, out: Path, *more: str) -> list[str]:
    return ["bench", "--heads", str(made["heads"]), "--target", str(made["target"]), "--questions",
            str(made["questions"]), "--max-new-tokens", "4", "--tree", "4", "--baselines", "generate", "--out",
            str(out), *more]


def test_a_bench_whose_plot_finds_the_disk_full_names_it_and_keeps_the_report(made, tmp_path, capsys, monkeypatch):
    """The plot's failed write named no path, and the report written whole went unmentioned."""
    fills_part_way(monkeypatch, Figure, "savefig", OSError(errno.ENOSPC, NO_SPACE))
    out = tmp_path / "bench.json"
    assert gorgon(bench(made, out, "--limit", "1")) == 2
    assert error_line(capsys, "bench").endswith(f"error: {out} is written, but not its plot: cannot write "
                                                f"{out.with_suffix('.png')} ({NO_SPACE}): free some space")
    assert json.loads(out.read_text())["complete"] and [p.name for p in tmp_path.iterdir()] == ["bench.json"]


# Damaged inputs of the other commands.

def test_a_truncated_or_edited_heads_folder_is_one_line(made, tmp_path, capsys):
    heads = copy_of(made["heads"], tmp_path)
    export = ["export", "--heads", str(heads), "--target", str(made["target"]), "--format", "vllm", "--out",
              str(tmp_path / "export")]
    cut_in_half(heads / "model.safetensors")
    assert f"the weights in {heads} are corrupt" in refused(export, capsys, tmp_path)
    shutil.copy(made["heads"] / "model.safetensors", heads)
    (heads / "config.json").write_text("{\"num_heads\": ")
    assert f"cannot read {heads / 'config.json'} (JSONDecodeError)" in refused(export, capsys, tmp_path)
    config = json.loads((made["heads"] / "config.json").read_text())
    (heads / "config.json").write_text(json.dumps({**config, "num_heads": "four"}))
    assert "has num_heads = 'four', which is not int" in refused(export, capsys, tmp_path)


@pytest.mark.parametrize("text,expected", [("", "is empty"), ("# all commented out\n", "is empty"), ("{}", "is empty"),
                                           ("- data\n- out\n", "must be a mapping"), ("3", "must be a mapping")])
def test_an_empty_or_non_mapping_recipe_is_refused(tmp_path, capsys, text, expected):
    """An empty recipe trained silently on the built-in defaults."""
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(text)
    assert gorgon(["train", "--config", str(recipe), "--data", "nowhere.jsonl", "--out", str(tmp_path / "run")]) == 2
    assert f"config {recipe} {expected}" in error_line(capsys, "train") and os.listdir(tmp_path) == ["recipe.yaml"]


# Silly numbers and API misuse.

def test_a_temperature_too_small_to_divide_by_is_refused(tmp_path, capsys):
    """--temperature 1e-300 overflowed the logits divided by it: "probability tensor contains inf/nan". Refused
    before the target loads (there is none)."""
    for temperature in ("1e-300", "1e-38"):
        args = ["generate", "--context-draft", "--temperature", temperature, "--prompt", "hi", "--target", "nowhere"]
        assert f"temperature {float(temperature)!r} is too small" in refused(args, capsys, tmp_path)
    with pytest.raises(GorgonError, match="pass 0 \\(greedy\\) or at least 1e-30"):
        Sampling(1e-31)
    probs = target_probs(torch.tensor([1e8, 0.0, -1e8]), Sampling(MIN_TEMPERATURE))  # the smallest allowed
    assert torch.equal(probs, torch.tensor([1.0, 0.0, 0.0]))


def test_token_ids_outside_the_vocabulary_are_refused():
    model = tiny_model()
    for token in (10**6, -5):
        with pytest.raises(GorgonError, match=f"input_ids holds {token}, which is no token of the model's vocabulary"):
            speculative_generate(model, ContextDrafter(), torch.tensor([[1, token, 2]]), 4)


def test_a_draft_depth_no_tree_of_its_size_can_reach_is_refused(made, capsys):
    """An EAGLE head's search drafted `--draft-depth 50` levels for a 4-node tree, which holds 3."""
    args = ["generate", "--heads", str(made["eagle"]), "--target", str(made["target"]), "--tree", "4", "--prompt", "hi"]
    assert refused(args + ["--draft-depth", "50"], capsys, made["eagle"]).endswith(
        "--draft-depth 50 cannot be reached in a 4-node tree (the root and one candidate per level): pass "
        "--draft-depth from 1 to 3, or more nodes (--tree)")
    head = EagleHead.from_pretrained(made["eagle"])
    assert drafter_for(head, 4, depth=3).depth == 3
    assert drafter_for(head, 3).depth == head.config.depth  # the saved depth, cut to the tree as the search goes


def test_a_context_ngram_past_the_usable_range_is_refused(tmp_path, capsys):
    """Refused before the target loads (there is none)."""
    args = ["generate", "--context-draft", "--context-ngram", "100000", "--prompt", "hi", "--target", "nowhere"]
    assert "the n-gram size (--context-ngram) must be from 1 to 32, not 100000" in refused(args, capsys, tmp_path)
    with pytest.raises(GorgonError, match="must be from 1 to 32, not 33"):
        ContextDrafter(max_ngram=33)
    assert ContextDrafter(max_ngram=32).max_ngram == 32


def test_a_push_of_heads_cut_short_or_edited_is_refused_before_the_hub(made, tmp_path, capsys):
    """Weights cut short and a config.json no loader reads went up to the Hub without a word."""
    heads = copy_of(made["heads"], tmp_path)
    cut_in_half(heads / "model.safetensors")
    args = ["push", "--heads", str(heads), "--repo-id", "someone/tiny-heads"]
    assert f"the weights in {heads} are corrupt" in refused(args, capsys, tmp_path)
    shutil.copy(made["heads"] / "model.safetensors", heads)
    (heads / "config.json").write_text("{\"num_heads\": ")
    assert f"cannot read {heads / 'config.json'} (JSONDecodeError)" in refused(args, capsys, tmp_path)


# SIGKILL mid-run: the next run goes on cleanly.

def killed_when(cmd: list[str], ready, cwd: Path, variables: dict | None = None) -> None:
    """Run `cmd` (with `variables` added to its environment) and SIGKILL it as soon as `ready()` is true."""
    proc = subprocess.Popen(cmd, env={**env(), **(variables or {})}, cwd=cwd, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while not ready() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.005)
    assert proc.poll() is None, "the command ended before it could be killed"
    proc.send_signal(signal.SIGKILL)
    proc.wait()


@pytest.mark.slow
def test_an_export_killed_mid_write_leaves_nothing_and_the_next_one_finishes(made, tmp_path):
    """Killed while its weights are written (each write is held for a minute): no --out, and the next export
    removes the killed one's staging folder."""
    out = tmp_path / "export"
    args = ["export", "--heads", str(made["heads"]), "--target", str(made["target"]), "--format", "vllm", "--out",
            str(out)]
    slow_writes = ("import sys, time, safetensors.torch as s; from gorgon.heads.cli import main; write = s.save_file; "
                   "s.save_file = lambda *a, **k: (write(*a, **k), time.sleep(60)); sys.exit(main(sys.argv[1:]))")
    killed_when([sys.executable, "-c", slow_writes, *args],
                lambda: list(tmp_path.glob(".export.exporting-*/.model.safetensors.*")), tmp_path)
    assert [p.name.split("-")[0] for p in tmp_path.iterdir()] == [".export.exporting"]
    run = subprocess.run([sys.executable, "-m", "gorgon.heads.cli", *args], env=env(), capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert [p.name for p in tmp_path.iterdir()] == ["export"]


@pytest.mark.slow
def test_a_bench_killed_after_a_question_goes_on_from_it(made, tmp_path):
    out = tmp_path / "bench.json"
    cmd = [sys.executable, "-m", "gorgon.heads.cli", *bench(made, out, "--limit", "2")]

    def one_question_done():
        try:
            return len(json.loads(out.read_text())["questions"]) == 1
        except (OSError, ValueError):
            return False

    killed_when(cmd, one_question_done, tmp_path)
    run = subprocess.run(cmd, env=env(), capture_output=True, text=True)
    assert run.returncode == 0 and "going on from the 1 questions" in run.stderr, run.stderr
    report = json.loads(out.read_text())
    assert report["complete"] and len(report["questions"]) == 2


@pytest.mark.slow
def test_a_push_killed_before_its_commit_changes_nothing_and_the_next_one_uploads(made, tmp_path, hub,  # noqa: F811
                                                                                   monkeypatch):
    """The local Hub holds the commit until the push is killed: the repo and the folder are as they were."""
    heads = copy_of(made["heads"], tmp_path)
    before = checksums(tmp_path)
    committing, killed, commit = threading.Event(), threading.Event(), FakeHub.do_POST

    def held_commit(handler):
        if "/commit/" not in handler.path:
            return commit(handler)
        committing.set()
        killed.wait(60)  # then no answer: the client is gone

    monkeypatch.setattr(FakeHub, "do_POST", held_commit)
    cmd = [sys.executable, "-m", "gorgon.heads.cli", "push", "--heads", str(heads), "--repo-id", "someone/tiny-heads"]
    hub_env = {"HF_ENDPOINT": hub, "HF_TOKEN": "hf_test", "HF_HUB_OFFLINE": "0", "HF_HUB_DISABLE_TELEMETRY": "1"}
    killed_when(cmd, committing.is_set, tmp_path, hub_env)
    killed.set()
    assert FakeHub.files == {} and checksums(tmp_path) == before
    monkeypatch.undo()
    run = push(hub, heads)
    assert run.returncode == 0, run.stderr
    assert FakeHub.files["model.safetensors"] == (heads / "model.safetensors").read_bytes()


@pytest.mark.slow
def test_an_empty_recipe_under_the_launcher_is_one_line_and_the_launcher_exits_1(tmp_path):
    """As the README says: the script refuses in one line; `accelerate launch -q` exits 1 whenever its script fails,
    whatever status the script gave (2 here, as `python train/heads.py` shows)."""
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("# emptied\n")
    script = [str(ROOT / "train" / "heads.py"), "--config", str(recipe)]
    launched = subprocess.run(LAUNCH + ["-q", "--config_file", str(ROOT / "configs/accelerate/cpu.yaml"), *script],
                              env=env(), capture_output=True, text=True, cwd=tmp_path)
    alone = subprocess.run([sys.executable, *script], env=env(), capture_output=True, text=True, cwd=tmp_path)
    line = f"train/heads.py: error: config {recipe} is empty: "
    assert launched.returncode == 1 and launched.stderr.startswith(line) and launched.stderr.count("\n") == 1
    assert alone.returncode == 2 and alone.stderr == launched.stderr
