"""Prompt sources for self-distillation: files, datasets on disk, hub datasets, or the target itself.

Every source becomes a list of conversations, each {"id", "system", "turns"}: the user turns in
order (assistant turns are dropped, since the target regenerates them).
"""

from __future__ import annotations

import json
from pathlib import Path

from gorgon.heads.errors import GorgonError
from gorgon.heads.files import local_path_problem, looks_like_path, not_found_locally_or_on_hub, read_jsonl, read_text

SHAPES = ('MT-Bench/Spec-Bench {"turns": [...]}', 'ShareGPT {"conversations": [{"from", "value"}]}',
          'OpenAI {"messages": [{"role", "content"}]}', '{"prompt": ...}', 'Alpaca {"instruction", "input"}')
_USER_ROLES = {"human", "user"}


def conversation(record: dict, index: int) -> dict | None:
    """One record in any accepted shape as a conversation; None when the shape is unknown."""
    system = None
    if isinstance(record.get("turns"), list):
        turns = [t for t in record["turns"] if isinstance(t, str)]
    elif isinstance(record.get("conversations"), list):
        msgs = record["conversations"]
        turns = [m.get("value", "") for m in msgs if m.get("from") in _USER_ROLES]
        system = next((m.get("value") for m in msgs if m.get("from") == "system"), None)
    elif isinstance(record.get("messages"), list):
        msgs = record["messages"]
        turns = [m.get("content", "") for m in msgs if m.get("role") in _USER_ROLES]
        system = next((m.get("content") for m in msgs if m.get("role") == "system"), None)
    elif isinstance(record.get("prompt"), str):
        turns = [record["prompt"]]
    elif isinstance(record.get("instruction"), str):
        extra = record.get("input") or ""
        turns = [record["instruction"] + (f"\n\n{extra}" if extra else "")]
    else:
        return None
    turns = [t for t in turns if isinstance(t, str) and t.strip()]
    ident = record.get("question_id", record.get("id", index))
    return {"id": str(ident), "system": system, "turns": turns}


def read_records(source: str) -> list[dict]:
    """Records from a .jsonl/.json file, a `datasets` folder, or a hub dataset name."""
    path = Path(source)
    if path.is_file():
        if path.suffix == ".json":
            try:
                data = json.loads(read_text(path))
            except json.JSONDecodeError as err:
                raise GorgonError(f"{source} is not valid JSON (line {err.lineno}): fix it or use .jsonl") from err
            return data if isinstance(data, list) else [data]
        return read_jsonl(path)
    import datasets

    if path.is_dir():
        try:
            data = datasets.load_from_disk(str(path))
        except FileNotFoundError as err:
            raise GorgonError(f"{source} is a folder but not a saved `datasets` dataset: pass a .jsonl file or a "
                              "folder written by Dataset.save_to_disk") from err
        if isinstance(data, datasets.DatasetDict):
            if not data:
                raise GorgonError(f"{source} is a `datasets` folder with no splits: it holds no records")
            data = data["train"] if "train" in data else next(iter(data.values()))
        return list(data)
    problem = local_path_problem(source)
    if problem:
        raise GorgonError(f"prompt source {problem}: pass a .jsonl/.json file or a dataset folder")
    if looks_like_path(source) or source.endswith((".json", ".jsonl")):
        raise GorgonError(f"prompt source {source} not found: pass a .jsonl/.json file, a dataset folder, "
                          "a hub dataset name, or 'self'")
    try:
        return list(datasets.load_dataset(source, split="train"))
    except Exception as err:  # the hub raises many types; all mean "not reachable or not there"
        raise not_found_locally_or_on_hub("dataset", source, err) from err


def load_conversations(source: str, limit: int | None = None) -> list[dict]:
    """Conversations from a prompt source, in source order, at most `limit`."""
    records = read_records(source)
    out = []
    for i, record in enumerate(records):
        conv = conversation(record, i) if isinstance(record, dict) else None
        if conv is None:
            keys = sorted(record)[:6] if isinstance(record, dict) else type(record).__name__
            raise GorgonError(f"{source} record {i} has an unknown shape (keys: {keys}); accepted shapes: "
                              + "; ".join(SHAPES))
        if conv["turns"]:
            out.append(conv)
        if limit is not None and len(out) >= limit:
            break
    if not out:
        raise GorgonError(f"{source} holds no prompts: it needs at least one non-empty user turn")
    return out


def user_prefix(tokenizer) -> str:
    """The chat template's text up to where a user message begins (what Magpie feeds the model)."""
    marker = "\u2063GORGON\u2063"
    text = tokenizer.apply_chat_template([{"role": "user", "content": marker}], tokenize=False)
    if marker not in text:
        raise GorgonError("the chat template does not place the user message verbatim, so `self` prompts cannot be "
                          "drawn from it: pass --prompts with a file instead")
    return text[: text.index(marker)]
