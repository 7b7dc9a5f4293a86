"""Medusa heads' model card."""

from __future__ import annotations

from ...card import card_metadata, data_line, heads_speed_and_use, tree_nodes
from ...target import EMBEDDED_NAME, hub_name


def medusa_card(ref: str, recipe: dict, metrics: dict, hub: dict) -> str:
    """Medusa heads' card."""
    target_name = metrics.get("target_name") or recipe.get("target") or EMBEDDED_NAME
    rows = "\n".join(f"| {k + 1} | t+{k + 2} | {a:.3f} | {b:.3f} |"
                     for k, (a, b) in enumerate(zip(metrics["top1"], metrics["top5"])))
    lm_head = "the target's shared" if recipe["shared_lm_head"] else "their own"
    tau, nodes = metrics["expected_tau"], tree_nodes(recipe, metrics)
    base = hub_name(target_name)
    return f"""{card_metadata(hub, "gorgon", ["medusa", "speculative-decoding"])}

# Medusa heads for {target_name}

{recipe['num_heads']} draft heads ({recipe['num_layers']} residual block(s) each, {lm_head} LM head), trained
with gorgon ({recipe['mode']}, {recipe['loss']} loss, {metrics['steps']} steps) on {data_line(recipe, metrics)}.
Greedy decoding with these heads gives exactly the target's own output, only faster.

## Held-out accuracy

| head | predicts | top-1 | top-5 |
|---|---|---|---|
{rows}

![held-out accuracy per head, and the training loss](head_accuracy.png)

Expected tokens per target forward from these accuracies: {tau['cpu']:.2f} with the CPU tree
({nodes['cpu']} nodes), {tau['cuda']:.2f} with the GPU tree ({nodes['cuda']} nodes).

{heads_speed_and_use(metrics, ref)}

### In vLLM

```bash
gorgon export --heads {ref} --format vllm --out medusa-vllm
```
```python
from vllm import LLM
llm = LLM(model="{base}", speculative_config={{"method": "medusa", "model": "medusa-vllm",
                                                "num_speculative_tokens": {recipe['num_heads']}}})
```

### In TGI or TensorRT-LLM (FasterDecoding Medusa format)

```bash
gorgon export --heads {ref} --format medusa --out medusa-heads
```
TGI: point `--model-id` at `medusa-heads` (its config names the base model in `base_model_name_or_path`).
TensorRT-LLM: pass `--medusa_model_dir medusa-heads` to its Medusa checkpoint converter.
"""
