"""Conversation records: read from a file, a `datasets` folder or a hub dataset, in any of five shapes.

`messages_of` is the one parser of the shapes, for both uses: training examples keep every
message; prompts for self-distillation (`load_conversations`) keep the user turns only
({"id", "system", "turns"}), since the target regenerates the assistant's.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from gorgon.heads.errors import GorgonError, first_problem
from gorgon.heads.files import local_path_problem, looks_like_path, read_jsonl, read_text
from gorgon.heads.hub import not_found_locally_or_on_hub

SHAPES = ('MT-Bench/Spec-Bench {"turns": [...]}', 'ShareGPT {"conversations": [{"from", "value"}]}',
          'OpenAI {"messages": [{"role", "content"}]}', '{"prompt": ...}', 'Alpaca {"instruction", "input"}')
ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}
METADATA_NAME = "gorgon_data.json"  # what `gorgon data` writes beside its records: target, settings, counts


def messages_of(record: dict) -> list[dict] | None:
    """A record in any accepted shape as role/content messages (roles normalised, assistant turns kept);
    None when the shape is unknown."""
    if isinstance(record.get("messages"), list):
        pairs = [(m.get("role"), m.get("content", "")) for m in record["messages"] if isinstance(m, dict)]
    elif isinstance(record.get("conversations"), list):
        pairs = [(m.get("from"), m.get("value", "")) for m in record["conversations"] if isinstance(m, dict)]
    elif isinstance(record.get("turns"), list):
        pairs = [("user", t) for t in record["turns"]]
    elif isinstance(record.get("prompt"), str):
        pairs = [("user", record["prompt"])]
    elif isinstance(record.get("instruction"), str):
        extra = record.get("input") or ""
        pairs = [("user", record["instruction"] + (f"\n\n{extra}" if extra else ""))]
        if isinstance(record.get("output"), str):
            pairs.append(("assistant", record["output"]))
    else:
        return None
    return [{"role": ROLES.get(role, role), "content": content} for role, content in pairs]


def conversation(record: dict, index: int) -> dict | None:
    """A record's prompts: {"id", "system", "turns"} with the non-empty user turns; None when the shape is unknown."""
    messages = messages_of(record)
    if messages is None:
        return None
    turns = [m["content"] for m in messages if m["role"] == "user" and isinstance(m["content"], str)
             and m["content"].strip()]
    system = next((m["content"] for m in messages if m["role"] == "system"), None)
    ident = record.get("question_id", record.get("id", index))
    return {"id": str(ident), "system": system, "turns": turns}


def from_hub(source: str) -> bool:
    """Whether `read_records` reads `source` from the Hub: a name that is no file or folder here."""
    return not Path(source).exists()


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
        return read_dataset_folder(path)
    problem = local_path_problem(source)
    if problem:
        raise GorgonError(f"data source {problem}: pass a .jsonl/.json file or a dataset folder")
    if looks_like_path(source) or source.endswith((".json", ".jsonl")):
        raise GorgonError(f"data source {source} not found: pass a .jsonl/.json file, a dataset folder or "
                          "a hub dataset name")
    try:
        return list(datasets.load_dataset(source, split="train"))
    except Exception as err:  # the hub raises many types; all mean "not reachable or not there"
        raise not_found_locally_or_on_hub("dataset", source, err) from err


def read_dataset_folder(path: Path) -> list[dict]:
    """The records of a folder `Dataset.save_to_disk` wrote. One whose files are missing, cut short or edited
    fails in one line: `gorgon data` output is named as damaged, with how to make it again."""
    import datasets
    import pyarrow

    try:
        data = datasets.load_from_disk(str(path))
        if isinstance(data, datasets.DatasetDict):
            if not data:
                raise GorgonError(f"{path} is a `datasets` folder with no splits: it holds no records")
            data = data["train"] if "train" in data else next(iter(data.values()))
        return list(data)
    except (OSError, ValueError, KeyError, TypeError, pyarrow.ArrowException) as err:
        missing = isinstance(err, FileNotFoundError)
        if is_dataset(path):
            raise damaged_data(path, "a file it needs is missing" if missing else first_problem(err)) from err
        if missing:
            raise GorgonError(f"{path} is a folder but not a saved `datasets` dataset: pass a .jsonl file or a "
                              "folder written by Dataset.save_to_disk") from err
        raise GorgonError(f"{path} is a `datasets` folder that cannot be read ({first_problem(err)}): save it again "
                          "(Dataset.save_to_disk), or pass a .jsonl file") from err


def is_dataset(out: Path) -> bool:
    """A dataset folder `gorgon data` wrote (recognised by its metadata file)."""
    return (out / METADATA_NAME).is_file()


def damaged_data(folder: str | os.PathLike, problem: str) -> GorgonError:
    """The error for a dataset folder `gorgon data` wrote whose files were since lost, cut short or edited."""
    return GorgonError(f"{folder} is `gorgon data` output, damaged ({problem}): make it again by rerunning the "
                       "`gorgon data` command that wrote it, with --overwrite")


def load_conversations(source: str, limit: int | None = None) -> list[dict]:
    """Conversations from a prompt source, in source order, at most `limit`."""
    records = read_records(source)
    out = []
    for i, record in enumerate(records):
        conv = conversation(record, i) if isinstance(record, dict) else None
        if conv is None:
            keys = sorted(record)[:6] if isinstance(record, dict) else type(record).__name__
            raise GorgonError(f"{source} record {i + 1} has no shape gorgon reads (keys: {keys}); accepted shapes: "
                              + "; ".join(SHAPES))
        if conv["turns"]:
            out.append(conv)
        if limit is not None and len(out) >= limit:
            break
    if not out:
        raise GorgonError(f"{source} holds no prompts: it needs at least one non-empty user turn")
    return out
