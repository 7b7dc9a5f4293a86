"""A self-speculation exit's model card."""

from __future__ import annotations

import json
from pathlib import Path

from ...card import card_metadata, data_line, heads_speed_and_use, tree_nodes
from ...target import EMBEDDED_NAME


def self_spec_card(folder: Path, ref: str, recipe: dict, metrics: dict, hub: dict) -> str:
    """Which layers draft, the exit's size, how it was trained, its held-out accuracy, and usage."""
    saved = json.loads((folder / "config.json").read_text())
    target_name = metrics.get("target_name") or recipe.get("target") or EMBEDDED_NAME
    n, layers, width = saved["exit_layer"], saved["num_layers"], saved["adapter_size"]
    params = 3 * saved["hidden_size"] * width + saved["hidden_size"]
    return f"""{card_metadata(hub, "gorgon", ["self-speculation", "early-exit", "speculative-decoding"])}

# A self-speculation exit for {target_name}

The draft is the target itself: its first {n} of {layers} layers, then this exit (a gated MLP of width {width},
{params / 1e6:.2f}M parameters, before the target's own final norm and LM head). Drafting writes those layers'
keys and values into the target's own KV cache, and verification runs only layers {n} to {layers - 1} over the
drafted tokens. Trained with gorgon ({metrics['steps']} steps, the target frozen) on
{data_line(recipe, metrics)}. Greedy decoding with it gives exactly the target's own output.

## Held-out agreement with the target (teacher-forced)

| top-1 | top-5 |
|---|---|
| {metrics['top1'][0]:.3f} | {metrics['top5'][0]:.3f} |

A greedy chain with this top-1 would give {metrics['expected_tau']['cpu']:.2f} tokens per target forward with the
CPU tree ({tree_nodes(recipe, metrics)['cpu']} nodes).

{heads_speed_and_use(metrics, ref)}
"""
