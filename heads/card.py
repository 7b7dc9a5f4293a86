"""What a heads folder shows people: a per-head accuracy plot and a model card (README.md)."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import yaml

from .errors import GorgonError
from .files import atomic_write_text, save_figure
from .hub import is_hub_id
from .methods import recorded_method
from .outputs import check_writable
from .target import EMBEDDED_HUB_ID, EMBEDDED_LICENSE, EMBEDDED_NAME, hub_name


def plot_head_accuracy(metrics: dict, path: Path) -> None:
    """Bars of held-out top-1 and top-5 accuracy per head and, beside them, the training loss per head over
    the steps (from metrics.json's loss curve, when it has one)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    method = recorded_method(metrics)
    rows = [method.rows(h) for h in range(1, len(metrics["top1"]) + 1)]
    curve = metrics.get("loss_curve") or []
    fig, axes = plt.subplots(1, 2 if curve else 1, figsize=(9.5 if curve else 5, 3.2), dpi=120, squeeze=False)
    ax = axes[0][0]
    heads = list(range(1, len(rows) + 1))
    width = 0.38
    ax.bar([h - width / 2 for h in heads], metrics["top5"], width, label="top-5", color="#9ecae1")
    ax.bar([h + width / 2 for h in heads], metrics["top1"], width, label="top-1", color="#3182bd")
    for h, a in zip(heads, metrics["top1"]):
        ax.text(h + width / 2, a + 0.01, f"{a:.2f}", ha="center", fontsize=8)
    # Rows: Medusa's heads, or an EAGLE head's unrolled steps (step j drafts j tokens ahead of the root).
    ax.set_xticks(heads, [f"{row}\n(t+{h + 1})" for h, row in zip(heads, rows)])
    ax.set_ylim(0, 1)
    ax.set_ylabel("held-out accuracy")
    ax.set_title(f"{method.title}: held-out accuracy")
    ax.legend(loc="upper right", fontsize=8)
    if curve:
        loss = axes[0][1]
        steps = [step for step, _ in curve]
        few = len(curve) < 10  # a few logged windows show as points, at their steps (one alone drew no line)
        for k, row in enumerate(rows):
            loss.plot(steps, [losses[k] for _, losses in curve], label=f"{row} (t+{k + 2})", lw=1.2,
                      marker="o" if few else None, markersize=3)
        if few:
            loss.set_xticks(steps)
        loss.set_xlabel("training step")
        loss.set_ylabel("training loss")
        loss.set_title("training loss (over each logging window)")
        loss.legend(fontsize=8)
    save_figure(fig, path)


def check_card_folder(folder: Path) -> None:
    """Before a benchmark: can --update-card rebuild `folder`'s card? Training's recipe.json and metrics.json
    must be there and the folder writable, or the figures measured would be lost at the end; a card the user
    edited is not written over."""
    if not ((folder / "recipe.json").is_file() and (folder / "metrics.json").is_file()):
        raise GorgonError(f"{folder} has no recipe.json/metrics.json, so its card cannot be rebuilt: "
                          "--update-card works on folders written by gorgon's training")
    check_card_unedited(folder, "--update-card would write the new card over it: keep your changes elsewhere and "
                                "move it away, or leave out --update-card")
    check_writable(folder, "leave out --update-card (it rewrites the card there) and pass --out, or copy the folder "
                           "somewhere writable")


# A bench report's parts that the card does not show, left out of metrics.json.
PER_QUESTION = ("questions", "skipped", "per_category", "accepted_histogram")


def refresh_model_card(folder: Path, bench: dict, key: str = "bench") -> None:
    """Rewrite a trained heads or draft folder's card with benchmark figures (`gorgon bench --update-card`; `key`
    "batch_bench" for `--batch-sizes`); they are kept in its metrics.json too, so that a card made again (`gorgon
    push`'s) keeps them, and `gorgon export` reads the draft length per batch size from there."""
    try:
        recipe = json.loads((folder / "recipe.json").read_text())
        metrics = json.loads((folder / "metrics.json").read_text())
    except FileNotFoundError as err:
        raise GorgonError(f"{folder} has no recipe.json/metrics.json, so its card cannot be rebuilt: "
                          "--update-card works on folders written by gorgon's training") from err
    metrics[key] = {k: v for k, v in bench.items() if k not in PER_QUESTION}
    write_model_card(folder, recipe, metrics)


def card_as_written(folder: Path) -> bool | None:
    """Whether README.md of a training run's folder is the card gorgon last wrote there (its hash, kept in
    metrics.json); None where that cannot be told: no card, or none recorded (an earlier gorgon's)."""
    try:
        recorded = json.loads((folder / "metrics.json").read_text())["card"]["sha256"]
        return hashlib.sha256((folder / "README.md").read_bytes()).hexdigest() == recorded
    except (OSError, ValueError, KeyError, TypeError):
        return None


def check_card_unedited(folder: Path, why: str) -> None:
    """Refuse, before the work, to write a card over one the user edited."""
    if card_as_written(folder) is False:
        raise GorgonError(f"{folder / 'README.md'} is not the card gorgon wrote (edited?): {why}")


def card_for_run(folder: Path, ref: str) -> str | None:
    """The card of a training run's folder made again naming it `ref` (a Hub repo), where README.md is the card
    training (or `bench --update-card`) wrote, unedited; else None."""
    if not card_as_written(folder):  # edited, from an earlier gorgon, or not a run's folder
        return None
    try:
        recipe = json.loads((folder / "recipe.json").read_text())
        metrics = json.loads((folder / "metrics.json").read_text())
        return card_text(folder, recipe, metrics, ref)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def write_model_card(folder: Path, recipe: dict, metrics: dict) -> None:
    """README.md of a training run's folder (heads or a draft model). What the card says of the target and
    where it points (`card` in metrics.json) is decided once, here, so that the card made again for a push is
    the same wherever it runs; its hash tells that card from one the user edited."""
    metrics.setdefault("card", {"ref": recipe.get("push_to_hub") or os.fspath(folder),
                                "hub": hub_fields(recipe, metrics)})
    text = card_text(folder, recipe, metrics)
    metrics["card"]["sha256"] = hashlib.sha256(text.encode("utf-8")).hexdigest()
    atomic_write_text(folder / "metrics.json", json.dumps(metrics, indent=1) + "\n")
    atomic_write_text(folder / "README.md", text)


def card_text(folder: Path, recipe: dict, metrics: dict, ref: str | None = None) -> str:
    """The model card: Hub metadata, how it was trained, its measured accuracy and speed, and usage. Its commands
    name it `ref`: by default what it was written with (the Hub repo training pushed it to, else the folder;
    `gorgon push` passes the repo id)."""
    card = metrics.get("card") or {}
    ref = ref or card.get("ref") or recipe.get("push_to_hub") or os.fspath(folder)
    hub = card.get("hub") or hub_fields(recipe, metrics)
    return recorded_method(metrics).card(folder, ref, recipe, metrics, hub)


def hub_fields(recipe: dict, metrics: dict) -> dict:
    """What a card's metadata says of the model it builds on: `base_model` (a distilled draft's student, else the
    target) only where it is a Hub id, since the Hub refuses a card whose base_model is a local path, and with
    it the whole push; and the target's license keys where its own card says them: the heads learn from its
    outputs, so its terms are theirs; and the Hub datasets they learnt from (`datasets` in its metrics)."""
    target = metrics.get("target_name") or recipe.get("target") or EMBEDDED_NAME
    base = hub_name(recipe.get("student") or target)  # a distilled draft's recipe names the model it started from
    return {"base_model": base if is_hub_id(base) else None, "datasets": metrics.get("datasets", []),
            "license": target_license(target)}


def card_metadata(hub: dict, library: str, tags: list[str]) -> str:
    """The card's Hub metadata, the YAML between its --- lines (`hub`: from `hub_fields`)."""
    data = {"base_model": hub["base_model"]} if hub["base_model"] else {}
    if hub.get("datasets"):  # a card written before they were recorded has none
        data["datasets"] = hub["datasets"]
    data.update(hub["license"])
    data.update(library_name=library, pipeline_tag="text-generation", tags=tags)
    return "---\n" + yaml.safe_dump(data, sort_keys=False) + "---"


def short_card(repo_id: str, target_name: str | None, what: str, tag: str) -> str:
    """The card `push_to_hub` gives a repo without one: what the heads are, for which target, and how to load
    them (a training run's folder, pushed with `gorgon push`, has the full card with its figures)."""
    target_name = target_name or EMBEDDED_NAME
    hub = hub_fields({}, {"target_name": target_name})
    return f"""{card_metadata(hub, "gorgon", [tag, "speculative-decoding"])}

# {what} for {target_name}

Draft heads for speculative decoding with gorgon, saved with
`push_to_hub`. Greedy decoding with them gives exactly the target's own output, only faster.

```bash
gorgon generate --heads {repo_id} --prompt "Hello"
```

```python
from gorgon.heads import drafter_for, load_heads
from gorgon.decode import speculative_generate

target, heads = load_heads("{repo_id}")
ids = target.chat_ids([{{"role": "user", "content": "Hello"}}])
result = speculative_generate(target, drafter_for(heads), ids, max_new_tokens=128)
print(target.tokenizer.decode(result.tokens), result.tau)
```
"""


def hub_card(repo_id: str) -> str | None:
    """A Hub model's README.md: from the cache, else downloaded where the Hub is on (loading a model does not
    fetch it); None where neither gives it."""
    from huggingface_hub import hf_hub_download, is_offline_mode, try_to_load_from_cache

    cached = try_to_load_from_cache(repo_id, "README.md")
    if isinstance(cached, str) or is_offline_mode():
        return cached if isinstance(cached, str) else None
    try:
        return hf_hub_download(repo_id, "README.md")
    except Exception:  # the hub client raises many types; a card is best effort: no license is then named
        return None


def target_license(target_name: str) -> dict:
    """The target's license keys (license, license_name, license_link) as its own card states them: the
    embedded target's, a local target's README.md, or a Hub target's (`hub_card`). {} where no card is at hand
    (the heads' card then names none: a license is not guessed)."""
    from huggingface_hub import metadata_load

    if hub_name(target_name) == EMBEDDED_HUB_ID:
        return {"license": EMBEDDED_LICENSE}
    local = Path(target_name).expanduser() / "README.md"
    card = local if local.is_file() else hub_card(target_name) if is_hub_id(target_name) else None
    if card is None:
        return {}
    try:
        metadata = metadata_load(card) or {}
    except (OSError, ValueError, yaml.YAMLError):
        return {}
    return {key: metadata[key] for key in ("license", "license_name", "license_link") if key in metadata}


def data_line(recipe: dict, metrics: dict) -> str:
    """The training data as training described it (size and prompts when `gorgon data` wrote it), and the
    target's quantization where it trained on a quantized one."""
    data = metrics.get("data") or f"`{recipe['data']}`"
    scheme = recipe.get("quantize", "none")
    return data if scheme == "none" else f"{data}, with the target quantized {scheme} (`quantize: {scheme}`)"


def tree_nodes(recipe: dict, metrics: dict) -> dict:
    """The tree nodes per step that training saved for each device type (its metrics; a run from before they
    were recorded there always had them in its recipe)."""
    return metrics.get("tree_nodes") or {"cpu": recipe["cpu_tree_size"], "cuda": recipe["gpu_tree_size"]}


def speed_section(bench: dict | None, flag: str, ref: str) -> str:
    """The card's benchmark table, or how to measure one."""
    if not bench:
        return (f"Not measured yet: `gorgon bench {flag} {ref} --questions scripts/data/mt_bench.jsonl` measures "
                "tau and speedup (with `--update-card`, run on the training run's folder, they are written here).")
    identical = "-" if bench["identical"] is None else f"{bench['identical']}/{bench['prompts']}"
    table = (f"| questions | tau | tokens/s | plain generate tokens/s | speedup | identical outputs |\n"
             f"|---|---|---|---|---|---|\n"
             f"| {bench['prompts']} | {bench['tau']:.2f} | {bench['tokens_per_s']:.1f} | "
             f"{bench['baseline_tokens_per_s']:.1f} | {bench['speedup']:.2f}x | {identical} |\n\n")
    if "speedup_vs_stock" in bench:
        same = "-" if bench["identical_vs_stock"] is None else f"{bench['identical_vs_stock']}/{bench['prompts']}"
        float_weights = " on its float weights" if bench.get("quantize", "none") != "none" else ""
        table += (f"Plain `generate` runs on the same CPU fast kernels as gorgon (`speedup`: what speculation alone "
                  f"gives). Against `generate` on torch's stock kernels{float_weights} "
                  f"({bench['stock_tokens_per_s']:.1f} tokens/s), the end-to-end gain: "
                  f"**{bench['speedup_vs_stock']:.2f}x**, outputs identical {same}.\n\n")
    kernels = f", {bench['kernels']} kernels" if "kernels" in bench else ""
    if bench.get("quantize", "none") != "none":
        kernels += f", the target quantized {bench['quantize']} (`--quantize {bench['quantize']}`)"
    if bench.get("cpu_flags") and bench["device"].startswith("cpu"):  # they decide which kernels are fast
        kernels += f" (CPU flags: {', '.join(bench['cpu_flags'])})"
    return table + (f"Measured on {bench['device']}, {bench['dtype']}, {bench['threads']} thread(s){kernels}, "
                    f"a tree of {bench['tree_size']} nodes, max {bench['max_new_tokens']} new tokens, by\n"
                    f"`{bench['command']}`")


def batch_section(report: dict | None) -> str:
    """The card's speedup by batch size (`gorgon bench --batch-sizes`) and the schedule engines take; empty where
    none was measured."""
    if not report:
        return ""
    rows = "".join(f"| {e['batch']} | {e['tau']:.2f} | {e['tokens_per_s']:.1f} | {e['baseline_tokens_per_s']:.1f} | "
                   f"{e['speedup']:.2f}x | {e['identical']}/{e['rows']} |\n" for e in report["batches"])
    return (f"\n\n### Under load\n\nRequests decoded together (distinct questions' first turns), gorgon's batched "
            f"decoder against batched `generate`:\n\n| batch | tau | tokens/s | generate tokens/s | speedup | "
            f"rows identical to their own `generate` |\n|---|---|---|---|---|---|\n{rows}\nDraft tokens per batch "
            f"size (vLLM's "
            f"`num_speculative_tokens_per_batch_size`, which `gorgon export` writes into its serving command): "
            f"`{json.dumps(report['schedule'])}`. Measured on {report['device']}, {report['threads']} thread(s)"
            + ("" if report.get("quantize", "none") == "none" else f", the target quantized {report['quantize']}")
            + ", by\n"
            f"`{report['command']}`")


def heads_speed_and_use(metrics: dict, ref: str) -> str:
    """A heads card's Speed and Use sections: the bench's table (or how to measure one), then gorgon's command
    and Python."""
    return f"""## Speed

{speed_section(metrics.get('bench'), '--heads', ref)}{batch_section(metrics.get('batch_bench'))}

## Use

```bash
gorgon generate --heads {ref} --prompt "Hello"
```

{python_use(ref)}"""


def python_use(ref: str) -> str:
    """A card's Python: the heads at `ref` loaded as `gorgon generate --heads` loads them (onto their target, a
    Medusa-2 adapter merged into it, the tree sized for the machine), then one answer."""
    return f"""```python
from gorgon.decode import from_options, speculative_generate

target, drafter = from_options(heads="{ref}")
ids = target.chat_ids([{{"role": "user", "content": "Hello"}}])
result = speculative_generate(target.model, drafter, ids, max_new_tokens=128)
print(target.tokenizer.decode(result.tokens), result.tau)
```"""
