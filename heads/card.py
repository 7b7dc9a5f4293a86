"""What a heads folder shows people: a per-head accuracy plot and a model card (README.md)."""

from __future__ import annotations

import json
from pathlib import Path

from .errors import GorgonError
from .files import atomic_write_text, check_writable, save_figure
from .target import EMBEDDED_HUB_ID, EMBEDDED_NAME


def plot_head_accuracy(metrics: dict, path: Path) -> None:
    """Bars of held-out top-1 and top-5 accuracy per head and, beside them, the training loss per head over
    the steps (from metrics.json's loss curve, when it has one)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    eagle = metrics.get("arch") == "eagle"
    rows = [f"step {h}" if eagle else f"head {h}" for h in range(1, len(metrics["top1"]) + 1)]
    curve = metrics.get("loss_curve") or []
    fig, axes = plt.subplots(1, 2 if curve else 1, figsize=(9.5 if curve else 5, 3.2), dpi=120, squeeze=False)
    ax = axes[0][0]
    heads = list(range(1, len(rows) + 1))
    width = 0.38
    ax.bar([h - width / 2 for h in heads], metrics["top5"], width, label="top-5", color="#9ecae1")
    ax.bar([h + width / 2 for h in heads], metrics["top1"], width, label="top-1", color="#3182bd")
    for h, a in zip(heads, metrics["top1"]):
        ax.text(h + width / 2, a + 0.01, f"{a:.2f}", ha="center", fontsize=8)
    # Rows: Medusa's heads, or a feature-level head's unrolled steps (step j drafts j tokens ahead of the root).
    ax.set_xticks(heads, [f"{row}\n(t+{h + 1})" for h, row in zip(heads, rows)])
    ax.set_ylim(0, 1)
    ax.set_ylabel("held-out accuracy")
    ax.set_title("feature-level head accuracy" if eagle else "Medusa head accuracy")
    ax.legend(loc="upper right", fontsize=8)
    if curve:
        loss = axes[0][1]
        steps = [step for step, _ in curve]
        for k, row in enumerate(rows):
            loss.plot(steps, [losses[k] for _, losses in curve], label=row, lw=1.2)
        loss.set_xlabel("training step")
        loss.set_ylabel("training loss")
        loss.set_title("training loss (over each logging window)")
        loss.legend(fontsize=8)
    save_figure(fig, path)


def check_card_folder(folder: Path) -> None:
    """Before a benchmark: can --update-card rebuild `folder`'s card? Training's recipe.json and metrics.json
    must be there and the folder writable, or the figures measured would be lost at the end."""
    if not ((folder / "recipe.json").is_file() and (folder / "metrics.json").is_file()):
        raise GorgonError(f"{folder} has no recipe.json/metrics.json, so its card cannot be rebuilt: "
                          "--update-card works on folders written by gorgon's training")
    check_writable(folder, "leave out --update-card (it rewrites the card there) and pass --out, or copy the folder "
                           "somewhere writable")


def refresh_model_card(folder: Path, bench: dict) -> None:
    """Rewrite a trained heads or draft folder's card with benchmark figures (`gorgon bench --update-card`)."""
    try:
        recipe = json.loads((folder / "recipe.json").read_text())
        metrics = json.loads((folder / "metrics.json").read_text())
    except FileNotFoundError as err:
        raise GorgonError(f"{folder} has no recipe.json/metrics.json, so its card cannot be rebuilt: "
                          "--update-card works on folders written by gorgon's training") from err
    write = write_draft_card if metrics.get("kind") == "draft" else write_model_card
    write(folder, recipe, metrics, bench)


def data_line(recipe: dict, metrics: dict) -> str:
    """The training data as training described it (size and prompts when `gorgon data` wrote it)."""
    return metrics.get("data") or f"`{recipe['data']}`"


def tree_nodes(recipe: dict, metrics: dict) -> dict:
    """The tree nodes per step that training saved for each device type (its metrics; a run from before they
    were recorded there always had them in its recipe)."""
    return metrics.get("tree_nodes") or {"cpu": recipe["cpu_tree_size"], "cuda": recipe["gpu_tree_size"]}


def speed_section(bench: dict | None, flag: str) -> str:
    """The card's benchmark table, or how to measure one."""
    if not bench:
        return (f"Not measured yet: `gorgon bench {flag} THIS_FOLDER --questions scripts/data/mt_bench.jsonl "
                "--update-card` adds tau and speedup here.")
    identical = "-" if bench["identical"] is None else f"{bench['identical']}/{bench['prompts']}"
    table = (f"| questions | tau | tokens/s | plain generate tokens/s | speedup | identical outputs |\n"
             f"|---|---|---|---|---|---|\n"
             f"| {bench['prompts']} | {bench['tau']:.2f} | {bench['tokens_per_s']:.1f} | "
             f"{bench['baseline_tokens_per_s']:.1f} | {bench['speedup']:.2f}x | {identical} |\n\n")
    if "speedup_vs_stock" in bench:
        same = "-" if bench["identical_vs_stock"] is None else f"{bench['identical_vs_stock']}/{bench['prompts']}"
        table += (f"Plain `generate` runs on the same CPU fast kernels as gorgon (`speedup`: what speculation alone "
                  f"gives). Against `generate` on torch's stock kernels ({bench['stock_tokens_per_s']:.1f} tokens/s), "
                  f"the end-to-end gain: **{bench['speedup_vs_stock']:.2f}x**, outputs identical {same}.\n\n")
    kernels = f", {bench['kernels']} kernels" if "kernels" in bench else ""
    if bench.get("cpu_flags") and bench["device"].startswith("cpu"):  # they decide which kernels are fast
        kernels += f" (CPU flags: {', '.join(bench['cpu_flags'])})"
    return table + (f"Measured on {bench['device']}, {bench['dtype']}, {bench['threads']} thread(s){kernels}, "
                    f"a tree of {bench['tree_size']} nodes, max {bench['max_new_tokens']} new tokens, by\n"
                    f"`{bench['command']}`")


def hub_id(target_name: str) -> str:
    """The card's base_model: the name as given, or the Hub id of the embedded target."""
    return EMBEDDED_HUB_ID if target_name == EMBEDDED_NAME else target_name


def write_model_card(out: Path, recipe: dict, metrics: dict, bench: dict | None = None) -> None:
    """README.md with Hub metadata, how the heads were trained, their measured accuracy, and usage."""
    if recipe.get("arch") == "eagle":
        return write_eagle_card(out, recipe, metrics, bench)
    target_name = metrics.get("target_name") or recipe.get("target") or EMBEDDED_NAME
    rows = "\n".join(f"| {k + 1} | t+{k + 2} | {a:.3f} | {b:.3f} |"
                     for k, (a, b) in enumerate(zip(metrics["top1"], metrics["top5"])))
    lm_head = "the target's shared" if recipe["shared_lm_head"] else "their own"
    tau, nodes = metrics["expected_tau"], tree_nodes(recipe, metrics)
    base = hub_id(target_name)
    text = f"""---
base_model: {base}
library_name: gorgon
tags:
- medusa
- speculative-decoding
---

# Medusa heads for {target_name}

{recipe['num_heads']} draft heads ({recipe['num_layers']} residual block(s) each, {lm_head} LM head), trained
with gorgon ({recipe['mode']}, {recipe['loss']} loss, {metrics['steps']} steps) on {data_line(recipe, metrics)}.
Greedy decoding with these heads gives exactly the target's own output, only faster.

## Held-out accuracy

| head | predicts | top-1 | top-5 |
|---|---|---|---|
{rows}

Expected tokens per target forward from these accuracies: {tau['cpu']:.2f} with the CPU tree
({nodes['cpu']} nodes), {tau['cuda']:.2f} with the GPU tree ({nodes['cuda']} nodes).

## Speed

{speed_section(bench, '--heads')}

## Use

```bash
gorgon generate --heads THIS_FOLDER --prompt "Hello"
```

```python
from gorgon.heads import load_target, MedusaHeads, HeadsDrafter
from gorgon.decode import speculative_generate

target = load_target({('"' + recipe['target'] + '"') if recipe.get('target') else ''})
heads = MedusaHeads.from_pretrained("THIS_FOLDER", target=target)
ids = target.tokenizer.apply_chat_template([{{"role": "user", "content": "Hello"}}], add_generation_prompt=True,
                                           return_tensors="pt", return_dict=True)["input_ids"]
result = speculative_generate(target.model, HeadsDrafter(heads), ids, max_new_tokens=128)
print(target.tokenizer.decode(result.tokens), result.tau)
```

### In vLLM

```bash
gorgon export --heads THIS_FOLDER --format vllm --out medusa-vllm
```
```python
from vllm import LLM
llm = LLM(model="{base}", speculative_config={{"method": "medusa", "model": "medusa-vllm",
                                                "num_speculative_tokens": {recipe['num_heads']}}})
```

### In TGI or TensorRT-LLM (FasterDecoding Medusa format)

```bash
gorgon export --heads THIS_FOLDER --format medusa --out medusa-heads
```
TGI: point `--model-id` at `medusa-heads` (its config names the base model in `base_model_name_or_path`).
TensorRT-LLM: pass `--medusa_model_dir medusa-heads` to its Medusa checkpoint converter.
"""
    atomic_write_text(out / "README.md", text)


def draft_vocab_line(metrics: dict) -> str:
    """The card's sentence on the saved draft vocabulary, if the draft has one (older metrics lack the keys)."""
    size = metrics.get("draft_vocab_size")
    if not size:
        return ""
    share = metrics["draft_vocab_coverage"]
    return (f"\nIn gorgon it drafts from its {size} most frequent answer tokens (`draft_vocab.safetensors`), through "
            f"an output layer cut to them: they are {share['train']:.1%} of the training answers' tokens and "
            f"{share['held_out']:.1%} of the held-out ones.\n")


def write_draft_card(out: Path, recipe: dict, metrics: dict, bench: dict | None = None) -> None:
    """README.md for a distilled draft model: what it started from, how close it follows the target, usage."""
    target_name = metrics["target_name"]
    base = hub_id(target_name)
    before, after, tau = metrics["before"], metrics["after"], metrics["expected_tau"]
    beta, lmbda = recipe["beta"], recipe["lmbda"]
    divergence = {0.0: "forward KL", 1.0: "reverse KL"}.get(beta, f"generalised JSD (beta {beta})")
    policy = f", {lmbda:.0%} of batches answered by the draft itself" if lmbda else ""
    how = (f"It was distilled with gorgon (trl GKD, {divergence}{policy}{', LoRA merged' if recipe['lora'] else ''},\n"
           f"{metrics['steps']} steps) on {data_line(recipe, metrics)}." if metrics["steps"] else
           "It is not distilled: saved with `--max_steps 0`, as the baseline that distillation is measured against.")
    text = f"""---
base_model: {base}
library_name: transformers
tags:
- speculative-decoding
- draft-model
- distillation
---

# Draft model for {target_name}

A {metrics['student_parameters'] / 1e6:.1f}M-parameter draft model for speculative decoding with {target_name}
({metrics['target_parameters'] / 1e6:.1f}M). It started from {metrics['student']}.
{how}

Speculative decoding with it gives exactly the target's own output; the draft only sets the speed.
{draft_vocab_line(metrics)}
## How closely it follows the target

On {metrics['eval_conversations']} held-out conversations ({metrics['eval_tokens']} answer tokens):

| | KL(target \\|\\| draft) | top-1 agreement | expected tokens per step ({metrics['draft_tokens']} drafted) |
|---|---|---|---|
| before distillation | {before['kl']:.3f} | {before['top1']:.3f} | {tau['before']:.2f} |
| after distillation | {after['kl']:.3f} | {after['top1']:.3f} | {tau['after']:.2f} |

Expected tokens per step assume each drafted token matches independently with the top-1 agreement.

## Speed

{speed_section(bench, '--draft')}

## Use

```bash
gorgon generate --draft THIS_FOLDER --draft-tokens {metrics['draft_tokens']} --prompt "Hello"
```

In transformers' own assisted generation:
```python
from transformers import AutoModelForCausalLM, AutoTokenizer
target = AutoModelForCausalLM.from_pretrained("{base}")
draft = AutoModelForCausalLM.from_pretrained("THIS_FOLDER")
tok = AutoTokenizer.from_pretrained("THIS_FOLDER")
ids = tok.apply_chat_template([{{"role": "user", "content": "Hello"}}], add_generation_prompt=True,
                              return_tensors="pt", return_dict=True)
out = target.generate(**ids, assistant_model=draft, do_sample=False, max_new_tokens=128)
```

In vLLM:
```python
from vllm import LLM
llm = LLM(model="{base}", speculative_config={{"model": "THIS_FOLDER",
                                                "num_speculative_tokens": {metrics['draft_tokens']}}})
```
"""
    atomic_write_text(out / "README.md", text)


def write_eagle_card(out: Path, recipe: dict, metrics: dict, bench: dict | None = None) -> None:
    """README.md for a feature-level head: what it reads, how it was trained, its accuracy, and usage."""
    target_name = metrics.get("target_name") or recipe.get("target") or EMBEDDED_NAME
    base = hub_id(target_name)
    pairs = zip(metrics["top1"], metrics["top5"])
    rows = "\n".join(f"| {k + 1} | {a:.3f} | {b:.3f} |" for k, (a, b) in enumerate(pairs))
    layers = ", ".join(map(str, json.loads((out / "config.json").read_text())["feature_layers"]))  # as saved
    text = f"""---
base_model: {base}
library_name: gorgon
tags:
- eagle
- speculative-decoding
---

# A feature-level draft head for {target_name}

An EAGLE-3-style head: the target's hidden states at layers {layers} and the next token's embedding go
through one decoder layer of the target's architecture, and it drafts a tree ranked by its confidence
each step (EAGLE-2). Trained with gorgon ({metrics['steps']} steps, {recipe['ttt_steps']} unrolled step(s))
on {data_line(recipe, metrics)}. Greedy decoding with it gives exactly the target's own output.

## Held-out accuracy (teacher-forced)

| step | top-1 | top-5 |
|---|---|---|
{rows}

A greedy chain with this top-1 would give {metrics['expected_tau']['cpu']:.2f} tokens per target forward with
the CPU tree ({tree_nodes(recipe, metrics)['cpu']} nodes); the ranked tree does better, as the bench below measures.

## Speed

{speed_section(bench, '--heads')}

## Use

```bash
gorgon generate --heads THIS_FOLDER --prompt "Hello"
```

### In vLLM or SGLang (EAGLE-3)

```bash
gorgon export --heads THIS_FOLDER --format eagle3 --out eagle3-head
```
```python
from vllm import LLM
llm = LLM(model="{base}", speculative_config={{"method": "eagle3", "model": "eagle3-head",
                                                "num_speculative_tokens": {recipe['draft_depth']}}})
```
`gorgon export --format speculators` writes the speculators format, which vLLM also reads.
"""
    atomic_write_text(out / "README.md", text)
