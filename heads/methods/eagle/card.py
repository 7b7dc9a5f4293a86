"""An EAGLE head's model card."""

from __future__ import annotations

import json
from pathlib import Path

from ...card import card_metadata, data_line, heads_speed_and_use, tree_nodes
from ...target import EMBEDDED_NAME, hub_name


def eagle_card(folder: Path, ref: str, recipe: dict, metrics: dict, hub: dict) -> str:
    """An EAGLE head's card: what it reads (its feature layers as saved), how it was trained, its accuracy,
    and usage."""
    feature_layers = json.loads((folder / "config.json").read_text())["feature_layers"]
    target_name = metrics.get("target_name") or recipe.get("target") or EMBEDDED_NAME
    base = hub_name(target_name)
    pairs = zip(metrics["top1"], metrics["top5"])
    rows = "\n".join(f"| {k + 1} | {a:.3f} | {b:.3f} |" for k, (a, b) in enumerate(pairs))
    layers = ", ".join(map(str, feature_layers))
    return f"""{card_metadata(hub, "gorgon", ["eagle", "speculative-decoding"])}

# An EAGLE draft head for {target_name}

An EAGLE-3-style head: the target's hidden states at layers {layers} and the next token's embedding go
through one decoder layer of the target's architecture, and it drafts a tree ranked by its confidence
each step (EAGLE-2). Trained with gorgon ({metrics['steps']} steps, {recipe['ttt_steps']} unrolled step(s))
on {data_line(recipe, metrics)}. Greedy decoding with it gives exactly the target's own output.

## Held-out accuracy (teacher-forced)

| step | top-1 | top-5 |
|---|---|---|
{rows}

![held-out accuracy per unrolled step, and the training loss](head_accuracy.png)

A greedy chain with this top-1 would give {metrics['expected_tau']['cpu']:.2f} tokens per target forward with
the CPU tree ({tree_nodes(recipe, metrics)['cpu']} nodes); the ranked tree does better, as the bench below measures.

{heads_speed_and_use(metrics, ref)}

### In vLLM or SGLang (EAGLE-3)

```bash
gorgon export --heads {ref} --format eagle3 --out eagle3-head
```
```python
from vllm import LLM
llm = LLM(model="{base}", speculative_config={{"method": "eagle3", "model": "eagle3-head",
                                                "num_speculative_tokens": {recipe['draft_depth']}}})
```
`gorgon export --format speculators` writes the speculators format, which vLLM also reads.
"""
