"""Train draft heads: `accelerate launch -q train/heads.py --config configs/heads/RECIPE.yaml [--key value ...]`.

Runs the same under plain `python train/heads.py`, on a CPU, one GPU or many (the accelerate
configs in configs/accelerate). `arch: medusa` trains Medusa heads on the target's last hidden
state: Medusa-1 freezes the target, Medusa-2 also trains LoRA adapters on it, held to its original
outputs by a KL term. `arch: eagle` trains an EAGLE head (EAGLE-3's layout) on the frozen
target's features. At the end the measured top-k accuracies on held-out data choose the decoding trees.
The output folder holds the heads, config, trees, metrics, a per-head accuracy plot and a
model card draft; checkpoints let `--resume true` continue after a kill. (`-q` keeps accelerate's own
traceback from following a one-line error.)
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from gorgon.heads.errors import GorgonError
from gorgon.heads.files import follow_umask
from gorgon.heads.methods import Method, by_name, setting, trainable
from gorgon.heads.quantize import scheme_problem
from gorgon.heads.tree import MAX_TREE_NODES
from gorgon.train.recipe import TrainingSettings, in_checkout
from gorgon.train.run_folder import (
    STATE_NAME,
    check_more_to_train,
    check_resume,
    data_sha256,
    numbered_checkpoints,
    resume_settings,
)


@dataclass
class HeadsSettings(TrainingSettings):
    """The keys every method trained here shares; `HeadsTrainConfig` adds each registered method's own."""

    arch: str = setting(trainable()[0].name, "the drafting method: " + " | ".join(f"{m.name} ({m.title})"
                                                                               for m in trainable()))
    loss_tokens: str = setting("answers", "answers | all: every position, prompts too (soft targets only: arch "
                                          "eagle or loss kl); held-out figures always count answers")
    head_decay: float = setting(0.8, "head k's (eagle: unrolled step k's) loss weight is head_decay ** k")
    train_conversations: int | None = setting(None, "train on the first N after the held-out split (a learning "
                                                    "curve); None: all")
    eval_every: int = setting(0, "held-out evaluation every N steps (0: only at the end)")
    tree_topk: int = setting(10, "ranks measured per head (eagle: per step) to choose the decoding trees")
    quantize: str = setting("none", "the target's weights while training: none (default), int4, int8, w8a8 or w4a8 "
                                    "on the CPU (gorgon.heads.quantize), for heads that serve that quantized target "
                                    "(pair it with data `gorgon data --quantize` wrote)")
    cache_features: bool = setting(False, "keep the frozen target's outputs in CPU memory after the first epoch, "
                                          "so later epochs skip its forward (medusa1: hidden_size floats per "
                                          "token; eagle: (len(feature_layers) + 1) x hidden_size)")
    draft_vocab_size: int | None = setting(None, "draft from, and train over, the N most frequent answer tokens "
                                                 "(EAGLE-3's d2t/t2d; then the lowest ids if the answers use fewer); "
                                                 "None: the whole vocabulary")
    cpu_tree_size: int | None = setting(None, "tree nodes per step saved for a CPU; None: the method's default ("
                                              + ", ".join(f"{m.name} {m.nodes['cpu']}" for m in trainable())
                                              + "; decoding with --tree auto sizes the tree for the machine at hand "
                                              "from the held-out accuracies and its verify costs)")
    gpu_tree_size: int | None = setting(None, "tree nodes per step saved for a GPU; None: the method's default ("
                                              + ", ".join(f"{m.name} {m.nodes['cuda']}" for m in trainable())
                                              + "; likewise)")

    @property
    def method(self) -> Method:
        """The drafting method `arch` names."""
        return by_name(self.arch)

    def recipe(self):
        """The chosen method's recipe, built from its keys (its own checks run as it is built)."""
        keys = self.method.recipe
        return keys(**{f.name: getattr(self, f.name) for f in dataclasses.fields(keys)})

    def tree_sizes(self) -> dict[str, int]:
        """Tree nodes per step saved for each device type: the recipe's, else the method's default."""
        default = self.method.nodes
        return {"cpu": self.cpu_tree_size or default["cpu"], "cuda": self.gpu_tree_size or default["cuda"]}

    def check(self) -> None:
        choices = {"arch": tuple(m.name for m in trainable()), "loss_tokens": ("answers", "all"),
                   "report_to": ("wandb", "none")}
        for key, allowed in choices.items():
            if getattr(self, key) not in allowed:
                raise GorgonError(f"{key} must be one of {', '.join(allowed)}, not {getattr(self, key)!r}")
        from gorgon.train.recipe import check_draft_vocab_size, check_lora, check_optimisation

        check_optimisation(self)
        for name in ("batch_size", "grad_accum"):
            if getattr(self, name) < 1:
                raise GorgonError(f"{name} must be at least 1, not {getattr(self, name)}")
        if self.eval_every < 0:
            raise GorgonError(f"eval_every must be at least 0 (0: only at the end), not {self.eval_every}")
        if self.tree_topk < 1:
            raise GorgonError(f"tree_topk must be at least 1, not {self.tree_topk}")
        if not self.head_decay > 0:  # a weight of head_decay ** k: 0 or less drops or flips the later heads' losses
            raise GorgonError(f"head_decay must be above 0 (1 weighs every head alike), not {self.head_decay}")
        check_draft_vocab_size(self.draft_vocab_size)
        if self.draft_vocab_size is not None and self.tree_topk > self.draft_vocab_size:
            raise GorgonError(f"tree_topk ranks tokens of the draft vocabulary: use at most draft_vocab_size "
                              f"({self.draft_vocab_size}), not {self.tree_topk}")
        for key in ("cpu_tree_size", "gpu_tree_size"):  # the trees are chosen after training: fail before it
            if getattr(self, key) is not None and not 2 <= getattr(self, key) <= MAX_TREE_NODES:
                raise GorgonError(f"{key} must be 2 (the root and one candidate) to {MAX_TREE_NODES} tree nodes, "
                                  f"not {getattr(self, key)}")
        if self.train_conversations is not None and self.train_conversations < 1:
            raise GorgonError(f"train_conversations must be at least 1 (or unset for all), not "
                              f"{self.train_conversations}")
        if self.max_steps is not None and self.max_steps < 0:
            raise GorgonError(f"max_steps must be at least 0 (0 saves the untrained heads), not {self.max_steps}")
        problem = scheme_problem(self.quantize)
        if problem:
            raise GorgonError(f"quantize: {problem}")
        self.check_other_methods_keys()
        recipe = self.recipe()
        recipe.check_with(self)
        if recipe.trains_target:
            check_lora(self)
            if self.quantize != "none":
                raise GorgonError("this recipe trains the target's own weights too (an adapter), which a quantized "
                                  "target cannot: set quantize: none, or train heads that leave the target as it is")

    def check_other_methods_keys(self) -> None:
        """A key of another method than `arch`'s, set away from its default, would be ignored: refuse it."""
        own = {f.name for f in dataclasses.fields(self.method.recipe)}
        for other in trainable():
            if other.name == self.arch:
                continue
            for f in dataclasses.fields(other.recipe):
                if f.name not in own and getattr(self, f.name) != default_of(f):
                    raise GorgonError(f"{f.name} is a key of arch: {other.name} ({other.title}), not of arch: "
                                      f"{self.arch}: remove it, or set arch: {other.name}")

    def check_target(self, config) -> None:
        """The settings that count the target's layers or tokens, checked against its text config before its
        weights load (the held-out ranks would fail only after training)."""
        from gorgon.train.recipe import check_draft_vocab_size

        if self.tree_topk > config.vocab_size:
            raise GorgonError(f"tree_topk must be at most the target's vocabulary of {config.vocab_size} tokens, not "
                              f"{self.tree_topk}: lower it")
        check_draft_vocab_size(self.draft_vocab_size, config.vocab_size)
        self.recipe().check_target(config)


def method_keys() -> list[tuple[str, type, dataclasses.Field]]:
    """Every trained method's recipe keys, as fields of one flat recipe. Methods may share a key (the same name,
    type and default: one concept, as the target layers a head reads); the first to declare it gives its help."""
    keys, first = [], {}
    shared = {g.name for g in dataclasses.fields(HeadsSettings)}
    for m in trainable():
        for f in dataclasses.fields(m.recipe):
            if f.name in shared:
                raise GorgonError(f"recipe key {f.name} of arch {m.name} is a key of every recipe: rename it")
            if f.name in first:
                other = first[f.name]
                if (f.type, default_of(f)) != (other.type, default_of(other)):
                    raise GorgonError(f"recipe key {f.name} of arch {m.name} differs in type or default from "
                                      "another method's: rename it, or declare it alike")
                continue
            first[f.name] = f
            keys.append((f.name, f.type, f))
    return keys


def default_of(f: dataclasses.Field):
    return f.default if f.default is not dataclasses.MISSING else f.default_factory()


# The recipe: the shared keys, then each method's (`--key value` or YAML set them, whichever method a run trains).
HeadsTrainConfig = dataclasses.make_dataclass("HeadsTrainConfig", method_keys(), bases=(HeadsSettings,))
HeadsTrainConfig.__doc__ = ("A heads training recipe: the shared keys, then the drafting methods'. Every key can be "
                            "set in the YAML or as --key value.")
HeadsTrainConfig.__module__ = __name__


def schedule(warmup: int, total: int, delay: int = 0):
    """Linear warmup then cosine decay; zero for the first `delay` steps (heads-only warmup)."""
    def factor(step: int) -> float:
        step -= delay
        if step < 0:
            return 0.0
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total - delay - warmup))))
    return factor


def save_checkpoint(accelerator, out: Path, progress: dict, keep: int) -> None:
    """accelerate's save_state into a temporary folder, renamed into place: never half-written.
    `progress` (the step, the examples trained on, the loss curve and time so far, the resume_settings)
    goes beside it in STATE_NAME, written last."""
    step = progress["step"]
    final = out / "checkpoints" / f"step-{step}"
    tmp = out / "checkpoints" / f".step-{step}.tmp"  # one a kill leaves behind is removed on resume (TMP_NAME)
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        follow_umask(tmp)  # save_state's weights are private (safetensors)
        (tmp / STATE_NAME).write_text(json.dumps(progress))
        os.replace(tmp, final)
        for old in numbered_checkpoints(out / "checkpoints", "step")[keep:]:
            shutil.rmtree(old)
    accelerator.wait_for_everyone()


TMP_NAME = re.compile(r"\.step-\d+\.tmp")  # a checkpoint being written by save_checkpoint


def latest_heads_checkpoint(out: Path) -> Path | None:
    """The newest complete checkpoint in a run's own --out. The temporary folder that a kill during a save
    left behind is removed first (otherwise only a later save of the same step would replace it)."""
    from gorgon.train.run_folder import latest_checkpoint

    for tmp in (out / "checkpoints").glob(".step-*.tmp"):
        if TMP_NAME.fullmatch(tmp.name):
            shutil.rmtree(tmp)
    return latest_checkpoint(out / "checkpoints", "step", STATE_NAME)


def accuracy_table(counts: torch.Tensor) -> list[list[float]]:
    """Per head, the chance that rank r is right, from rank counts (last column: total)."""
    totals = counts[:, -1].clamp(min=1).double()
    return (counts[:, :-1].double() / totals[:, None]).tolist()


@dataclass
class Run:
    """What the phases of one training run share: set up once, then stepped, evaluated and saved."""

    cfg: HeadsTrainConfig
    out: Path
    accelerator: object
    target: object
    recipe: object                    # the method's own keys (`gorgon.heads.methods.Recipe`)
    objective: torch.nn.Module        # the method's loss module; its `.heads` are what gets saved
    optimizer: torch.optim.Optimizer
    scheduler: object
    loader: object
    eval_loader: object
    sampler: object                   # the training order, set per epoch
    train_conversations: int
    eval_conversations: int
    total: int                        # optimizer steps of the whole run
    settings: dict                    # what each checkpoint records for a resume's check (resume_settings)
    step: int = 0                     # steps done (after a resume: from the checkpoint)
    trained: int = 0                  # conversations this process trained on (the main one: with the resumed)
    loss_curve: list = field(default_factory=list)  # [step, per-head losses] at every log (with the resumed)
    train_seconds: float = 0.0        # time in the training loop (with the resumed run's)
    draft_vocab_coverage: float | None = None


def setup(cfg: HeadsTrainConfig) -> Run:
    """Check the output, start accelerate, load target and data, build the objective, optimizer and
    schedule, and restore a checkpoint when resuming."""
    from accelerate import Accelerator
    from accelerate.utils import DistributedDataParallelKwargs, set_seed

    from gorgon.heads.target import load_target, target_text_config
    from gorgon.train.examples import (
        EpochSampler,
        RankBatches,
        collate,
        frequent_tokens,
        load_examples,
        read_conversations,
        split,
    )
    from gorgon.train.recipe import check_lora_targets, connect_cpu_processes, wandb_offline_without_key
    from gorgon.train.run_folder import prepare_output

    cfg.check()
    recipe = cfg.recipe()
    connect_cpu_processes()  # before anything creates accelerate's process state
    out = Path(cfg.out)
    resume_from = prepare_output(out, lambda: latest_heads_checkpoint(out), cfg)
    wandb_offline_without_key(cfg.report_to)
    unused = DistributedDataParallelKwargs(find_unused_parameters=recipe.find_unused_parameters)
    # step_scheduler_with_optimizer: the schedule counts the run's optimizer steps; accelerate would
    # otherwise step it once per process at every step (it assumes a schedule written for one process).
    accelerator = Accelerator(gradient_accumulation_steps=cfg.grad_accum, project_dir=str(out),
                              log_with="wandb" if cfg.report_to == "wandb" else None,
                              step_scheduler_with_optimizer=False, kwargs_handlers=[unused])
    if resume_from is not None:  # the settings, before the target and data load
        check_resume(resume_from, resume_settings(cfg, accelerator.num_processes))
    set_seed(cfg.seed)
    conversations = read_conversations(cfg.data)  # a bad --data fails before the target loads
    cfg.check_target(target_text_config(cfg.target))
    target = load_target(cfg.target, device=str(accelerator.device), dtype=cfg.dtype, quantize=cfg.quantize)
    if recipe.trains_target:  # its adapters go on the target's layers
        check_lora_targets(target.model, cfg.lora_target_modules, "the target")
    target.model.requires_grad_(False)
    examples = load_examples(cfg.data, target.tokenizer, cfg.max_length, target.fingerprints, conversations,
                             lambda line: accelerator.print(f"gorgon train: {line}", file=sys.stderr))
    world = accelerator.num_processes
    settings = resume_settings(cfg, world, data_sha256(examples))
    if resume_from is not None:  # again, now with the data's contents
        check_resume(resume_from, settings)
    train_ex, eval_ex = split(examples, cfg.eval_fraction, cfg.seed)
    train_ex = train_ex[:cfg.train_conversations]  # the held-out split stays the same whatever the share
    if not train_ex:
        raise GorgonError(f"{cfg.data} has too few examples to train on after holding out the eval split: add data "
                          "or lower eval_fraction")
    sampler = EpochSampler(len(train_ex), cfg.seed)
    train_batches = RankBatches(sampler, cfg.batch_size, world, "training conversations")
    eval_batches = RankBatches(EpochSampler(len(eval_ex), None), cfg.batch_size, world, "held-out conversations",
                               "raise eval_fraction")
    vocab = target.model.config.get_text_config().vocab_size
    draft_tokens, coverage = frequent_tokens(train_ex, cfg.draft_vocab_size, vocab) if cfg.draft_vocab_size else \
        (None, None)
    objective = cfg.method.objective(recipe, cfg, target, draft_tokens)
    groups = [{"params": [p for p in objective.heads.parameters() if p.requires_grad], "lr": cfg.learning_rate}]
    backbone = [p for p in objective.target.parameters() if p.requires_grad]
    if backbone:
        groups.append({"params": backbone, "lr": cfg.backbone_learning_rate})
    optimizer = torch.optim.AdamW(groups, weight_decay=cfg.weight_decay)
    pad = target.tokenizer.pad_token_id if target.tokenizer.pad_token_id is not None else 0
    # Each loader draws a seed when iterated: from a generator of its own, not from torch's global one, which
    # dropout and feature noise use. Else a run resumed mid-epoch, whose loader is iterated anew after the
    # checkpoint's random state is restored, would draw once more than the uninterrupted run and add other noise.
    loader = torch.utils.data.DataLoader(train_ex, batch_sampler=train_batches, collate_fn=lambda b: collate(b, pad),
                                         generator=torch.Generator())
    eval_loader = torch.utils.data.DataLoader(eval_ex, batch_sampler=eval_batches, collate_fn=lambda b: collate(b, pad),
                                              generator=torch.Generator())
    steps_per_epoch = max(1, math.ceil(len(train_batches) / (cfg.grad_accum * world)))
    total = cfg.max_steps if cfg.max_steps is not None else max(1, math.ceil(cfg.epochs * steps_per_epoch))
    if resume_from is not None:  # a finished run continues only to train longer
        check_more_to_train(out, cfg, total)
    lambdas = [schedule(cfg.warmup_steps, total)] + ([schedule(cfg.warmup_steps, total, cfg.heads_warmup_steps)]
                                                     if backbone else [])
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambdas)
    objective, optimizer, loader, eval_loader, scheduler = accelerator.prepare(
        objective, optimizer, loader, eval_loader, scheduler)
    run = Run(cfg, out, accelerator, target, recipe, objective, optimizer, scheduler, loader, eval_loader, sampler,
              len(train_ex), len(eval_ex), total, settings, draft_vocab_coverage=coverage)
    if resume_from is not None:
        accelerator.load_state(str(resume_from))
        progress = json.loads((resume_from / STATE_NAME).read_text())
        run.step = progress["step"]
        # checkpoints from before the count was kept: every step so far took one global batch
        resumed = progress.get("examples", run.step * cfg.batch_size * cfg.grad_accum * world)
        run.trained = resumed if accelerator.is_main_process else 0
        run.loss_curve = progress.get("loss_curve", [])  # absent from checkpoints of older versions
        run.train_seconds = progress.get("train_seconds", 0.0)
        accelerator.print(f"gorgon train: resumed from {resume_from} at step {run.step}", file=sys.stderr)
    accelerator.init_trackers(cfg.project, config=asdict(cfg))
    devices = f"{world} processes on {accelerator.device.type}" if world > 1 else str(accelerator.device)
    accelerator.print(f"gorgon train: {recipe.label} on {target.name}, conversations: {len(train_ex)} to train on, "
                      f"{len(eval_ex)} held out; {total} steps on {devices}", file=sys.stderr)
    if cfg.warmup_steps >= total:
        accelerator.print(f"gorgon train: warmup_steps {cfg.warmup_steps} is not shorter than the run (steps: "
                          f"{total}): the learning rate never reaches learning_rate {cfg.learning_rate} (lower "
                          "warmup_steps)", file=sys.stderr)
    return run


def train_steps(run: Run) -> None:
    """Step until the run's total: accumulate, clip, step the optimizer and schedule, log, checkpoint.
    The loss curve (per-head losses over all processes) and the time grow in `run`; each checkpoint
    keeps them, so a resumed run reports the whole of both."""
    from tqdm.auto import tqdm

    cfg, accelerator, objective = run.cfg, run.accelerator, run.objective
    started = time.perf_counter() - run.train_seconds
    bar = tqdm(total=run.total, initial=run.step, desc="gorgon train", unit="step",
               disable=not accelerator.is_main_process, dynamic_ncols=True)
    window = new_window(run.recipe.rows)
    # accelerate ends an accumulation at the end of the data: an epoch is ceil(batches / grad_accum) steps
    steps_per_epoch = math.ceil(len(run.loader) / cfg.grad_accum)  # len: this process's share
    while run.step < run.total:
        epoch, done = divmod(run.step, steps_per_epoch)
        done_in_epoch = done * cfg.grad_accum
        batches = accelerator.skip_first_batches(run.loader, done_in_epoch) if done_in_epoch else run.loader
        # accelerate's loader passes its own epoch count to the sampler, which starts at 0 in a
        # resumed process: set it from the step, so a resumed run sees the same order. (The
        # loader's own set_epoch does not reach the sampler through accelerate's sharding.)
        batches.set_epoch(epoch)
        run.sampler.set_epoch(epoch)
        for batch in batches:
            if cfg.loss_tokens == "all":
                batch = {**batch, "loss_mask": batch["attention_mask"].bool()}
            with accelerator.accumulate(objective):
                loss, stats, _ = objective(**batch, train_backbone=run.step >= cfg.heads_warmup_steps)
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(objective.parameters(), cfg.max_grad_norm)
                run.optimizer.step()  # accelerate skips it between accumulated batches; the schedule too:
                if accelerator.sync_gradients:
                    run.scheduler.step()
                run.optimizer.zero_grad()
            run.trained += len(batch["input_ids"])
            add_to_window(window, stats, int(batch["attention_mask"].sum()))
            if not accelerator.sync_gradients:
                continue
            run.step += 1
            bar.update(1)
            if run.step % cfg.log_every == 0 or run.step == run.total:
                run.loss_curve.append([run.step, log_window(accelerator, window, run.step, run.scheduler, bar)])
                window = new_window(run.recipe.rows)
            if cfg.eval_every and run.step % cfg.eval_every == 0:
                eval_loss, counts, _ = evaluate(run)
                top1 = [row[0] for row in accuracy_table(counts)]
                accelerator.log({"eval/loss": eval_loss, **{f"eval/top1_head{k}": a for k, a in enumerate(top1, 1)}},
                                step=run.step)
                if accelerator.is_main_process:
                    bar.write(f"step {run.step}: held-out loss {eval_loss:.3f} | top-1 "
                              f"{' '.join(f'{a:.3f}' for a in top1)} (drafts 1-{len(top1)})", file=sys.stderr)
            if cfg.save_every and run.step % cfg.save_every == 0 and run.step < run.total:
                run.train_seconds = time.perf_counter() - started
                progress = {"step": run.step, "examples": count_all(accelerator, run.trained),
                            "loss_curve": run.loss_curve, "train_seconds": run.train_seconds,
                            "settings": run.settings}
                save_checkpoint(accelerator, run.out, progress, cfg.keep_checkpoints)
            if run.step >= run.total:
                break
    run.train_seconds = time.perf_counter() - started
    bar.close()


def evaluate(run: Run) -> tuple[float, torch.Tensor, int]:
    """Held-out loss (mean over batches), rank counts (K, tree_topk + 1) and the number of
    conversations, summed over every process's share of the eval split."""
    accelerator = run.accelerator
    model = accelerator.unwrap_model(run.objective)
    counts = torch.zeros(run.recipe.rows, run.cfg.tree_topk + 1, dtype=torch.long)
    totals = torch.zeros(3, dtype=torch.float64)  # loss sum, batches, conversations
    model.heads.eval()  # no training noise on held-out data
    with torch.no_grad():
        for batch in run.eval_loader:
            loss, _, for_ranks = model(**batch, train_backbone=False)  # what the objective counts ranks from
            totals += torch.tensor([float(loss), 1, len(batch["input_ids"])], dtype=torch.float64)
            counts += model.rank_counts(for_ranks, batch, run.cfg.tree_topk)
    model.heads.train()
    counts = accelerator.reduce(counts.to(accelerator.device), reduction="sum").cpu()
    loss_sum, batches, conversations = accelerator.reduce(totals.to(accelerator.device), reduction="sum").tolist()
    return loss_sum / max(1, batches), counts, int(conversations)


def save(run: Run) -> dict:
    """Measure the heads on held-out data, choose their trees, and write the heads folder (weights, trees,
    Medusa-2's adapter, metrics, recipe, plot, card) from the main process; returns the metrics."""
    from gorgon.heads.card import plot_head_accuracy, write_model_card
    from gorgon.train.data import describe, hub_datasets
    from gorgon.train.recipe import full_state_dict
    from gorgon.train.run_folder import finish_run_folder, set_aside_earlier_run

    cfg, accelerator, out = run.cfg, run.accelerator, run.out
    trained = count_all(accelerator, run.trained)
    eval_loss, counts, evaluated = evaluate(run)
    accuracies = accuracy_table(counts)
    unwrapped = accelerator.unwrap_model(run.objective)
    heads = unwrapped.heads
    heads.set_trees(accuracies, cfg.tree_sizes())
    metrics = {
        "eval_loss": eval_loss, "eval_tokens_per_head": counts[:, -1].tolist(),
        "top1": [row[0] for row in accuracies], "top5": [sum(row[:5]) for row in accuracies],
        "rank_accuracy": accuracies,
        "expected_tau": {device: heads.expected_tau(device) for device in ("cpu", "cuda")},
        "tree_nodes": cfg.tree_sizes(), "arch": cfg.arch,
        "steps": run.total, "train_conversations": run.train_conversations,
        "eval_conversations": run.eval_conversations, "processes": accelerator.num_processes,
        "conversations_trained": trained, "conversations_evaluated": evaluated,
        "loss_curve": run.loss_curve, "train_seconds": run.train_seconds, "target_name": run.target.name,
        "data": describe(cfg.data), "datasets": hub_datasets(cfg.data),
        "data_sha256": run.settings["data_sha256"],
        "draft_vocab_size": cfg.draft_vocab_size, "draft_vocab_coverage": run.draft_vocab_coverage,
    }
    accelerator.log({f"eval/top1_head{k}": a for k, a in enumerate(metrics["top1"], 1)}, step=run.total)
    trained_weights = full_state_dict(accelerator, run.objective)  # every process: it gathers shards
    if accelerator.is_main_process:
        out.mkdir(parents=True, exist_ok=True)
        set_aside_earlier_run(out)
        # The heads' own buffers (the draft vocabulary) with the gathered trained weights.
        heads.save_pretrained(out, {**heads.state_dict(), **strip_prefix(trained_weights, "heads.")})
        if run.recipe.trains_target:
            run.recipe.save_adapter(out, unwrapped.target, strip_prefix(trained_weights, "target."))
        recipe = asdict(cfg)
        plot_head_accuracy(metrics, out / "head_accuracy.png")
        write_model_card(out, recipe, metrics)  # and metrics.json, with what the card says
        finish_run_folder(out, recipe)
    return metrics


def train(cfg: HeadsTrainConfig) -> Path:
    """The whole run: setup, the steps, then evaluation and the saved heads folder (pushed when asked)."""
    from gorgon.train.run_folder import announce_result, lock_released_on_failure

    with lock_released_on_failure(Path(cfg.out), lambda: latest_heads_checkpoint(Path(cfg.out))):
        run = setup(cfg)
        train_steps(run)
        metrics = save(run)
    run.accelerator.end_training()  # wandb's closing lines first, so that the run's result ends the output
    if run.accelerator.is_main_process:
        rows = [f"{cfg.method.rows(k)} (t+{k + 1})" for k in range(1, len(metrics["top1"]) + 1)]  # as the card
        summary = ", ".join(f"{row}: top-1 {a:.3f} top-5 {b:.3f}"
                            for row, a, b in zip(rows, metrics["top1"], metrics["top5"]))
        tau = metrics["expected_tau"]
        announce_result("gorgon train", run.out, f"saved heads to {run.out} (held-out {summary}; expected tau, tokens "
                        f"per target forward: {tau['cpu']:.2f} on a CPU's tree, {tau['cuda']:.2f} on a GPU's)",
                        cfg.push_to_hub, f"gorgon bench --heads {run.out} --questions "
                        f"{in_checkout('scripts/data/mt_bench.jsonl')} --update-card (--context-draft merges prompt "
                        "lookup in)")
    return run.out


def count_all(accelerator, n: int) -> int:
    return int(accelerator.reduce(torch.tensor(n, device=accelerator.device), reduction="sum"))


def strip_prefix(state: dict, prefix: str) -> dict:
    return {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}


def new_window(rows: int) -> dict:
    """Sums over the batches since the last log. Per row (a Medusa head or an unrolled step of the EAGLE
    head; one more row: Medusa-2's base KL): loss, top-1 hits, top-5 hits, positions, batches; one tensor, so
    all processes sum it at once."""
    return {"sums": torch.zeros(rows + 1, 5, dtype=torch.float64), "tokens": 0, "start": time.perf_counter()}


def add_to_window(window: dict, stats: dict, tokens: int) -> None:
    window["tokens"] += tokens
    for k, s in stats.items():
        row = [s, 0, 0, 0, 1] if k == "base_kl" else [s["loss"], s["top1"], s["top5"], s["count"], 1]
        window["sums"][-1 if k == "base_kl" else k] += torch.tensor(row, dtype=torch.float64)


def log_window(accelerator, window: dict, step: int, scheduler, bar) -> list[float]:
    """Log per-head loss and accuracy, tokens/s and learning rates over the last window of batches
    of all processes (every process calls it: the sums are reduced). Returns the per-head losses."""
    secs = time.perf_counter() - window["start"]
    sums = torch.cat([window["sums"].flatten(), torch.tensor([window["tokens"]], dtype=torch.float64)])
    sums = accelerator.reduce(sums.to(accelerator.device), reduction="sum").cpu()
    heads, tokens = sums[:-1].view_as(window["sums"]), float(sums[-1])
    logs = {"train/tokens_per_s": tokens / max(secs, 1e-9), "train/lr": scheduler.get_last_lr()[0]}
    if len(scheduler.get_last_lr()) > 1:
        logs["train/backbone_lr"] = scheduler.get_last_lr()[1]
    if heads[-1, 4]:
        logs["train/base_kl"] = float(heads[-1, 0] / heads[-1, 4])
    losses = []
    for k, (loss, top1, top5, count, batches) in enumerate(heads[:-1].tolist(), 1):  # as the card numbers them
        losses.append(loss / max(1, batches))
        logs[f"train/loss_head{k}"] = losses[-1]
        logs[f"train/top1_head{k}"] = top1 / max(1, count)
        logs[f"train/top5_head{k}"] = top5 / max(1, count)
    accelerator.log(logs, step=step)
    drafts = range(1, len(losses) + 1)
    loss_text = " ".join(f"{logs[f'train/loss_head{k}']:.2f}" for k in drafts)
    top1_text = " ".join(f"{logs[f'train/top1_head{k}']:.3f}" for k in drafts)
    if accelerator.is_main_process:
        bar.write(f"step {step}: loss {loss_text} | top-1 {top1_text} (drafts 1-{len(losses)}) | "
                  f"{logs['train/tokens_per_s']:.0f} tok/s | lr {logs['train/lr']:.2e}", file=sys.stderr)
    return losses


def main(argv=None) -> int:
    from gorgon.train.recipe import recipe_main

    return recipe_main(HeadsTrainConfig, train, __doc__, argv)


if __name__ == "__main__":
    from gorgon.heads.command import run_script

    run_script(main, "train/heads.py")
