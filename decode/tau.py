"""Tokens per target forward (tau) of a drafter on a question set, with nothing timed.

tau depends on the drafter and the text, not on the machine's speed, so it can be measured beside
other work where `gorgon bench` cannot: drafters trained on more or less data (a learning curve),
tree-merging rules. The mean number of tree nodes verified per step comes with it: that is what a
step costs. Greedy; a second turn is asked after gorgon's own first answer (which is `generate`'s).
"""

from __future__ import annotations

from .generate import speculative_generate
from .questions import ask


class CountingDrafter:
    """Passes every call through to a drafter, counting the nodes of each tree it proposes."""

    def __init__(self, drafter):
        self.drafter, self.nodes = drafter, []
        self.feature_layers, self.max_nodes = drafter.feature_layers, drafter.max_nodes
        if hasattr(drafter, "check_target"):
            self.check_target = drafter.check_target
        if hasattr(drafter, "attach_cache"):  # self-speculation: it drafts in the target's own cache
            self.attach_cache = drafter.attach_cache

    @property
    def drafted(self):
        return self.drafter.drafted

    def propose(self, root, features, context):
        tokens, tree = self.drafter.propose(root, features, context)
        self.nodes.append(len(tokens))
        return tokens, tree


def measure_tau(target, drafter, questions: list[dict], max_new_tokens: int, progress: bool = True) -> dict:
    """{"tau", "nodes_per_step", "tokens", "per_category": {category: the same}} over the questions, with a
    progress bar on stderr (`progress`)."""
    from tqdm.auto import tqdm

    counting = CountingDrafter(drafter)
    totals: dict[str, list[int]] = {}  # category -> [tokens, target forwards, verify steps, nodes]
    for q in tqdm(questions, desc="tau", unit="question", disable=not progress, dynamic_ncols=True, leave=False):
        row = totals.setdefault(q["category"], [0, 0, 0, 0])

        def run_turn(ids):
            before = len(counting.nodes)
            result = speculative_generate(target.model, counting, ids, max_new_tokens)
            row[0] += len(result.tokens)
            row[1] += result.target_forwards
            row[2] += len(counting.nodes) - before
            row[3] += sum(counting.nodes[before:])
            return result.tokens

        ask(target, q, max_new_tokens, run_turn)

    def figures(rows):
        tokens, forwards, steps, nodes = (sum(r[i] for r in rows) for i in range(4))
        return {"tau": tokens / max(1, forwards), "nodes_per_step": nodes / max(1, steps), "tokens": tokens}

    report = figures(list(totals.values()))
    report["per_category"] = {c: figures([totals[c]]) for c in sorted(totals)}
    return report
