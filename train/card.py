"""What a heads folder shows people: a per-head accuracy plot and a model card (README.md)."""

from __future__ import annotations

import json
from pathlib import Path


def plot_head_accuracy(metrics: dict, path: Path) -> None:
    """Bars of held-out top-1 and top-5 accuracy per head."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    heads = list(range(1, len(metrics["top1"]) + 1))
    fig, ax = plt.subplots(figsize=(5, 3.2), dpi=120)
    width = 0.38
    ax.bar([h - width / 2 for h in heads], metrics["top5"], width, label="top-5", color="#9ecae1")
    ax.bar([h + width / 2 for h in heads], metrics["top1"], width, label="top-1", color="#3182bd")
    for h, a in zip(heads, metrics["top1"]):
        ax.text(h + width / 2, a + 0.01, f"{a:.2f}", ha="center", fontsize=8)
    ax.set_xticks(heads, [f"head {h}\n(t+{h + 1})" for h in heads])
    ax.set_ylim(0, 1)
    ax.set_ylabel("held-out accuracy")
    ax.set_title("Medusa head accuracy")
    ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def refresh_model_card(folder: Path, bench: dict) -> None:
    """Rewrite a trained heads folder's card with benchmark figures (from `gorgon bench --update-card`)."""
    from gorgon.heads.errors import GorgonError
    from gorgon.train.heads import HeadsTrainConfig

    try:
        cfg = HeadsTrainConfig(**json.loads((folder / "recipe.json").read_text()))
        metrics = json.loads((folder / "metrics.json").read_text())
    except FileNotFoundError as err:
        raise GorgonError(f"{folder} has no recipe.json/metrics.json, so its card cannot be rebuilt: "
                          "--update-card works on folders written by gorgon's training") from err
    write_model_card(folder, cfg, metrics, metrics.get("target_name") or cfg.target or "SmolLM2-135M-Instruct", bench)


def write_model_card(out: Path, cfg, metrics: dict, target_name: str, bench: dict | None = None) -> None:
    """README.md with Hub metadata, how the heads were trained, their measured accuracy, and usage."""
    data_meta = Path(cfg.data) / "gorgon_data.json"
    data_line = f"`{cfg.data}`"
    if data_meta.is_file():
        meta = json.loads(data_meta.read_text())
        data_line += (f": {meta['conversations']} conversations answered by the target itself "
                      f"(`gorgon data`, prompts `{meta['settings']['prompts']}`)")
    rows = "\n".join(f"| {k + 1} | t+{k + 2} | {a:.3f} | {b:.3f} |"
                     for k, (a, b) in enumerate(zip(metrics["top1"], metrics["top5"])))
    lm_head = "the target's shared" if cfg.shared_lm_head else "their own"
    tau = metrics["expected_tau"]
    base = target_name if "/" in target_name else f"HuggingFaceTB/{target_name}"
    speed = ("Not measured yet: `gorgon bench --heads THIS_FOLDER --questions scripts/data/mt_bench.jsonl "
             "--update-card` adds tau and speedup here.")
    if bench:
        identical = "-" if bench["identical"] is None else f"{bench['identical']}/{bench['prompts']}"
        speed = (f"| questions | tau | tokens/s | plain generate tokens/s | speedup | identical outputs |\n"
                 f"|---|---|---|---|---|---|\n"
                 f"| {bench['prompts']} | {bench['tau']:.2f} | {bench['tokens_per_s']:.1f} | "
                 f"{bench['baseline_tokens_per_s']:.1f} | {bench['speedup']:.2f}x | {identical} |\n\n"
                 f"Measured on {bench['device']}, {bench['dtype']}, {bench['threads']} thread(s), a tree of "
                 f"{bench['tree_size']} nodes, max {bench['max_new_tokens']} new tokens, by\n"
                 f"`{bench['command']}`")
    text = f"""---
base_model: {base}
library_name: gorgon
tags:
- medusa
- speculative-decoding
---

# Medusa heads for {target_name}

{cfg.num_heads} draft heads ({cfg.num_layers} residual block(s) each, {lm_head} LM head), trained with gorgon
({cfg.mode}, {cfg.loss} loss, {metrics['steps']} steps) on {data_line}.
Greedy decoding with these heads gives exactly the target's own output, only faster.

## Held-out accuracy

| head | predicts | top-1 | top-5 |
|---|---|---|---|
{rows}

Expected tokens per target forward from these accuracies: {tau['cpu']:.2f} with the CPU tree
({cfg.cpu_tree_size} nodes), {tau['cuda']:.2f} with the GPU tree ({cfg.gpu_tree_size} nodes).

## Speed

{speed}

## Use

```bash
gorgon generate --heads THIS_FOLDER --prompt "Hello"
```

```python
from gorgon.heads import load_target, MedusaHeads
from gorgon.decode import HeadsDrafter, speculative_generate

target = load_target({('"' + cfg.target + '"') if cfg.target else ''})
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
                                                "num_speculative_tokens": {cfg.num_heads}}})
```

### In TGI or TensorRT-LLM (FasterDecoding Medusa format)

```bash
gorgon export --heads THIS_FOLDER --format medusa --out medusa-heads
```
TGI: point `--model-id` at `medusa-heads` (its config names the base model in `base_model_name_or_path`).
TensorRT-LLM: pass `--medusa_model_dir medusa-heads` to its Medusa checkpoint converter.
"""
    (out / "README.md").write_text(text)
