"""Question sets in the MT-Bench format ({"question_id", "category", "turns": [...]} per line; Spec-Bench's
too): read, sampled per category, and asked turn by turn, as `gorgon bench` and the tau and trace scripts
ask them."""

from __future__ import annotations

from pathlib import Path

from gorgon.heads.errors import GorgonError
from gorgon.heads.files import read_jsonl
from gorgon.heads.target import context_length, fits_context


def load_questions(path: str, limit: int | None = None) -> list[dict]:
    """MT-Bench / Spec-Bench questions: {"question_id", "category", "turns": [...]} per line."""
    if Path(path).is_dir():
        raise GorgonError(f"questions file {path} is a folder: pass a .jsonl in the MT-Bench format "
                          '({"question_id", "category", "turns": [...]}), e.g. scripts/data/mt_bench.jsonl')
    if not Path(path).is_file():
        raise GorgonError(f"questions file {path} not found: pass a .jsonl in the MT-Bench format "
                          '({"question_id", "category", "turns": [...]}), e.g. scripts/data/mt_bench.jsonl')
    if limit is not None and limit < 1:
        raise GorgonError(f"--limit must be at least 1, not {limit}")
    questions = []
    for i, q in enumerate(read_jsonl(Path(path)), 1):
        if not isinstance(q, dict) or not isinstance(q.get("turns"), list) or not q["turns"] \
                or not all(isinstance(t, str) and t.strip() for t in q["turns"]):
            raise GorgonError(f"{path} record {i} has no usable 'turns' (a non-empty list of strings): each line "
                              'must look like {"question_id": 1, "category": "writing", "turns": ["..."]}')
        questions.append({"question_id": q.get("question_id", i), "category": q.get("category", "all"),
                          "turns": q["turns"]})
        if limit is not None and len(questions) >= limit:
            break
    if not questions:
        raise GorgonError(f"{path} holds no questions")
    return questions


def per_category_sample(questions: list[dict], count: int | None) -> list[dict]:
    """The first `count` questions of each category, in file order (all of them without a count)."""
    if count is None:
        return questions
    seen: dict[str, int] = {}
    picked = []
    for q in questions:
        seen[q["category"]] = seen.get(q["category"], 0) + 1
        if seen[q["category"]] <= count:
            picked.append(q)
    return picked


def ask(target, question: dict, max_new_tokens: int, answer) -> int:
    """Ask a question's turns in order, each after the conversation so far: `answer(ids)` runs one turn on its
    prompt ids and returns the reply's token ids, which become the assistant's message the next turn reads. A
    turn that no longer fits the target's context (with `max_new_tokens` to come) ends the question. Returns
    how many turns were asked."""
    context = context_length(target.model)
    messages = []
    for asked, turn in enumerate(question["turns"]):
        messages.append({"role": "user", "content": turn})
        ids = target.chat_ids(messages)
        if not fits_context(context, ids.shape[1], max_new_tokens):
            return asked
        reply = answer(ids)
        messages.append({"role": "assistant", "content": target.tokenizer.decode(reply, skip_special_tokens=True)})
    return len(question["turns"])
