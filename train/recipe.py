"""Training recipes: a dataclass of settings, filled from a YAML file, then `--key value` overrides,
and what both training scripts share: their command line, the resume rule, the logging mode.

An unknown key, in the YAML or on the command line, is an error naming the close matches:
a misspelt `learning_rate` must not silently train with the default.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
import hashlib
import json
import math
import os
import shutil
import sys
import textwrap
import types
import typing
from pathlib import Path

import yaml

from gorgon.heads.draft_model.model import DRAFT_VOCAB_NAME
from gorgon.heads.errors import GorgonError, check_keys, user_error_line
from gorgon.heads.hub import offline_if_hub_unreachable
from gorgon.heads.medusa.model import ADAPTER_DIR, TREES_NAME


def setting(default=dataclasses.MISSING, help: str = "", *, factory=dataclasses.MISSING):
    """A recipe key: its default (none: required) and the text `--help` prints beside it, as TRL's
    `field(metadata={"help": ...})`."""
    return dataclasses.field(default=default, default_factory=factory, metadata={"help": help})


@dataclasses.dataclass
class TrainingSettings:
    """The keys every training recipe shares (data, output, optimisation, checkpoints, logging); each
    script's config adds its method's own after them."""

    data: str = setting(help="`gorgon data` output folder, or a .jsonl/.json file of conversations")
    out: str = setting(help="output folder: the trained drafter, its metrics and model card")
    target: str | None = setting(None, "hub id or path of the target; None: the embedded SmolLM2-135M-Instruct")
    max_length: int = setting(1024, "most tokens per training conversation: longer ones are cut, and one whose "
                                    "answers start past it is left out (the run says how many)")
    batch_size: int = setting(4, "conversations per step and process")
    grad_accum: int = setting(1, "steps whose gradients are summed per optimizer step")
    learning_rate: float = setting(1e-3, "peak learning rate (linear warmup, then cosine decay)")
    weight_decay: float = setting(0.0, "AdamW weight decay")
    warmup_steps: int = setting(20, "optimizer steps of linear warmup")
    epochs: float = setting(1.0, "passes over the training data (a fraction trains on part of it)")
    max_steps: int | None = setting(None, "optimizer steps; overrides epochs (0 saves the drafter untrained)")
    max_grad_norm: float = setting(1.0, "gradient clipping norm")
    eval_fraction: float = setting(0.05, "share of conversations held out to measure the drafts")
    log_every: int = setting(10, "log the loss every N steps")
    save_every: int = setting(100, "checkpoint every N steps (0: never)")
    keep_checkpoints: int = setting(2, "newest checkpoints kept")
    resume: bool = setting(False, "continue from the newest checkpoint in --out")
    overwrite: bool = setting(False, "replace an earlier run's output folder, checkpoints included (its finished "
                                     "heads or draft stay until this run writes its own)")
    seed: int = setting(0, "seed of the held-out split, the shuffling and any initialisation")
    dtype: str = setting("auto", "the target's dtype: auto (bfloat16 on CUDA, float32 on a CPU), float32, "
                                 "bfloat16, float16")
    report_to: str = setting("wandb", "wandb (offline without an API key) | none")
    project: str = setting("gorgon", "the wandb project")
    push_to_hub: str | None = setting(None, "a Hub repo id (user/name) to upload the result to at the end")


def _needs_value(key: str) -> GorgonError:
    return GorgonError(f"{key} needs a value: give it one (--{key.replace('_', '-')} VALUE, or {key}: VALUE in the "
                       "YAML), or leave the key out for its default")


def _convert(value, annotation, key: str):
    """Parse a command-line string (or check a YAML value) against a field's type."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):  # Optional[X]
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null")):
            return None
        annotation = next(a for a in args if a is not type(None))
        origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    name = getattr(annotation, "__name__", annotation)
    if value is None:
        raise _needs_value(key)
    if isinstance(value, bool) and annotation is not bool:  # YAML's true or yes: int(True) would be 1
        raise GorgonError(f"{key} must be {name}, got {value!r}")
    if origin is list:
        items = value if isinstance(value, list) else [v for v in str(value).split(",") if v]
        return [_convert(v, args[0], key) for v in items]
    try:
        if annotation is bool:
            if isinstance(value, bool):
                return value
            if str(value).lower() in ("true", "1", "yes"):
                return True
            if str(value).lower() in ("false", "0", "no"):
                return False
            raise ValueError(value)
        if annotation is int and isinstance(value, float) and not value.is_integer():
            raise ValueError(value)
        if annotation is str:
            return os.path.expanduser(str(value))  # a YAML path: the shell expands ~ on the command line only
        return annotation(value)
    except (TypeError, ValueError) as err:
        raise GorgonError(f"{key} must be {name}, got {value!r}") from err


def check_optimisation(cfg) -> None:
    """The settings both training scripts share, each in range: a negative learning rate, no held-out
    data or a malformed Hub repo id would otherwise train (or stop later, even after training, with a
    misleading error) instead of failing here."""
    for field in dataclasses.fields(cfg):  # inf passes the ranges below (and nan some), then fails in training
        value = getattr(cfg, field.name)
        if isinstance(value, float) and not math.isfinite(value):
            raise GorgonError(f"{field.name} must be a finite number, not {value}")
    for key in ("learning_rate", "backbone_learning_rate", "max_grad_norm"):  # the second: Medusa-2's adapters
        if hasattr(cfg, key) and not getattr(cfg, key) > 0:
            raise GorgonError(f"{key} must be above 0, not {getattr(cfg, key)}")
    for key in ("warmup_steps", "weight_decay"):  # a negative weight decay stops AdamW after the model loads
        if getattr(cfg, key) < 0:
            raise GorgonError(f"{key} must be at least 0, not {getattr(cfg, key)}")
    if not cfg.epochs > 0:
        raise GorgonError(f"epochs must be above 0 (a fraction trains on part of the data), not {cfg.epochs}")
    if not 0 < cfg.eval_fraction < 1:
        raise GorgonError(f"eval_fraction is the share of conversations held out to measure the drafts: use a "
                          f"number between 0 and 1 (default 0.05), not {cfg.eval_fraction}")
    for key, least in (("log_every", 1), ("save_every", 0), ("keep_checkpoints", 1)):
        if not getattr(cfg, key) >= least:
            raise GorgonError(f"{key} must be at least {least}, not {getattr(cfg, key)}")
    if cfg.max_length < 2:
        raise GorgonError(f"max_length is the most tokens per training conversation: use 2 or more (default 1024), "
                          f"not {cfg.max_length}")
    if cfg.push_to_hub is not None:
        from gorgon.heads.hub import check_repo_id

        check_repo_id(cfg.push_to_hub, "push_to_hub")


def check_lora(cfg) -> None:
    """The LoRA settings both scripts share (Medusa-2's adapters on the target, a LoRA draft), before any model
    loads: peft stops on a rank of 0 with a traceback once the model has loaded, and an alpha of 0 would train
    adapters that change nothing."""
    for key in ("lora_r", "lora_alpha"):
        if getattr(cfg, key) < 1:
            raise GorgonError(f"{key} must be at least 1, not {getattr(cfg, key)}")
    if not 0 <= cfg.lora_dropout < 1:
        raise GorgonError(f"lora_dropout is a probability: use 0 or more and below 1, not {cfg.lora_dropout}")
    if not cfg.lora_target_modules:
        raise GorgonError("lora_target_modules needs at least one layer name, e.g. q_proj,v_proj")


def check_draft_vocab_size(size: int | None) -> None:
    """draft_vocab_size, which both scripts take (heads train over it, a draft saves it): unset, or a count."""
    if size is not None and size < 1:
        raise GorgonError(f"draft_vocab_size must be at least 1 (or unset for the whole vocabulary), not {size}")


def check_lora_targets(model, modules: list[str], what: str) -> None:
    """Each of lora_target_modules must name layers of `model` as peft matches them (a module's name, or its
    end after a dot). peft stops with a traceback when none does, and leaves out one that does not when
    others do: fewer adapters than asked, without a word."""
    import torch

    names = [name for name, _ in model.named_modules()]
    for module in modules:
        if not any(name == module or name.endswith(f".{module}") for name in names):
            linear = sorted({name.rsplit(".", 1)[-1] for name, layer in model.named_modules()
                             if isinstance(layer, torch.nn.Linear)})
            raise GorgonError(f"lora_target_modules: {what} has no layer {module!r}; its linear layers are "
                              f"{', '.join(linear)}")


def parse_overrides(argv: list[str]) -> dict[str, str | bool]:
    """`--key value` and `--key=value` pairs (dashes in keys become underscores); `--flag` alone is True."""
    out, i = {}, 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--"):
            raise GorgonError(f"unexpected argument {arg!r}: options are --key value")
        key, eq, value = arg[2:].partition("=")
        if not eq:
            if i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                value, i = argv[i + 1], i + 1
            else:
                value = True
        out[key.replace("-", "_")] = value
        i += 1
    return out


def load_recipe(cls, config_path: str | None, overrides: dict[str, str]):
    """Build `cls` from a YAML file (optional) and command-line overrides, checking every key."""
    if config_path is True or config_path == "":  # --config with no path after it
        raise GorgonError("--config needs the path of a YAML recipe after it (gorgon's are in configs/heads and "
                          "configs/draft)")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    types_ = typing.get_type_hints(cls)
    values: dict = {}
    if config_path:
        path = Path(config_path)
        if not path.is_file():
            raise GorgonError(f"config {config_path} not found: pass the path of a YAML recipe (gorgon's are in "
                              "configs/heads and configs/draft)")
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as err:
            raise GorgonError(f"config {config_path} is not valid YAML ({err.__class__.__name__}): "
                              "fix its syntax") from err
        if not isinstance(data, dict):
            raise GorgonError(f"config {config_path} must be a mapping of key: value")
        check_keys(data, set(fields), f"in {config_path}")
        values.update({key: _convert(value, types_[key], key) for key, value in data.items()})
    check_keys(overrides, set(fields), "on the command line")
    for key, value in overrides.items():  # a bare --key, which parse_overrides reads as True (a YAML true is a value)
        if value is True and types_[key] is not bool:
            raise _needs_value(key)
    values.update({key: _convert(value, types_[key], key) for key, value in overrides.items()})
    missing = [n for n, f in fields.items() if f.default is dataclasses.MISSING
               and f.default_factory is dataclasses.MISSING and n not in values]
    if missing:
        raise GorgonError(f"missing setting {', '.join(missing)}: add it to the YAML or pass --{missing[0]} VALUE")
    return cls(**values)


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
    if resume and latest is None:
        raise GorgonError(f"--resume: no complete checkpoint in {out / 'checkpoints'}: run without --resume to start")
    return latest


def changed_settings(old: dict, new: dict) -> list[str]:
    """The settings that differ from a recorded run's (one recorded before a setting existed had its default)."""
    return sorted(k for k in new if k in old and old[k] != new[k])


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
# What a run writes in its --out (heads, a draft model and its tokenizer, checkpoints, the temporary files of
# atomic writes): --overwrite replaces a folder holding these only, and gorgon bench reports with their plots
# (and the lock a killed bench left beside its report).
RUN_FILES = (RUN_MARKER, EARLIER, LOCK, "checkpoints", ADAPTER_DIR, ".*.tmp", "config.json", "generation_config.json",
             "model.safetensors", "model-*-of-*.safetensors", "model.safetensors.index.json", TREES_NAME,
             DRAFT_VOCAB_NAME, "metrics.json", "recipe.json", "head_accuracy.png", "README.md", "tokenizer.json",
             "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "chat_template.jinja",
             "vocab.json", "merges.txt", "tokenizer.model", ".*.json.lock")


def in_run_folder(path: Path) -> bool:
    """An entry of a training --out that --overwrite may remove: what a run writes, or a gorgon bench report (and
    its plot) of the earlier heads."""
    from gorgon.decode.bench import is_report
    from gorgon.heads.files import is_plot

    return (any(fnmatch.fnmatch(path.name, name) for name in RUN_FILES) or is_report(path)
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
    from gorgon.heads.files import atomic_write_text, check_output, check_unlocked, take_lock

    if os.path.realpath(out) == os.path.realpath(cfg.data):
        raise GorgonError(f"--out {out} is the --data path: choose another --out")
    if cfg.push_to_hub:  # the upload at the end must be possible before the work
        from gorgon.heads.hub import check_can_upload

        check_can_upload("push_to_hub")
    resume, overwrite = cfg.resume, cfg.overwrite
    finished = (out / "recipe.json").is_file()
    ours = finished or (out / RUN_MARKER).is_file()
    check_unlocked(out / LOCK, "training run")  # killing `accelerate launch` alone leaves its workers running
    if resume or not overwrite:  # checkpoints are looked for (and cut-short ones removed) in our folders only
        latest = resume_point(latest_checkpoint() if ours else None, resume, out)
        if latest is not None:
            take_lock(out / LOCK)
            return latest
    if check_output(out, lambda _: ours, overwrite or (ours and not finished), own_entry=in_run_folder):
        if finished or replacing(out):
            # Finished output stays, loadable, until this run writes its own (`set_aside_earlier_run`), so a
            # run that fails or is killed first loses nothing: only its checkpoints go now, and recipe.json,
            # which marks the folder finished.
            shutil.rmtree(out / "checkpoints", ignore_errors=True)
            (out / "recipe.json").unlink(missing_ok=True)
            take_lock(out / LOCK)
            atomic_write_text(out / RUN_MARKER, REPLACING)
            return None
        shutil.rmtree(out)
        out.mkdir()
    take_lock(out / LOCK)  # first: a folder with our marker is locked (`no_empty_output_left`)
    atomic_write_text(out / RUN_MARKER, "")
    return None


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
    which marks the folder finished (so a folder with it holds everything else a run writes)."""
    from gorgon.heads.files import atomic_write_text

    shutil.rmtree(out / EARLIER, ignore_errors=True)
    atomic_write_text(out / RUN_MARKER, "")
    atomic_write_text(out / "recipe.json", json.dumps(recipe, indent=1) + "\n")
    (out / LOCK).unlink(missing_ok=True)


def wandb_offline_without_key(report_to: str) -> None:
    """wandb logs locally unless the user has a key or chose a mode: a run never stops to ask for a login."""
    if report_to == "wandb" and not os.environ.get("WANDB_API_KEY") and not os.environ.get("WANDB_MODE"):
        os.environ["WANDB_MODE"] = "offline"


def several_processes() -> bool:
    """Whether a launcher (accelerate's, torchrun) started this process as one of several."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def connect_cpu_processes() -> None:
    """Several processes and no GPU means CPU processes talking over gloo.

    `accelerate launch --multi_gpu` (or a config with several processes) starts them, but without a
    GPU accelerate leaves each one alone unless ACCELERATE_USE_CPU is set: N unconnected copies
    would each train on all the data and write the same outputs. Call before the Accelerator.
    FSDP and DeepSpeed are refused there: accelerate enables them on GPUs only and would silently
    run plain DDP instead."""
    import torch

    if several_processes() and not torch.cuda.is_available():
        for name in ("FSDP", "DEEPSPEED"):
            if os.environ.get(f"ACCELERATE_USE_{name}", "false").lower() == "true":
                raise GorgonError(f"{'DeepSpeed' if name == 'DEEPSPEED' else name} needs GPUs: accelerate runs CPU "
                                  "processes as plain DDP; launch with configs/accelerate/multi_cpu.yaml on CPUs")
        os.environ["ACCELERATE_USE_CPU"] = "true"


def full_state_dict(accelerator, model) -> dict:
    """The trained weights whole, on the main process: under FSDP and DeepSpeed ZeRO-3 each
    process holds a shard, and unwrapping on the main process alone would save only its shard.
    Every process must call it (it gathers); other processes may get an empty dict."""
    return {k: v.detach().cpu() for k, v in accelerator.get_state_dict(model).items()}


def print_settings(cls) -> None:
    """The --help list of a recipe's keys: each with what it does and its default."""
    print("Settings (YAML keys, or --key value on the command line):")
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            default = f"(default: {f.default})"
        elif f.default_factory is not dataclasses.MISSING:
            default = f"(default: {','.join(map(str, f.default_factory()))})"
        else:
            default = "(required)"
        lines = textwrap.wrap(f"{f.metadata.get('help', '')} {default}", 90)
        print(f"  --{f.name:<24}{lines[0]}")
        for line in lines[1:]:
            print(" " * 28 + line)


def recipe_main(cls, train, doc: str, argv: list[str] | None = None) -> int:
    """A training script's command line: --help lists the recipe's keys, else YAML plus overrides go to train()."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        print(doc)
        print_settings(cls)
        return 0
    offline_if_hub_unreachable()
    overrides = parse_overrides(argv)
    cfg = load_recipe(cls, overrides.pop("config", None), overrides)
    out = Path(cfg.out)
    with full_disk_is_one_line(out), no_empty_output_left(out):
        train(cfg)
    if several_processes():
        end_launched_process()
    return 0


def end_launched_process() -> None:
    """A process of a multi-process launch ends here once its run has succeeded: it closes its process
    group, finishes a wandb run, flushes its output and exits at once, skipping the interpreter's
    teardown. That teardown, in a process that ran gloo, now and then aborts after its last line of
    Python (SIGABRT, "terminate called without an active exception": rank 1 of a finished 2-process
    run, twice in CI), and the launcher then fails the run. After an error nothing here runs: closing
    a group that another process still waits on can hang."""
    import logging

    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    wandb = sys.modules.get("wandb")
    if wandb is not None and wandb.run is not None:
        wandb.finish()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


@contextlib.contextmanager
def lock_released_on_failure(out: Path):
    """A run that fails or is refused after taking the folder's LOCK gives it back, so the folder is as it was
    (a killed run cannot: its lock names a process that is gone, which no later run waits for)."""
    from gorgon.heads.files import drop_lock

    try:
        yield
    except BaseException:
        drop_lock(out / LOCK)
        raise


@contextlib.contextmanager
def no_empty_output_left(out: Path):
    """A run that fails before writing anything (bad data, too many processes) removes the --out folder it
    made, so a failed command leaves nothing behind. A folder that existed before, holds more than the run
    marker, or is locked (a failed run gives its own lock back first: the lock is another run's, which made
    the folder meanwhile and writes it now) is left as it is. The empty parent folders it made for --out go
    too."""
    from gorgon.heads.files import missing_folders, remove_empty_folders

    made = missing_folders(out)
    try:
        yield
    except BaseException:
        with contextlib.suppress(OSError):
            if made and out.is_dir() and {p.name for p in out.iterdir()} <= {RUN_MARKER}:
                shutil.rmtree(out)
        remove_empty_folders(made[1:])
        raise


@contextlib.contextmanager
def full_disk_is_one_line(out: Path):
    """A write that fails on a full disk becomes one line. torch and safetensors report a full disk in
    their own words (a RuntimeError at a checkpoint), not as an OSError, so the free space is checked
    (under 16 MiB counts as full)."""
    try:
        yield
    except Exception as err:
        if user_error_line(err) is not None:
            raise
        folder = next(p for p in [out, *out.absolute().parents] if p.exists())
        free = shutil.disk_usage(folder).free
        if free >= 16 * 2**20:
            raise
        raise GorgonError(f"the disk holding {out} is full ({free // 2**20} MiB free; {err.__class__.__name__} while "
                          "writing): free some space, then rerun (--resume true if a checkpoint was saved)") from err
