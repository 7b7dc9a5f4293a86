"""The command line: one line per error (no traceback, no usage), Ctrl-C, mistyped commands and options,
and the scripts' errors alike."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import ROOT, env, saved_heads, tiny_chat_target
from transformers import AutoModelForCausalLM

import gorgon.train.recipe as recipe
from gorgon.decode.questions import load_questions
from gorgon.heads import GorgonError, MedusaHeads
from gorgon.heads.cli import main as gorgon
from gorgon.heads.command import run_script
from gorgon.heads.outputs import check_output
from gorgon.train.heads import HeadsTrainConfig
from gorgon.train.records import load_conversations, read_records


def test_a_home_folder_path_in_an_option_is_expanded(tmp_path, monkeypatch):
    """`--out=~/x` (which the shell leaves as it is) made a folder named ~ here; the training scripts expand it."""
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    heads = tmp_path / "heads"
    MedusaHeads.for_target(AutoModelForCausalLM.from_pretrained(tiny_chat_target(tmp_path))).save_pretrained(heads)
    assert gorgon(["export", "--heads=~/heads", "--target=~/tiny-llama-0", "--format", "vllm", "--out=~/x"]) == 0
    assert (tmp_path / "x" / "config.json").is_file() and not (tmp_path / "~").exists()


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


@pytest.mark.slow
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

    from gorgon.heads.command import exit_status

    monkeypatch.setattr(warnings, "formatwarning", warnings.formatwarning)  # restored after the test
    assert exit_status(lambda: 0, "gorgon generate") == 0
    assert warnings.formatwarning("gorgon: fast kernels are off", UserWarning, "x.py", 3) == \
        "gorgon generate: warning: fast kernels are off\n"
    assert warnings.formatwarning("another library's", UserWarning, "x.py", 3).startswith("x.py:3: UserWarning:")


@pytest.mark.slow
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
