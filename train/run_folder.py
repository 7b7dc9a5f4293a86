"""A training run's --out folder: whose it is (the run marker), who writes it now (the lock), its
checkpoints and what resuming from one must find unchanged, and what a run leaves when it fails.

Both training scripts write their folder by these rules, so a rerun resumes, an --overwrite replaces
only gorgon's own output, and a second run into the same folder is refused.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
import hashlib
import json
import os
import shutil
import sys
from pathlib import Path

from gorgon.heads.errors import GorgonError, user_error_line
from gorgon.heads.files import atomic_write_text
from gorgon.heads.methods import method_of, methods
from gorgon.heads.outputs import (
    changed_settings,
    check_output,
    check_unlocked,
    drop_lock,
    holds_lock,
    is_plot,
    missing_folders,
    remove_empty_folders,
    take_lock,
)


def numbered_checkpoints(folder: Path, prefix: str) -> list[Path]:
    """The checkpoints `folder/PREFIX-STEP`, newest (highest step) first: step-10 after step-9."""
    numbered = [p for p in folder.glob(f"{prefix}-*") if p.name[len(prefix) + 1:].isdigit()]
    return sorted(numbered, key=lambda p: int(p.name[len(prefix) + 1:]), reverse=True)


def latest_checkpoint(folder: Path, prefix: str, written_last: str) -> Path | None:
    """The newest complete checkpoint `folder/PREFIX-STEP`: one whose `written_last` file reads as JSON.
    One without was cut short by a kill; it is removed, so the run resumes from the one before."""
    for ckpt in numbered_checkpoints(folder, prefix):
        try:
            json.loads((ckpt / written_last).read_text())
            return ckpt
        except (OSError, ValueError):
            shutil.rmtree(ckpt)
    return None


def resume_point(latest: Path | None, resume: bool, out: Path) -> Path | None:
    """The checkpoint to continue from: a run's checkpoints are never trained over without --resume,
    and --resume without one is an error rather than a silent fresh start."""
    if latest is not None and not resume and (out / "recipe.json").is_file():
        raise GorgonError(f"{out} holds a finished run: pass --overwrite true to train it again, --resume true with "
                          "more epochs or max_steps to train it longer, or choose another --out")
    if latest is not None and not resume:
        raise GorgonError(f"{out} already has checkpoints: pass --resume true to continue, --overwrite true to start "
                          "over, or choose another --out")
    if resume and latest is None and (out / "recipe.json").is_file():
        raise GorgonError(f"--resume: {out} holds a finished run without a checkpoint to continue from (the run was "
                          "shorter than save_every): pass --overwrite true to train it again, for longer")
    if resume and latest is None and out.is_dir() and any(out.iterdir()) and not (out / RUN_MARKER).is_file():
        raise GorgonError(f"--resume: {out} is not a gorgon training run's folder (it holds files this command did "
                          "not write): pass the --out of the run to continue, or start in a new or empty folder")
    if resume and latest is None:
        raise GorgonError(f"--resume: no complete checkpoint in {out / 'checkpoints'}: run without --resume to start")
    return latest


STATE_NAME = "gorgon_state.json"  # gorgon's own record in a checkpoint: its settings (heads: the progress too)
# The settings a resume may change: how long it trains, its logging and checkpoints, where it reports and
# uploads, and what only the end (the trees, the held-out ranks) or only speed and memory depend on. Every
# other one is recorded in each checkpoint and must stay: the data order (data, split, shuffle, batches),
# the shape of what the checkpoint holds, and the objective and optimiser (the optimizer and its schedule
# come back from the checkpoint, so a new learning rate would be ignored, and a new loss would train the
# rest of the run on another objective while recipe.json recorded it for the whole).
MAY_CHANGE = ("out", "epochs", "max_steps", "log_every", "save_every", "keep_checkpoints", "eval_every", "resume",
              "overwrite", "report_to", "project", "push_to_hub", "cache_features", "tree_topk", "cpu_tree_size",
              "gpu_tree_size", "draft_depth", "draft_topk")


def data_sha256(examples: list[dict]) -> str:
    """The training examples' contents (token ids and loss masks, as the batches draw them): the data's
    path alone would let a dataset regenerated or edited there resume on other conversations. Hashed one
    example at a time, so 100k conversations take seconds and no second copy in memory."""
    digest = hashlib.sha256()
    for example in examples:
        digest.update(json.dumps(example, sort_keys=True).encode())
    return digest.hexdigest()


def resume_settings(cfg, processes: int, data_hash: str | None = None) -> dict:
    """What a checkpoint records under "settings" in its STATE_NAME, for `check_resume`. `data_hash` (the
    loaded examples' data_sha256) is known only once the data has loaded: the check before then, without
    it, compares the settings alone."""
    settings = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name not in MAY_CHANGE}
    settings["processes"] = processes
    if data_hash is not None:
        settings["data_sha256"] = data_hash
    return settings


def check_resume(checkpoint: Path, current: dict) -> None:
    """A resume must keep the data order recorded in its checkpoint: the checkpoint's step stands for the
    batches that order drew, and another (or other data at the same path) would silently train on some
    conversations twice and others never; and its shape, which would otherwise fail in the state's load
    with a size mismatch; and its objective and optimiser, which would silently mix two runs. MAY_CHANGE's
    settings (more epochs or steps, logging, checkpointing, wandb, the Hub, the trees) may change. A
    checkpoint from before a setting was recorded is not checked for it."""
    path = checkpoint / STATE_NAME
    recorded = json.loads(path.read_text()).get("settings", {}) if path.is_file() else {}
    changed = changed_settings(recorded, current)
    settings = [key for key in changed if key != "data_sha256"]
    if settings:
        raise GorgonError(f"{checkpoint} was trained with other settings ("
                          + ", ".join(f"{key} {recorded[key]} -> {current[key]}" for key in settings)
                          + "): resume with the same ones, or train into a new --out")
    if changed:
        raise GorgonError(f"the training examples differ from those {checkpoint} was trained on (the data at "
                          f"{current['data']}, or the target's tokenizer or chat template, changed): restore them, or "
                          "train into a new --out")


RUN_MARKER = ".gorgon-run"  # written into a training --out when the run starts: this folder is gorgon's
REPLACING = "replacing an earlier run\n"  # the marker's text while a run (--overwrite) replaces finished output
EARLIER = ".earlier-run"  # where the replaced run's files wait while the new run writes its own
LOCK = ".gorgon-run.lock"  # this machine and the main process's id while a run writes the folder
# What every run writes in its --out (checkpoints, the temporary files of atomic writes, the weights, metrics and
# card), beside each drafting method's own `files`: --overwrite replaces a folder holding these only, and gorgon
# bench reports with their plots (and the lock a killed bench left beside its report).
RUN_FILES = (RUN_MARKER, EARLIER, LOCK, "checkpoints", ".*.tmp", "config.json", "model.safetensors",
             "model-*-of-*.safetensors", "model.safetensors.index.json", "metrics.json", "recipe.json",
             "head_accuracy.png", "README.md", ".*.json.lock")


def in_run_folder(path: Path) -> bool:
    """An entry of a training --out that --overwrite may remove: what a run writes, or a gorgon bench report (and
    its plot) of the earlier heads. A method's `model_files` (a draft model's tokenizer) are its only where the
    folder holds that method's output, whose config.json its save writes first (elsewhere they are the user's)."""
    from gorgon.decode.bench import is_report

    names = (*RUN_FILES, *(f.rstrip("/") for m in methods() for f in m.files))
    if any(fnmatch.fnmatch(path.name, name) for m in methods() for name in m.model_files):
        holder = method_of(path.parent)
        return holder is not None and path.name in holder.model_files
    return (any(fnmatch.fnmatch(path.name, name) for name in names) or is_report(path)
            or (path.suffix == ".png" and is_report(path.with_suffix(".json")) and is_plot(path)))


def prepare_output(out: Path, latest_checkpoint, cfg) -> Path | None:
    """Check a training script's --out (and that its push_to_hub upload can happen) before any work; returns the
    checkpoint to resume from.

    A run's own folder (its marker or recipe.json in it) is continued with --resume, or replaced
    whole with --overwrite, so no stale file (an old bench report) stays beside new weights: finished
    output only once the new run writes its own (`set_aside_earlier_run`); an unfinished run with no
    complete checkpoint starts over. A file, an unwritable place or a
    non-empty folder of other files is refused. The main process alone checks and changes the
    folder, then tells the others the checkpoint or its refusal, which each process raises: while
    they waited, a refusal on the main process alone ended them with gloo's traceback."""
    from accelerate import PartialState
    from accelerate.utils import broadcast_object_list, parse_flag_from_env

    # The process state is made here, before the Accelerator: it must connect CPU processes as
    # the Accelerator would (connect_cpu_processes sets the flag; only AcceleratorState reads it).
    state = PartialState(cpu=parse_flag_from_env("ACCELERATE_USE_CPU"))
    latest = refused = None
    if state.is_main_process:
        try:
            latest = prepare_own_output(out, latest_checkpoint, cfg)
        except Exception as err:
            refused = user_error_line(err)
            if refused is None:
                raise
    if state.num_processes > 1:
        latest, refused = broadcast_object_list([latest, refused])
    if refused is not None:
        raise GorgonError(refused)
    return latest


def prepare_own_output(out: Path, latest_checkpoint, cfg) -> Path | None:
    """prepare_output's work, on the main process."""
    if os.path.realpath(out) == os.path.realpath(cfg.data):
        raise GorgonError(f"--out {out} is the --data path: choose another --out")
    if cfg.push_to_hub:  # the upload at the end must be possible before the work
        from gorgon.heads.hub import check_can_upload

        check_can_upload("push_to_hub")
    resume, overwrite = cfg.resume, cfg.overwrite
    finished = (out / "recipe.json").is_file()
    if finished and (resume or overwrite):
        from gorgon.heads.card import check_card_unedited

        check_card_unedited(out, "this run would write its own card over it: keep your changes elsewhere and move "
                                 "it away first")
    if finished and resume:
        check_same_method(out, cfg.method)
    ours = finished or (out / RUN_MARKER).is_file()
    check_unlocked(out / LOCK, "training run")  # a run started by hand, or off Linux, may outlive its launcher
    latest, marker = None, ""
    if resume or not overwrite:  # checkpoints are looked for (and cut-short ones removed) in our folders only
        latest = resume_point(latest_checkpoint() if ours else None, resume, out)
    may_replace = overwrite or (ours and not finished)  # an unfinished run of ours without a checkpoint starts over
    if latest is None and check_output(out, lambda _: ours, may_replace, own_entry=in_run_folder):
        if finished or replacing(out):
            # Finished output stays, loadable, until this run writes its own (`set_aside_earlier_run`), so a
            # run that fails or is killed first loses nothing: only its checkpoints go now, and recipe.json,
            # which marks the folder finished.
            shutil.rmtree(out / "checkpoints", ignore_errors=True)
            (out / "recipe.json").unlink(missing_ok=True)
            marker = REPLACING
        else:
            shutil.rmtree(out)
            out.mkdir()
    take_lock(out / LOCK)  # first: a folder with our marker is locked (`no_empty_output_left`)
    if latest is None:  # a resumed run's marker stays as it is
        atomic_write_text(out / RUN_MARKER, marker)
    return latest


def check_same_method(out: Path, method) -> None:
    """--resume into a finished run of another drafting method: its checkpoints cannot continue this recipe, and
    --overwrite would replace what it trained, so say which it holds rather than suggest either."""
    holder = method_of(out)
    if holder is not None and holder is not method:
        raise GorgonError(f"--out {out} holds a finished run of {holder.title}, but this recipe trains {method.title}: "
                          f"choose another --out (--overwrite true would replace {holder.title})")


def check_more_to_train(out: Path, cfg, steps: int | None = None) -> None:
    """--resume on a finished run (after its checkpoint's settings were checked) continues it only to train
    longer: `steps`, the run's length when known (else more epochs, or a max_steps past the steps done), must
    pass the steps it finished. Else it would retrain from its last checkpoint and replace the finished
    result with a copy, or with an earlier state."""
    try:
        recorded = json.loads((out / "recipe.json").read_text())
        done = json.loads((out / "metrics.json").read_text())["steps"]
    except (OSError, ValueError, KeyError, TypeError):
        return  # not finished
    if steps is not None:
        longer = steps > done
    elif cfg.max_steps is not None:
        longer = cfg.max_steps > done
    else:
        longer = recorded.get("max_steps") is not None or cfg.epochs > recorded.get("epochs", cfg.epochs)
    if not longer:
        raise GorgonError(f"{out} holds a finished run of {done} steps, and these settings train no longer: there is "
                          "nothing to resume (raise epochs or max_steps to train longer, or pass --overwrite true to "
                          "train it again)")


def replacing(out: Path) -> bool:
    """Whether the run in `out` replaces a finished run's output (--overwrite), which it has not yet written over."""
    try:
        return (out / RUN_MARKER).read_text() == REPLACING
    except OSError:
        return False


def set_aside_earlier_run(out: Path) -> None:
    """Before a run that replaces finished output writes its own (main process): the earlier files go into
    EARLIER, which `finish_run_folder` removes once the new ones are written; a kill in between leaves one
    whole set of files. If EARLIER is there already, a save was cut short: what it wrote goes, the earlier
    run's files stay aside."""
    if not replacing(out):
        return
    aside = out / EARLIER
    cut_short = aside.is_dir()
    aside.mkdir(exist_ok=True)
    # Listed before any moves: a bench plot is the run's by the report beside it.
    # The lock stays: it is this run's, and without it a second run would be let into the folder.
    entries = [e for e in out.iterdir()
               if e.name not in (RUN_MARKER, EARLIER, LOCK, "checkpoints") and in_run_folder(e)]
    for entry in entries:
        if not cut_short:
            os.replace(entry, aside / entry.name)
        elif entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()


def finish_run_folder(out: Path, recipe: dict) -> None:
    """The last writes of a run's output (main process): the replaced run's files removed, then recipe.json,
    which marks the folder finished (so a folder with it holds everything else a run writes). An empty
    checkpoints/ (trl makes it before its first save) is not left behind."""
    shutil.rmtree(out / EARLIER, ignore_errors=True)
    with contextlib.suppress(OSError):  # not there, or holding checkpoints
        (out / "checkpoints").rmdir()
    atomic_write_text(out / RUN_MARKER, "")
    atomic_write_text(out / "recipe.json", json.dumps(recipe, indent=1) + "\n")
    (out / LOCK).unlink(missing_ok=True)


def kept_checkpoints(out: Path) -> str:
    """The end of a run's last line: the checkpoints it keeps and what they are for (a draft model's are
    hundreds of MB), or nothing when it kept none."""
    files = [p for p in (out / "checkpoints").rglob("*") if p.is_file()]
    if not files:
        return ""
    size = sum(p.stat().st_size for p in files) / 2**20
    return f"; {out / 'checkpoints'} ({size:.0f} MiB) lets --resume true train longer: remove it if that is not needed"


def announce_result(command: str, out: Path, saved: str, push_to_hub: str | None, measure: str) -> None:
    """A finished run's result, on stdout (main process): what it saved and the checkpoints it kept, the upload
    where one was asked for, then the command that measures it next."""
    print(f"{command}: {saved}{kept_checkpoints(out)}")
    if push_to_hub:
        from gorgon.heads.hub import upload_folder

        print(f"{command}: pushed to {upload_folder(out, push_to_hub)}")
    print(f"{command}: next, its speed: {measure}")


@contextlib.contextmanager
def lock_released_on_failure(out: Path, latest_checkpoint):
    """A run that fails or is refused after taking the folder's LOCK gives it back, so the folder is as it was
    (a killed run cannot: its lock names a process that is gone, which no later run waits for). A run stopped
    with Ctrl-C after taking it says how to go on: from its newest checkpoint (`latest_checkpoint()`, which
    removes a checkpoint cut short), or from the start. One stopped before says nothing of the folder: it may
    be another run's, still writing its checkpoints. (Not `outputs.holding`, which takes its lock on entry: the
    main process alone takes this one, midway through `prepare_output`, once the folder is checked.)"""
    try:
        yield
    except BaseException as err:
        held = holds_lock(out / LOCK)
        drop_lock(out / LOCK)
        if isinstance(err, KeyboardInterrupt) and held:  # the main process holds it: said once in a launch
            kept = latest_checkpoint() if (out / RUN_MARKER).is_file() else None
            print(f"\ngorgon: {kept} is kept: rerun the command with --resume true to continue from it" if kept else
                  "\ngorgon: no checkpoint was saved yet (save_every sets how often): a rerun starts over",
                  file=sys.stderr)
        raise


@contextlib.contextmanager
def no_empty_output_left(out: Path):
    """A run that fails before writing anything (bad data, too many processes) removes the --out folder it
    made, so a failed command leaves nothing behind. A folder that existed before, holds more than the run
    marker, or is locked (a failed run gives its own lock back first: the lock is another run's, which made
    the folder meanwhile and writes it now) is left as it is. The empty parent folders it made for --out go
    too."""
    made = missing_folders(out)
    try:
        yield
    except BaseException:
        with contextlib.suppress(OSError):
            if made and out.is_dir() and {p.name for p in out.iterdir()} <= {RUN_MARKER}:
                shutil.rmtree(out)
        remove_empty_folders(made[1:])
        raise

