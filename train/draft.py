"""Distil a small draft model from the target: `accelerate launch -q train/draft.py --config configs/draft/RECIPE.yaml
--data DATA --out OUT`.

The other way to draft (besides heads): a small causal LM with the target's tokenizer proposes
a few tokens and the target verifies them in one forward (`gorgon generate --draft OUT`, or
`assistant_model=` in transformers' own `generate`). The draft starts from a smaller model of
the same family (`student`) or, when the target has none, from a copy of the target cut to its
first `student_layers` layers (embedding, those layers, final norm, LM head). It is then trained
with trl's GKD trainer to match the target's full next-token distribution on the target's own
answers (`gorgon data`): beta 0 is the forward KL, 1 the reverse KL, between them the generalised
JSD; `lmbda` > 0 lets the draft answer part of the prompts itself (on-policy distillation).
The held-out KL and top-1 agreement with the target are measured before and after; the output
folder is a plain transformers model with its tokenizer, metrics.json and a model card, and with
`draft_vocab_size` N the N most frequent answer tokens (draft_vocab.safetensors), which gorgon's
decoder drafts through: an output layer cut to those rows costs a fraction of the whole one.
Checkpoints let `--resume true` continue after a kill. `--max_steps 0` saves the starting draft
untrained: the baseline that distillation is measured against.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from gorgon.heads.errors import GorgonError
from gorgon.heads.files import atomic_write_text, follow_umask
from gorgon.heads.methods import setting
from gorgon.heads.methods.draft_model import DRAFT_TOKENS
from gorgon.train.recipe import TrainingSettings, in_checkout
from gorgon.train.run_folder import STATE_NAME, check_more_to_train, check_resume, data_sha256, resume_settings


@dataclass
class DraftTrainConfig(TrainingSettings):
    """A draft distillation recipe: the shared keys, then distillation's. Every key can be set in the YAML or
    as --key value."""

    student: str | None = setting(None, "a smaller model sharing the target's tokenizer; None: the target cut to "
                                        "its first student_layers layers")
    student_layers: int = setting(4, "without student: the target's first N layers the draft keeps")
    beta: float = setting(0.0, "generalised JSD: 0 is KL(target || draft), 1 is KL(draft || target)")
    lmbda: float = setting(0.0, "share of batches the draft answers itself (on-policy GKD)")
    temperature: float = setting(1.0, "lmbda > 0: sampling temperature of the draft's own answers")
    max_new_tokens: int = setting(128, "lmbda > 0: length of the draft's own answers")
    lora: bool = setting(False, "train LoRA adapters (merged at the end) instead of every weight")
    lora_r: int = setting(16, "lora: LoRA rank")
    lora_alpha: int = setting(32, "lora: LoRA alpha")
    lora_dropout: float = setting(0.0, "lora: LoRA dropout")
    lora_target_modules: list[str] = setting(
        help="lora: the draft's linear layers that get adapters",
        factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    learning_rate: float = setting(2e-4, "peak learning rate (linear warmup, then cosine decay)")
    gradient_checkpointing: bool = setting(False, "recompute activations in the backward pass: less memory, "
                                                  "slower steps")
    dtype: str = setting("auto", "the target's dtype: auto (bfloat16 on CUDA, float32 on a CPU), float32, "
                                 "bfloat16, float16; the draft trains in float32")
    draft_tokens: int = setting(DRAFT_TOKENS, "the chain length the expected tau in metrics.json assumes")
    draft_vocab_size: int | None = setting(None, "save the N most frequent answer tokens beside the draft: it then "
                                                 "drafts through its output layer cut to them (a smaller, cheaper "
                                                 "product); None: drafts from the whole vocabulary")

    @property
    def method(self):
        """The drafting method this script trains."""
        from gorgon.heads.methods import by_name

        return by_name("draft_model")

    def check(self) -> None:
        if self.report_to not in ("wandb", "none"):
            raise GorgonError(f"report_to must be wandb or none, not {self.report_to!r}")
        for key in ("beta", "lmbda"):
            if not 0.0 <= getattr(self, key) <= 1.0:
                raise GorgonError(f"{key} must lie between 0 and 1, not {getattr(self, key)}")
        from gorgon.train.recipe import check_draft_vocab_size, check_lora, check_optimisation

        check_optimisation(self)
        for name in ("batch_size", "grad_accum", "draft_tokens"):
            if getattr(self, name) < 1:
                raise GorgonError(f"{name} must be at least 1, not {getattr(self, name)}")
        if self.max_new_tokens < 1:  # trl's GKD builds its sampling settings even with lmbda 0
            raise GorgonError(f"max_new_tokens must be at least 1 (the length of the draft's own answers with "
                              f"lmbda > 0), not {self.max_new_tokens}")
        if self.lmbda > 0 and not self.temperature > 0:
            raise GorgonError(f"temperature must be above 0 with lmbda > 0: the draft samples its own answers at it "
                              f"(trl's GKD has no greedy answers), not {self.temperature}")
        if self.lora:
            check_lora(self)
        check_draft_vocab_size(self.draft_vocab_size)
        if self.max_steps is not None and self.max_steps < 0:
            raise GorgonError(f"max_steps must be at least 0 (0 saves the untrained draft), not {self.max_steps}")

    def check_target(self, config) -> None:
        """The settings that count the target's layers or tokens, checked against its text config before its
        weights load; a student of its own is looked for."""
        from gorgon.heads.methods.draft_model.model import check_student_layers
        from gorgon.heads.target import check_model_source
        from gorgon.train.recipe import check_draft_vocab_size

        check_draft_vocab_size(self.draft_vocab_size, config.vocab_size)
        if self.student is None:
            check_student_layers(self.student_layers, config.num_hidden_layers)
        else:
            check_model_source(self.student, "student")


def gkd_trainer(cfg: DraftTrainConfig, student, target, train_ex: list[dict], ckpt_dir: Path, device: torch.device,
                settings: dict, resume_from: Path | None = None):
    """trl's GKD trainer set up from the recipe: the draft as student, the frozen target as teacher;
    each checkpoint records `settings` (resume_settings) for a resume's check."""
    from datasets import Dataset

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # GKD lives in trl.experimental; chosen knowingly
    from transformers import TrainerCallback
    from transformers.trainer_callback import ProgressCallback
    from trl.experimental.gkd import GKDConfig, GKDTrainer

    from gorgon.heads.methods.draft_model.objective import gkd_batch
    from gorgon.train.examples import EpochSampler, RankBatches, collate

    class NoCheckpointAtTheEnd(TrainerCallback):
        """The final save follows the last step at once. A checkpoint there would be resumed one step
        too far: after resuming at max_steps, transformers' Trainer trains another step."""

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step >= state.max_steps:
                control.should_save = False

    class Progress(ProgressCallback):
        """transformers' progress bar, named, with each log written as a line as train/heads.py writes its
        own ("step 10: loss 2.31 | grad_norm 1.2 | learning_rate 0.0005"), not as a printed dict."""

        def on_train_begin(self, args, state, control, **kwargs):
            from tqdm.auto import tqdm

            if state.is_world_process_zero:
                self.training_bar = tqdm(total=state.max_steps, desc="gorgon draft", unit="step", dynamic_ncols=True)
            self.current_step = 0

        def on_log(self, args, state, control, logs=None, **kwargs):
            if state.is_world_process_zero and self.training_bar is not None and logs:
                if "train_runtime" in logs:  # the Trainer's closing summary, not a step's
                    text = f"trained {state.global_step} steps in {logs['train_runtime']:.1f} s"
                else:
                    text = f"step {state.global_step}: " + " | ".join(
                        f"{key} {value:.4g}" if isinstance(value, float) else f"{key} {value}"
                        for key, value in logs.items() if key != "total_flos")
                self.training_bar.write(text, file=sys.stderr)

    class Trainer(GKDTrainer):
        """GKD with gorgon's split of the data over processes: every conversation once per epoch.
        (The Trainer's own sampler, sharded by accelerate, repeats examples to even out the end.)"""

        def get_train_dataloader(self):
            sampler = EpochSampler(len(self.train_dataset), self.args.seed)
            if resume_from is not None:
                # The Trainer wraps the resumed epoch's loader to skip batches, and its set_epoch then
                # no longer reaches the sampler through accelerate's sharding: start at that epoch.
                sampler.set_epoch(int(json.loads((resume_from / "trainer_state.json").read_text())["epoch"]))
            batches = RankBatches(sampler, self._train_batch_size, self.accelerator.num_processes,
                                  "training conversations")
            return self.accelerator.prepare(torch.utils.data.DataLoader(
                self.train_dataset, batch_sampler=batches, collate_fn=self.data_collator,
                pin_memory=self.args.dataloader_pin_memory))

        def _save_rng_state(self, output_dir):
            """Each process writes its own RNG state, and the main process trainer_state.json right after its
            own, which marks the checkpoint whole for a resume: the others must have finished first. The
            settings a resume must keep go in before it too, for its check (run_folder.check_resume)."""
            super()._save_rng_state(output_dir)
            if self.accelerator.is_main_process:
                follow_umask(Path(output_dir))  # the model saved before it is private (safetensors)
                state = {"settings": settings}
                atomic_write_text(Path(output_dir) / STATE_NAME, json.dumps(state))
            self.accelerator.wait_for_everyone()

    # transformers >= 5.23 renames gradient_checkpointing, but trl's configs still set it (True by default)
    warnings.filterwarnings("ignore", message="`gradient_checkpointing` is deprecated", category=FutureWarning)
    args = GKDConfig(
        output_dir=str(ckpt_dir), per_device_train_batch_size=cfg.batch_size,
        gradient_accumulation_steps=cfg.grad_accum, learning_rate=cfg.learning_rate,
        weight_decay=cfg.weight_decay, warmup_steps=cfg.warmup_steps, lr_scheduler_type="cosine",
        num_train_epochs=cfg.epochs, max_steps=cfg.max_steps or -1, max_grad_norm=cfg.max_grad_norm,
        logging_steps=cfg.log_every, save_strategy="steps" if cfg.save_every else "no",
        save_steps=cfg.save_every or 1, save_total_limit=cfg.keep_checkpoints, seed=cfg.seed,
        report_to=["wandb"] if cfg.report_to == "wandb" else [], run_name=Path(cfg.out).name,
        bf16=device.type == "cuda" and torch.cuda.is_bf16_supported(), fp16=False,
        gradient_checkpointing=cfg.gradient_checkpointing,
        lmbda=cfg.lmbda, beta=cfg.beta, temperature=cfg.temperature, max_new_tokens=cfg.max_new_tokens,
        max_length=cfg.max_length, remove_unused_columns=False, dataloader_num_workers=0,
        dataloader_pin_memory=device.type == "cuda")
    peft_config = None
    if cfg.lora:
        from peft import LoraConfig

        peft_config = LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                                 target_modules=cfg.lora_target_modules, task_type="CAUSAL_LM")
    pad = target.tokenizer.pad_token_id
    trainer = Trainer(model=student.train(), teacher_model=target.model, args=args,
                      train_dataset=Dataset.from_list(train_ex), processing_class=target.tokenizer,
                      data_collator=lambda b: gkd_batch(collate(b, pad), pad), peft_config=peft_config,
                      callbacks=[NoCheckpointAtTheEnd()])
    trainer.remove_callback(ProgressCallback)  # the bar without a name, and its logs as printed dicts
    trainer.add_callback(Progress())
    return trainer


@functools.cache  # register once per process
def read_indexed_cpu_locations() -> None:
    """transformers 5.17's Trainer resumes a multi-process CPU run with map_location "cpu:N", which
    torch cannot restore (5.18 passes "cpu"): read such storages as the CPU storages they are."""
    torch.serialization.register_package(
        100, lambda storage: None, lambda storage, location: storage if location.startswith("cpu:") else None)


def latest_draft_checkpoint(out: Path) -> Path | None:
    """The newest complete checkpoint in a run's own --out: the trainer writes trainer_state.json last into each
    (after every process's part: Trainer above)."""
    from gorgon.train.run_folder import latest_checkpoint

    return latest_checkpoint(out / "checkpoints", "checkpoint", "trainer_state.json")


def train(cfg: DraftTrainConfig) -> Path:
    """The whole run: set up, distil the draft, then save it with its card (pushed when asked)."""
    from gorgon.train.run_folder import announce_result, lock_released_on_failure

    with lock_released_on_failure(Path(cfg.out), lambda: latest_draft_checkpoint(Path(cfg.out))):
        run = setup(cfg)
        trainer, weights = distil(run)
        metrics = save(run, trainer, weights)
    if metrics is None:  # not the main process
        return run.out
    if cfg.report_to == "wandb":  # wandb's closing lines first, so that the run's result ends the output
        import wandb

        wandb.finish()
    before, after = metrics["before"], metrics["after"]
    announce_result("gorgon draft", run.out, f"saved to {run.out} after {metrics['steps']} steps: over "
                    f"{after['tokens']} held-out answer tokens ({len(run.eval_ex)} conversations), KL to the target "
                    f"{before['kl']:.3f} -> {after['kl']:.3f} nats a token, top-1 agreement {before['top1']:.3f} -> "
                    f"{after['top1']:.3f}", cfg.push_to_hub,
                    f"gorgon bench --draft {run.out} --questions {in_checkout('scripts/data/mt_bench.jsonl')} "
                    "--update-card")
    return run.out


@dataclass
class Distillation:
    """What the phases of one distillation share: set up once, then distilled and saved."""

    cfg: DraftTrainConfig
    out: Path
    state: object                     # accelerate's PartialState
    resume_from: Path | None          # the checkpoint a resume continues from
    settings: dict                    # what each checkpoint records for a resume's check (resume_settings)
    target: object
    student: torch.nn.Module          # the draft; distil() puts the trained one here
    what: str                         # the student, in words
    train_ex: list[dict]
    eval_ex: list[dict]
    token_map: torch.Tensor | None    # the draft vocabulary (draft_vocab_size), else None
    coverage: dict | None             # the draft vocabulary's share of the training and held-out answers' tokens
    before: dict = field(default_factory=dict)  # held-out agreement with the target before distillation

    def held_out(self):
        """This process's share of the held-out conversations, in batches of 8."""
        from gorgon.train.examples import collate

        mine = self.eval_ex[self.state.process_index::self.state.num_processes]
        return (collate(mine[i:i + 8], self.target.tokenizer.pad_token_id) for i in range(0, len(mine), 8))


def setup(cfg: DraftTrainConfig) -> Distillation:
    """Everything checked before the slow parts (the settings, a resume's, --out, the data), then the target, the
    examples, the draft vocabulary and the student, measured against the target once before it trains."""
    from accelerate import PartialState
    from accelerate.utils import DistributedType

    from gorgon.heads.methods.draft_model.model import load_student
    from gorgon.heads.methods.draft_model.objective import agreement
    from gorgon.heads.target import load_target, target_text_config
    from gorgon.train.examples import answer_tokens, frequent_tokens, load_examples, read_conversations, split
    from gorgon.train.recipe import check_lora_targets, connect_cpu_processes, wandb_offline_without_key
    from gorgon.train.run_folder import prepare_output

    cfg.check()
    connect_cpu_processes()  # before anything creates accelerate's process state
    out = Path(cfg.out)
    resume_from = prepare_output(out, lambda: latest_draft_checkpoint(out), cfg)
    # The Trainer's wandb integration prints "[INFO] Running in WANDB offline mode" when it is first imported with
    # WANDB_MODE offline: imported before that is set, it says nothing.
    import transformers.integrations.integration_utils  # noqa: F401
    wandb_offline_without_key(cfg.report_to)
    os.environ.setdefault("WANDB_PROJECT", cfg.project)
    state = PartialState()
    if resume_from is not None:  # the settings, before the target and data load
        check_resume(resume_from, resume_settings(cfg, state.num_processes))
    sharded = state.distributed_type == DistributedType.FSDP or os.environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE") == "3"
    if cfg.lora and sharded:
        raise GorgonError("lora: true merges the adapters into the draft's whole weights at the end, which FSDP and "
                          "DeepSpeed ZeRO-3 shard: train a LoRA draft with DDP (configs/accelerate/multi_gpu.yaml), "
                          "or set lora: false")
    conversations = read_conversations(cfg.data)  # a bad --data fails before the target loads
    text_config = target_text_config(cfg.target)
    cfg.check_target(text_config)  # a draft vocabulary or a student that cannot fit it
    target = load_target(cfg.target, device=str(state.device), dtype=cfg.dtype)
    target.model.requires_grad_(False)
    if target.tokenizer.pad_token_id is None:
        target.tokenizer.pad_token_id = 0  # trl's trainer insists on one; padded positions are masked anyway
    examples = load_examples(cfg.data, target.tokenizer, cfg.max_length, target.fingerprints, conversations,
                             lambda line: state.print(f"gorgon draft: {line}", file=sys.stderr))
    settings = resume_settings(cfg, state.num_processes, data_sha256(examples))
    if resume_from is not None:  # again, now with the data's contents; then, for a finished run, the length
        check_resume(resume_from, settings)
        check_more_to_train(out, cfg)
    train_ex, eval_ex = split(examples, cfg.eval_fraction, cfg.seed)
    if not train_ex or not eval_ex:
        raise GorgonError(f"{cfg.data} has too few conversations to train on and hold out an eval split: add data "
                          "or change eval_fraction")
    token_map = coverage = None
    if cfg.draft_vocab_size:  # its share of the training answers' tokens, and of the held-out ones (drafting sees)
        token_map, train_share = frequent_tokens(train_ex, cfg.draft_vocab_size, text_config.vocab_size)
        held_out_share = float(torch.isin(answer_tokens(eval_ex), token_map).float().mean())
        coverage = {"train": train_share, "held_out": held_out_share}
    student, what = load_student(target, cfg.student, cfg.student_layers)
    if cfg.lora:
        check_lora_targets(student, cfg.lora_target_modules, "the draft")
    run = Distillation(cfg, out, state, resume_from, settings, target, student, what, train_ex, eval_ex, token_map,
                       coverage)
    run.before = agreement(student.eval(), target.model, run.held_out())
    state.print(f"gorgon draft: {what} ({sum(p.numel() for p in student.parameters()) / 1e6:.1f}M parameters) "
                f"before distillation: held-out KL {run.before['kl']:.3f}, top-1 agreement {run.before['top1']:.3f}",
                file=sys.stderr)
    return run


def distil(run: Distillation) -> tuple[object | None, dict | None]:
    """Train the student with trl's GKD trainer (from the checkpoint a resume continues): `run.student` becomes the
    distilled draft. Returns the trainer (None with max_steps 0: the untrained draft is saved) and the draft's
    weights gathered whole from every process's shards (None where the student's own are whole: LoRA's merged)."""
    from gorgon.train.recipe import full_state_dict

    if run.cfg.max_steps == 0:
        return None, None
    trainer = gkd_trainer(run.cfg, run.student, run.target, run.train_ex, run.out / "checkpoints", run.state.device,
                          run.settings, run.resume_from)
    if run.resume_from is not None:
        run.state.print(f"gorgon draft: resuming from {run.resume_from}", file=sys.stderr)
        read_indexed_cpu_locations()
    trainer.train(resume_from_checkpoint=str(run.resume_from) if run.resume_from else None)
    if run.cfg.lora:  # adapters merged into weights that are whole on every process (sharding is refused in setup)
        run.student = trainer.accelerator.unwrap_model(trainer.model).merge_and_unload()
        return trainer, None
    weights = full_state_dict(trainer.accelerator, trainer.model)  # every process: it gathers shards
    run.student = trainer.accelerator.unwrap_model(trainer.model)
    return trainer, weights


def save(run: Distillation, trainer, weights: dict | None) -> dict | None:
    """The draft saved (main process) and measured again as users load it, from the saved folder; then its
    metrics.json and card. Returns the metrics on the main process, None on the others."""
    from transformers import AutoModelForCausalLM

    from gorgon.heads.card import write_model_card
    from gorgon.heads.methods.draft_model.model import save_draft
    from gorgon.heads.methods.draft_model.objective import agreement
    from gorgon.heads.tree import chain_tau
    from gorgon.train.data import describe, hub_datasets
    from gorgon.train.run_folder import finish_run_folder, set_aside_earlier_run

    cfg, state, out, before = run.cfg, run.state, run.out, run.before
    if state.is_main_process:
        out.mkdir(parents=True, exist_ok=True)
        set_aside_earlier_run(out)
        save_draft(run.student, run.target.tokenizer, out, weights, run.token_map)
    state.wait_for_everyone()
    steps = trainer.state.global_step if trainer is not None else 0
    draft = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).to(state.device).eval()  # as users load it
    after = agreement(draft, run.target.model, run.held_out()) if steps else before
    if not state.is_main_process:
        return None
    if trainer is not None:  # into the trainer's log and wandb run, beside the training curves
        trainer.log({f"eval/{k}_{when}": v[k] for when, v in (("before", before), ("after", after))
                     for k in ("kl", "top1")})
    metrics = {
        "arch": "draft_model", "target_name": run.target.name, "target_fingerprint": run.target.fingerprint,
        "student": run.what, "student_parameters": sum(p.numel() for p in draft.parameters()),
        "target_parameters": sum(p.numel() for p in run.target.model.parameters()),
        "steps": steps, "train_conversations": len(run.train_ex), "eval_conversations": len(run.eval_ex),
        "processes": state.num_processes,
        "eval_tokens": after["tokens"], "before": before, "after": after, "draft_tokens": cfg.draft_tokens,
        "draft_vocab_size": cfg.draft_vocab_size, "draft_vocab_coverage": run.coverage,
        "data": describe(cfg.data), "datasets": hub_datasets(cfg.data),
        "data_sha256": run.settings["data_sha256"],
        "expected_tau": {"before": chain_tau(before["top1"], cfg.draft_tokens),
                         "after": chain_tau(after["top1"], cfg.draft_tokens)},
    }
    recipe = asdict(cfg)
    write_model_card(out, recipe, metrics)  # and metrics.json, with what the card says
    finish_run_folder(out, recipe)
    return metrics


def main(argv=None) -> int:
    from gorgon.train.recipe import recipe_main

    return recipe_main(DraftTrainConfig, train, __doc__, argv)


if __name__ == "__main__":
    from gorgon.heads.command import run_script

    run_script(main, "train/draft.py")
