"""Training recipes: a dataclass of settings, filled from a YAML file, then `--key value` overrides,
and what both training scripts share: their command line, their processes, the logging mode (their
--out folder's rules: `run_folder.py`).

An unknown key, in the YAML or on the command line, is an error naming the close matches:
a misspelt `learning_rate` must not silently train with the default.
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
import textwrap
import types
import typing
from pathlib import Path

import yaml

from gorgon.heads.errors import GorgonError, check_keys
from gorgon.heads.hub import offline_if_hub_unreachable
from gorgon.heads.methods import setting
from gorgon.heads.outputs import full_disk_is_one_line
from gorgon.train.run_folder import no_empty_output_left


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


def _convert(value, annotation, key: str, where: str = ""):
    """Parse a command-line string (or check a YAML value) against a field's type; `where` names the source
    in an error (" in r.yaml")."""
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
        raise GorgonError(f"{key}{where} must be {name}, got {value!r}")
    if origin is list:
        items = value if isinstance(value, list) else [v for v in str(value).split(",") if v]
        return [_convert(v, args[0], key, where) for v in items]
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
        raise GorgonError(f"{key}{where} must be {name}, got {value!r}") from err


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


def check_draft_vocab_size(size: int | None, vocab_size: int | None = None) -> None:
    """draft_vocab_size, which both scripts take (heads train over it, a draft saves it): unset, or a count;
    with the target's `vocab_size` (its config read, its weights not yet loaded), at most that."""
    if size is not None and size < 1:
        raise GorgonError(f"draft_vocab_size must be at least 1 (or unset for the whole vocabulary), not {size}")
    if size is not None and vocab_size is not None and size > vocab_size:
        raise GorgonError(f"draft_vocab_size must be at most the target's vocabulary of {vocab_size} tokens, not "
                          f"{size}: lower it, or set it to null to draft from every token")


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
            data = yaml.safe_load(path.read_text())
        except yaml.YAMLError as err:
            raise GorgonError(f"config {config_path} is not valid YAML ({err.__class__.__name__}): "
                              "fix its syntax") from err
        if data is None or data == {}:  # it would train on the defaults alone: a file emptied or cut short
            raise GorgonError(f"config {config_path} is empty: give it the recipe's key: value lines (gorgon's "
                              "recipes are in configs/heads and configs/draft), or pass the settings without --config")
        if not isinstance(data, dict):
            raise GorgonError(f"config {config_path} must be a mapping of key: value")
        unknown = [key for key in data if key not in fields]
        if len(unknown) > 1:  # most likely the other script's recipe, else more than one typo
            raise GorgonError(f"config {config_path} has keys this script does not take ({', '.join(unknown[:3])}"
                              f"{', ...' if len(unknown) > 3 else ''}): a heads recipe (configs/heads) trains with "
                              "gorgon train (train/heads.py), a draft model's (configs/draft) with gorgon draft "
                              "(train/draft.py); otherwise correct them (--help lists the keys)")
        check_keys(data, set(fields), f"in {config_path}")
        values.update({key: _convert(value, types_[key], key, f" in {config_path}") for key, value in data.items()})
    check_keys(overrides, set(fields), "on the command line")
    for key, value in overrides.items():  # a bare --key, which parse_overrides reads as True (a YAML true is a value)
        if value is True and types_[key] is not bool:
            raise _needs_value(key)
    values.update({key: _convert(value, types_[key], key, " on the command line") for key, value in overrides.items()})
    missing = [n for n, f in fields.items() if f.default is dataclasses.MISSING
               and f.default_factory is dataclasses.MISSING and n not in values]
    if missing:
        raise GorgonError(f"missing setting {', '.join(missing)}: add it to the YAML or pass --{missing[0]} VALUE")
    return cls(**values)


CHECKOUT = Path(__file__).resolve().parents[1]  # the repository: configs/ and scripts/ beside train/


def in_checkout(path: str) -> str:
    """A file of the repository (`configs/...`, `scripts/...`) as the next command a run suggests names it: from
    the current folder, or in full from outside the checkout, so the command works where it is run. As given
    where the checkout lacks it (an install from a wheel has neither folder)."""
    full = CHECKOUT / path
    if not full.exists():
        return path
    relative = os.path.relpath(full)
    return str(full) if relative.startswith("..") else relative


def wandb_offline_without_key(report_to: str) -> None:
    """wandb logs locally unless the user has a key (in the environment, or saved by `wandb login`) or chose a
    mode: a run never stops to ask for a login."""
    if report_to == "wandb" and not wandb_key_known() and not os.environ.get("WANDB_MODE"):
        os.environ["WANDB_MODE"] = "offline"


def wandb_key_known() -> bool:
    """Whether wandb has an API key: WANDB_API_KEY, or the one `wandb login` keeps in the netrc file."""
    import netrc
    from urllib.parse import urlparse

    if os.environ.get("WANDB_API_KEY"):
        return True
    host = urlparse(os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai").hostname
    try:
        return netrc.netrc(os.environ.get("NETRC")).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):  # no netrc file, or one that cannot be read
        return False


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
    print(f"  --{'config':<24}a YAML recipe of these keys (configs/heads, configs/draft); a --key value overrides")
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


# The programs and modules that launch training processes: a parent running one of them is their launcher.
LAUNCHERS = ("accelerate", "accelerate-launch", "torchrun", "deepspeed", "accelerate.commands.launch",
             "torch.distributed.run", "torch.distributed.launch", "deepspeed.launcher.launch")


def end_with_the_launcher() -> None:
    """A process `accelerate launch` (or torchrun) started ends when its launcher does: killing the launcher
    (`kill PID`, what users do) left training running on its own, holding --out and writing it without a
    word. Linux only (prctl's PR_SET_PDEATHSIG); a script whose parent is not a launcher (a shell, nohup) is
    left as it is, so that `nohup python train/heads.py ... &` outlives its shell, whatever variables it exports."""
    import ctypes
    import signal

    launcher = os.getppid()
    try:
        words = Path(f"/proc/{launcher}/cmdline").read_bytes().decode(errors="replace").split("\0")[:6]
    except OSError:  # not Linux
        return
    if not any(Path(word).name in LAUNCHERS for word in words):  # `launcher`, `python [-u] -m M`, `python PATH`
        return
    try:
        if ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM) != 0:  # 1: PR_SET_PDEATHSIG
            return
    except (OSError, AttributeError):  # not Linux
        return
    if os.getppid() != launcher:  # it ended before the call, so nothing would send the signal
        os.kill(os.getpid(), signal.SIGTERM)


def recipe_main(cls, train, doc: str, argv: list[str] | None = None) -> int:
    """A training script's command line: --help lists the recipe's keys, else YAML plus overrides go to train()."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        print(doc)
        print_settings(cls)
        return 0
    offline_if_hub_unreachable()
    end_with_the_launcher()
    overrides = parse_overrides(argv)
    cfg = load_recipe(cls, overrides.pop("config", None), overrides)
    out = Path(cfg.out)
    with full_disk_is_one_line(out, "rerun (--resume true if a checkpoint was saved)"), no_empty_output_left(out):
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
