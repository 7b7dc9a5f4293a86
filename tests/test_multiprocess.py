"""Training on several processes: CPU processes over gloo stand in for GPUs.

Two processes at batch B must train as one process at batch 2B (the same global batch), every
conversation must go to exactly one process once per epoch, outputs and logs come once from the
main process, and a 2-process run killed mid-training resumes to the uninterrupted result.
"""

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from accelerate.data_loader import BatchSamplerShard
from helpers import (
    LAUNCH,
    MULTI_CPU,
    ROOT,
    env,
    kill_after_a_checkpoint,
    resume_equals_a_whole_run,
    tiny_chat_target,
    toy_data,
    weights,
)

import gorgon.train.recipe as recipe
from gorgon.heads import GorgonError
from gorgon.train.examples import EpochSampler, RankBatches
from gorgon.train.heads import HeadsTrainConfig


@pytest.mark.parametrize("n,batch,world", [(46, 4, 2), (47, 4, 2), (41, 4, 2), (9, 4, 2), (2, 4, 2), (50, 3, 3),
                                           (7, 2, 1)])
def test_every_example_goes_to_one_process_once_per_epoch(n, batch, world):
    """Through accelerate's own sharding, as `prepare` applies it: counted, no duplicates, no gaps."""
    sampler = EpochSampler(n, seed=3)
    shards = [list(BatchSamplerShard(RankBatches(sampler, batch, world), world, rank)) for rank in range(world)]
    seen = [i for shard in shards for b in shard for i in b]
    assert sorted(seen) == list(range(n)), "each example exactly once"
    assert len({len(shard) for shard in shards}) == 1 and all(b for shard in shards for b in shard), \
        "every process gets the same number of non-empty batches (else DDP would wait forever)"
    # Step s of `world` processes trains on the examples step s of one process with a `world` times larger batch.
    one = list(BatchSamplerShard(RankBatches(sampler, batch * world, 1), 1, 0))
    if n % (batch * world) == 0 or n % (batch * world) >= world:
        assert [sorted(sum((shard[s] for shard in shards), [])) for s in range(len(one))] == [sorted(b) for b in one]
    sampler.set_epoch(1)
    assert sorted(i for b in RankBatches(sampler, batch, world) for i in b) == list(range(n))


def test_more_processes_than_examples_is_refused():
    with pytest.raises(GorgonError, match=r"^too few training conversations for 2 processes \(there are 1\): add "
                                          r"data, or launch fewer processes \(--num_processes\)$"):
        RankBatches(EpochSampler(1, 0), 4, 2, "training conversations")


def launch(script: str, args: list[str], processes: int, tmp_path, name: str) -> subprocess.CompletedProcess:
    """`accelerate launch` with the multi-CPU config (or the one-CPU config), wandb offline in its own folder."""
    config = ["--config_file", MULTI_CPU, "--num_processes", str(processes)] if processes > 1 else \
        ["--config_file", str(ROOT / "configs/accelerate/cpu.yaml")]
    run = subprocess.run(LAUNCH + config + [str(ROOT / script)] + args + ["--out", str(tmp_path / name)],
                         env={**env(), "WANDB_DIR": str(tmp_path / f"wandb-{name}")}, capture_output=True, text=True,
                         timeout=600, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-10000:]
    return run


def written_once(run: subprocess.CompletedProcess, tmp_path, name: str, saved: str) -> None:
    """One main process wrote the outputs and logged: one 'saved' line, one wandb run."""
    assert (run.stdout + run.stderr).count(saved) == 1
    assert len(list((tmp_path / f"wandb-{name}" / "wandb").glob("offline-run-*"))) == 1


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["medusa1", "medusa2"])
def test_two_processes_train_heads_as_one_with_the_same_global_batch(tmp_path, mode):
    target = tiny_chat_target(tmp_path)
    data = toy_data(tmp_path / "toy.jsonl", n=46)  # 44 to train: 5 global batches of 8 and one of 4
    common = ["--data", data, "--target", str(target), "--mode", mode, "--max-steps", "6", "--log-every", "2",
              "--learning-rate", "1e-2", "--warmup-steps", "2", "--save-every", "0", "--lora-r", "4",
              "--heads-warmup-steps", "2"]
    launch("train/heads.py", common + ["--batch-size", "8"], 1, tmp_path, "one")
    two = launch("train/heads.py", common + ["--batch-size", "4"], 2, tmp_path, "two")
    written_once(two, tmp_path, "two", "gorgon train: saved heads")
    assert "6 steps on 2 processes on cpu" in two.stdout + two.stderr
    m1, m2 = (json.loads((tmp_path / name / "metrics.json").read_text()) for name in ("one", "two"))
    assert m2["processes"] == 2 and m1["conversations_trained"] == m2["conversations_trained"] == 44
    assert m1["conversations_evaluated"] == m2["conversations_evaluated"] == 2
    # The toy answers all have the same length, so the mean of two half-batch losses is the
    # full batch's loss; what remains is float rounding (stated tolerance 1e-5).
    for (s1, l1), (s2, l2) in zip(m1["loss_curve"], m2["loss_curve"], strict=True):
        assert s1 == s2 and l1 == pytest.approx(l2, rel=1e-5)
    assert m1["top1"] == m2["top1"] and m1["eval_loss"] == pytest.approx(m2["eval_loss"], rel=1e-5)
    a, b = weights(tmp_path / "one"), weights(tmp_path / "two")
    assert a.keys() == b.keys() and all(torch.allclose(a[k], b[k], atol=1e-5) for k in a)
    if mode == "medusa2":
        from safetensors.torch import load_file

        a1, a2 = (load_file(tmp_path / name / "adapter" / "adapter_model.safetensors") for name in ("one", "two"))
        assert a1.keys() == a2.keys() and any(v.abs().max() > 0 for k, v in a2.items() if "lora_B" in k)
        assert all(torch.allclose(a1[k], a2[k], atol=1e-5) for k in a1)


@pytest.mark.slow
def test_two_processes_distil_a_draft_as_one_with_the_same_global_batch(tmp_path):
    target = tiny_chat_target(tmp_path)
    data = toy_data(tmp_path / "toy.jsonl", n=40)
    common = ["--data", data, "--target", str(target), "--student-layers", "1", "--max-steps", "4",
              "--learning-rate", "1e-3", "--warmup-steps", "1", "--save-every", "0", "--eval-fraction", "0.1"]
    launch("train/draft.py", common + ["--batch-size", "8"], 1, tmp_path, "one")
    two = launch("train/draft.py", common + ["--batch-size", "4"], 2, tmp_path, "two")
    written_once(two, tmp_path, "two", "gorgon draft: saved to")
    m1, m2 = (json.loads((tmp_path / name / "metrics.json").read_text()) for name in ("one", "two"))
    assert m2["processes"] == 2 and m2["eval_tokens"] == m1["eval_tokens"]
    assert m1["before"]["kl"] == pytest.approx(m2["before"]["kl"], rel=1e-5)
    assert m1["after"]["kl"] == pytest.approx(m2["after"]["kl"], rel=1e-4) and m2["after"]["kl"] < m2["before"]["kl"]
    a, b = weights(tmp_path / "one"), weights(tmp_path / "two")
    assert a.keys() == b.keys() and all(torch.allclose(a[k], b[k], atol=1e-5) for k in a)


@pytest.mark.slow
def test_two_processes_killed_and_resumed_equal_an_uninterrupted_run(tmp_path):
    target = tiny_chat_target(tmp_path)
    data = toy_data(tmp_path / "toy.jsonl", n=64)
    common = LAUNCH + ["--config_file", MULTI_CPU, str(ROOT / "train/heads.py"), "--data", data, "--target",
                       str(target), "--max-steps", "40", "--batch-size", "2", "--save-every", "5", "--report-to",
                       "none", "--keep-checkpoints", "2"]
    killed = tmp_path / "killed"
    kill_after_a_checkpoint(common + ["--out", str(killed)], killed / "checkpoints", "step-*", tmp_path)
    resume_equals_a_whole_run(common, killed, tmp_path / "whole", "resumed from", refused=1)
    metrics = json.loads((killed / "metrics.json").read_text())
    # 61 to train in global batches of 4: 15 steps an epoch (the odd one joins the last batch), so
    # 40 steps are two whole epochs and 10 batches of the third, counted across the kill.
    assert metrics["processes"] == 2 and metrics["conversations_trained"] == 2 * 61 + 10 * 4


@pytest.mark.slow
def test_two_processes_killed_and_resumed_distil_the_same_draft(tmp_path):
    target = tiny_chat_target(tmp_path)
    data = toy_data(tmp_path / "toy.jsonl", n=64)
    common = LAUNCH + ["--config_file", MULTI_CPU, str(ROOT / "train/draft.py"), "--data", data, "--target",
                       str(target), "--student-layers", "1", "--max-steps", "24", "--batch-size", "2",
                       "--save-every", "3", "--report-to", "none", "--learning-rate", "1e-2"]
    killed = tmp_path / "killed"
    # 61 conversations to train, 15 steps an epoch: killed in the second epoch, whose order the
    # resumed processes must shuffle again as the uninterrupted run did.
    kill_after_a_checkpoint(common + ["--out", str(killed)], killed / "checkpoints",
                            "checkpoint-18/trainer_state.json", tmp_path)
    resume_equals_a_whole_run(common, killed, tmp_path / "whole", "resuming from", refused=1)


@pytest.mark.parametrize("fails", [False, True])
def test_a_launched_process_ends_without_teardown_only_after_success(tmp_path, monkeypatch, fails):
    """A process of a multi-process launch that finished its run closes its process group and exits at once
    (the interpreter's teardown can abort after gloo); one that failed raises as any run does."""
    exits = []

    def train(cfg):
        assert dist.is_initialized()
        if fails:
            raise GorgonError("bad data")

    def exit_(code):
        exits.append(code)
        raise SystemExit(code)  # os._exit would end pytest itself

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(recipe.os, "_exit", exit_)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(GorgonError if fails else SystemExit):
            recipe.recipe_main(HeadsTrainConfig, train, "", ["--data", "x", "--out", str(tmp_path / "run")])
        assert exits == ([] if fails else [0]) and dist.is_initialized() == fails
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.mark.slow
def test_a_missing_accelerate_config_is_named(tmp_path):
    """accelerate's launcher reports it (after its own traceback): the last line names the file."""
    run = subprocess.run(LAUNCH + ["--config_file", str(tmp_path / "missing.yaml"), str(ROOT / "train/heads.py")],
                         env=env(), capture_output=True, text=True, timeout=120)
    assert run.returncode != 0
    assert run.stderr.strip().splitlines()[-1].startswith(
        f"FileNotFoundError: The passed configuration file `{tmp_path / 'missing.yaml'}` does not exist.")


@pytest.mark.slow
def test_more_processes_than_conversations_is_a_one_line_error_under_accelerate(tmp_path):
    target = tiny_chat_target(tmp_path)
    data = toy_data(tmp_path / "toy.jsonl", n=2)  # one to train, one held out
    run = subprocess.run(LAUNCH + ["--config_file", MULTI_CPU, str(ROOT / "train/heads.py"), "--data", data,
                                   "--target", str(target), "--out", str(tmp_path / "o"), "--report-to", "none"],
                         env=env(), capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert run.returncode != 0
    line = ("train/heads.py: error: too few training conversations for 2 processes (there are 1): add data, or "
            "launch fewer processes (--num_processes)")
    assert line in run.stderr.splitlines()
    assert run.stderr.count(f"traceback : {line}") == 2, run.stderr[-3000:]  # torch's report names it as the cause
    assert not (tmp_path / "o").exists()


@pytest.mark.slow
def test_fsdp_on_cpu_processes_is_refused(tmp_path):
    """accelerate enables FSDP on GPUs only: on CPU processes it would silently be DDP."""
    run = subprocess.run(LAUNCH + ["--config_file", str(ROOT / "configs/accelerate/fsdp.yaml"), "--num_processes",
                                   "2", "--mixed_precision", "no", "--main_process_port", "0",
                                   str(ROOT / "train/heads.py"), "--data", "x", "--out", str(tmp_path / "o"),
                                   "--report-to", "none"], env=env(), capture_output=True, text=True, timeout=300)
    assert run.returncode != 0
    assert ("train/heads.py: error: FSDP needs GPUs: accelerate runs CPU processes as plain DDP; launch with "
            "configs/accelerate/multi_cpu.yaml on CPUs") in run.stderr.splitlines()


@pytest.mark.slow
def test_an_out_refused_on_the_main_process_is_every_process_one_line(tmp_path):
    """The main process checks --out alone while the others wait: when it refused the folder, the others stopped
    with gloo's "Connection closed by peer" traceback; now each ends with the main process's line, which torch's
    report names as each one's cause. The first to fail prints it (the second too, where both end at once)."""
    target = tiny_chat_target(tmp_path)
    out = tmp_path / "theirs"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    run = subprocess.run(LAUNCH + ["-q", "--config_file", MULTI_CPU, str(ROOT / "train/heads.py"), "--data",
                                   toy_data(tmp_path / "toy.jsonl", n=8), "--target", str(target), "--out", str(out),
                                   "--report-to", "none"], env=env(), capture_output=True, text=True, timeout=300)
    assert run.returncode != 0 and (out / "notes.txt").read_text() == "mine"
    line = (f"train/heads.py: error: --out {out} already holds files this command did not write: choose a new or "
            "empty folder")
    assert run.stderr.splitlines().count(line) in (1, 2) and "[rank1]" not in run.stderr, run.stderr[-3000:]
    assert run.stderr.count(f"traceback : {line}") == 2, run.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl's parent-death signal is Linux's")
def test_a_launched_training_process_ends_with_its_launcher(tmp_path):
    """`kill` of `accelerate launch` left the training process running on its own (it held --out and wrote it
    without a word); a process whose parent is not a launcher is left alone (nohup outlives its shell), even where
    the shell exports accelerate's variables."""
    import signal
    import time

    child = ("import time; from gorgon.train.recipe import end_with_the_launcher; end_with_the_launcher(); "
             "print('ready', flush=True); time.sleep(60)")
    launcher = tmp_path / "accelerate"  # what the parent runs names it: accelerate launch's process, or a shell
    launcher.write_text("import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', sys.argv[1]]); "
                        "print(p.pid, flush=True); time.sleep(60)")
    shell = tmp_path / "shell"
    shell.write_text(launcher.read_text())
    launched = {"ACCELERATE_USE_CPU": "True"}
    flags = ["-u", "-X", "utf8"]  # the launcher named after the interpreter's own flags (deepspeed's: -u -m M)
    cases = [([], launcher, launched, False), (flags, launcher, launched, False), ([], shell, launched, True),
             ([], shell, {}, True)]
    for options, parent_command, variables, survives in cases:
        environment = {k: v for k, v in os.environ.items() if not k.startswith("ACCELERATE_") and k != "LOCAL_RANK"}
        parent = subprocess.Popen([sys.executable, *options, str(parent_command), child],
                                  env={**environment, **variables}, stdout=subprocess.PIPE, text=True)
        pid = int(parent.stdout.readline())
        assert parent.stdout.readline().strip() == "ready"  # the child's line, through the shared stdout
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        deadline = time.time() + (1 if survives else 10)  # a survivor is given a second to die anyway
        while time.time() < deadline and os.path.exists(f"/proc/{pid}") and "Z" not in state_of(pid):
            time.sleep(0.05)
        alive = os.path.exists(f"/proc/{pid}") and "Z" not in state_of(pid)
        assert alive == survives
        if alive:
            os.kill(pid, signal.SIGKILL)


def state_of(pid: int) -> str:
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


def test_torchs_launcher_reports_the_error_line_as_the_failures_cause(tmp_path, monkeypatch, capsys):
    """Under `accelerate launch` with several processes, torch's launcher ends with a report of the failed
    processes whose cause read "To enable traceback see: https://pytorch.org/docs/...": the error file it names
    each process now holds the line, which its own reader takes as the cause. N processes that fail alike print
    the line once before the report, not N times."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    from gorgon.heads.command import exit_status

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
