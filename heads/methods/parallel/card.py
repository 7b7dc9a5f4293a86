"""A parallel drafter's model card."""

from __future__ import annotations

import json
from pathlib import Path

from ...card import card_metadata, data_line, heads_speed_and_use, tree_nodes
from ...target import EMBEDDED_NAME


def parallel_card(folder: Path, ref: str, recipe: dict, metrics: dict, hub: dict) -> str:
    """What the drafter reads, its block, how it was trained, its accuracy per block position, and usage."""
    saved = json.loads((folder / "config.json").read_text())
    target_name = metrics.get("target_name") or recipe.get("target") or EMBEDDED_NAME
    pairs = zip(metrics["top1"], metrics["top5"])
    rows = "\n".join(f"| {k + 1} | t+{k + 2} | {a:.3f} | {b:.3f} |" for k, (a, b) in enumerate(pairs))
    layers = ", ".join(map(str, saved["feature_layers"]))
    return f"""{card_metadata(hub, "gorgon", ["parallel-drafting", "speculative-decoding"])}

# A parallel draft head for {target_name}

A P-EAGLE-style drafter: the target's hidden states at layers {layers} and the next token's embedding, then
{saved['block_size'] - 1} learned mask positions, go through one decoder layer of the target's architecture, which
drafts all {saved['block_size']} positions in one forward; their top candidates form a tree of rank paths. Trained
with gorgon ({metrics['steps']} steps) on {data_line(recipe, metrics)}. Greedy decoding with it gives exactly the
target's own output.

## Held-out accuracy per block position (teacher-forced)

| position | drafts | top-1 | top-5 |
|---|---|---|---|
{rows}

![held-out accuracy per block position, and the training loss](head_accuracy.png)

A greedy chain with this top-1 would give {metrics['expected_tau']['cpu']:.2f} tokens per target forward with the
CPU tree ({tree_nodes(recipe, metrics)['cpu']} nodes).

{heads_speed_and_use(metrics, ref)}
"""
