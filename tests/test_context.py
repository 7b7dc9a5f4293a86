"""Drafting from the context: lookup on hand-made sequences, merged trees, exact decoding, bad input."""

import pytest
import torch
from helpers import VOCAB, tiny_model

from gorgon.decode import speculative_generate
from gorgon.heads import (
    ContextDrafter,
    DraftModelDrafter,
    EagleDrafter,
    EagleHead,
    GorgonError,
    MedusaDrafter,
    MedusaHeads,
    MergedDrafter,
)
from gorgon.heads.methods.context.drafter import lookup
from gorgon.heads.tree import token_paths, tree_from_token_paths


def test_lookup_finds_the_latest_longest_match():
    assert lookup([1, 2, 3, 9, 1, 2, 3, 7, 5, 1, 2, 3], max_ngram=3, length=4, branches=2) == \
        (3, [[7, 5, 1, 2], [9, 1, 2, 3]])                  # latest first; two continuations, distinct first tokens
    assert lookup([1, 2, 3, 9, 1, 2, 3, 9, 8, 1, 2, 3], 3, 3, 2) == (3, [[9, 8, 1]])  # the same first token: one
    assert lookup([4, 5, 6, 7], 3, 4, 2) == (0, [])           # nothing repeats
    assert lookup([5, 1, 2, 8, 2], 3, 2, 1) == (1, [[8, 2]])  # falls back to the longest n-gram that occurred: [2]
    assert lookup([1, 1, 1, 1], 3, 5, 2) == (3, [[1]])         # overlapping matches: the continuation ends at the text
    assert lookup([7], 3, 2, 2) == (0, [])                     # too short to repeat


def test_a_chain_grows_with_the_run_the_text_has_copied():
    copied = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 50, 1, 2, 3, 4, 5, 6, 7, 8]  # 1 .. 8 copied so far
    assert lookup(copied, 3, 5, 2)[1] == [[9, 10, 11, 12, 50]]                     # no growth by default
    assert lookup(copied, 3, 5, 2, max_length=10)[1] == [[9, 10, 11, 12, 50, 1, 2, 3]]  # as long as the run: 8
    assert lookup(copied, 3, 2, 2, max_length=4)[1] == [[9, 10, 11, 12]]           # at most max_length
    fresh = [9, 1, 2, 3, 7, 5, 6, 4, 8, 1, 2, 3]  # the match reaches no further back than its 3-gram
    assert lookup(fresh, 3, 2, 2, max_length=10)[1] == [[7, 5, 6]]                 # run 3: the usual 2, then 3
    at_start = [1, 2, 3, 9, 8, 7, 3, 1, 2, 3]  # the match begins the text: nothing before it to compare
    assert lookup(at_start, 3, 2, 2, max_length=10)[1] == [[9, 8, 7]]              # run 3, not 4


class Fixed:
    """A drafter with known candidates: tokens 10 and 11 under the root, 12 under 10, with their chances."""

    feature_layers, max_nodes = None, 4
    scored = [([10], 0.6), ([10, 12], 0.3), ([11], 0.2)]

    def propose(self, root, features, context):
        return tree_from_token_paths(root, [path for path, _ in self.scored])

    def scored_paths(self, root, features, context):
        return self.scored


def test_merged_trees_take_the_likeliest_candidates_once():
    tokens, tree = tree_from_token_paths(torch.tensor(5), [[3, 7, 5], [3, 9, 1], [8], [3, 7]])
    assert sorted(token_paths(tokens, tree)) == [(3,), (3, 7), (3, 7, 5), (3, 9), (3, 9, 1), (8,)]  # (3, 7) once
    root_only, single = tree_from_token_paths(torch.tensor(5), [])
    assert single.size == 1 and root_only.tolist() == [5]

    # Lookup proposes 10, 12, 6, 1 (after 1, 2, 3); a context drafter that has judged nothing yet gives
    # each depth 1/2: chances 0.5, 0.25, 0.125, 0.0625. (10,) and (10, 12) are proposed by both and keep
    # the higher chance: (10,) 0.6, (10, 12) 0.3, (11,) 0.2, (10, 12, 6) 0.125, (10, 12, 6, 1) 0.0625.
    context = torch.tensor([1, 2, 3, 10, 12, 6, 1, 2])
    for budget, expected in [(2, [(10,)]), (4, [(10,), (10, 12), (11,)]),
                             (6, [(10,), (10, 12), (11,), (10, 12, 6), (10, 12, 6, 1)])]:
        merged = MergedDrafter(Fixed(), ContextDrafter(max_ngram=3, length=4, branches=1), budget)
        tokens, tree = merged.propose(torch.tensor(3), torch.zeros(0, 1), context)
        assert tree.size == budget and sorted(token_paths(tokens, tree)) == sorted(expected)
        assert tokens[0] == 3 and merged.max_nodes == budget
    # Sized per step: flat verify costs take every candidate the budget allows; steep ones (a forward
    # over two tokens costs two steps) none, since 1.6 expected tokens do not pay for twice the time.
    for costs, size in [({1: 1.0, 16: 1.0}, 6), ({1: 1.0, 2: 2.0, 16: 16.0}, 1)]:
        merged = MergedDrafter(Fixed(), ContextDrafter(max_ngram=3, length=4, branches=1), budget=6, costs=costs)
        assert merged.propose(torch.tensor(3), torch.zeros(0, 1), context)[1].size == size
    assert MergedDrafter(Fixed(), ContextDrafter()).max_nodes == 16  # the default cap

    class Unsure(Fixed):  # proposes (10,) less likely than the context does (0.5)
        scored = [([11], 0.4), ([10], 0.3)]

    merged = MergedDrafter(Unsure(), ContextDrafter(max_ngram=3, length=4, branches=1), budget=2)
    assert token_paths(*merged.propose(torch.tensor(3), torch.zeros(0, 1), context)) == [(10,)]  # the higher: 0.5


def test_context_chances_follow_what_the_target_accepted():
    drafter = ContextDrafter(max_ngram=3, length=4, branches=1)

    def chances(root, features_for, context):  # the decoder's features: one row per token new since the last call
        return [c for _, c in drafter.scored_paths(torch.tensor(root), torch.zeros(features_for, 1), context)]

    context = torch.tensor([1, 2, 3, 10, 12, 6, 1, 2])
    assert chances(3, 8, context) == [0.5, 0.25, 0.125, 0.0625]
    # The target accepted 10 and 12, then wrote 7 where the chain had 6: depths 1 and 2 right, 3 wrong.
    later = torch.cat([context, torch.tensor([3, 10, 12])])  # the last root, then the two accepted tokens
    chances(7, 3, later)
    assert drafter.record == {(3, 0, 1): [1, 1], (3, 0, 2): [1, 1], (3, 0, 3): [0, 1]}
    # A chain from a 3-gram is now likelier at depths 1-2 (2/3 each) and less so at 3 (1/3).
    again = torch.tensor([5, 1, 2, 3, 8, 9, 4, 1, 2])
    assert chances(3, 9, again)[:3] == pytest.approx([2 / 3, 4 / 9, 4 / 27])
    # A new prompt is never judged against the last proposal, even one that extends the last text
    # (a second turn after the first answer): its features cover all of it.
    record = {k: list(v) for k, v in drafter.record.items()}
    chances(3, 12, torch.cat([again, torch.tensor([3, 8, 9])]))
    assert drafter.record == record


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_greedy_equals_generate_with_context_and_merged_drafters(arch):
    model = tiny_model(arch)
    # A prompt that repeats itself, so lookup has something to copy, and heads beside it.
    torch.manual_seed(0)
    ids = torch.randint(0, VOCAB, (1, 6)).repeat(1, 3)
    reference = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=30, do_sample=False)
    reference = reference[0, ids.shape[1]:].tolist()
    heads = MedusaDrafter(MedusaHeads.for_target(model, num_heads=2), tree=[[0], [1], [0, 0]])
    costs = {1: 1.0, 4: 1.1, 16: 2.0}  # as a CPU measures them: a few tokens cost about one
    drafters = [ContextDrafter(), ContextDrafter(1, 8, 3), ContextDrafter(3, 2, 2, max_length=9),
                MergedDrafter(heads, ContextDrafter()), MergedDrafter(heads, ContextDrafter(3, 2, 2, 9)),
                MergedDrafter(heads, ContextDrafter(2, 3, 2), budget=3),
                MergedDrafter(heads, ContextDrafter(), costs=costs),
                MergedDrafter(DraftModelDrafter(tiny_model(arch), k=3), ContextDrafter(), 6)]
    if arch == "llama":  # EAGLE heads need Llama-shaped layers
        eagle = EagleDrafter(EagleHead.for_target(model), nodes=4, depth=2, topk=2)
        drafters += [MergedDrafter(eagle, ContextDrafter()), MergedDrafter(eagle, ContextDrafter(), costs=costs)]
    for drafter in drafters:
        result = speculative_generate(model, drafter, ids, max_new_tokens=30)
        assert result.tokens == reference
        assert max(result.accepted) >= 2  # copied candidates were accepted, not only bonus tokens


def test_bad_settings_are_one_line():
    with pytest.raises(GorgonError, match="the n-gram size must be a whole number >= 1, not 0"):
        ContextDrafter(max_ngram=0)
    with pytest.raises(GorgonError, match="context draft length must be a whole number >= 1"):
        ContextDrafter(length=0)
    with pytest.raises(GorgonError, match=r"the longest context draft \(--context-max-tokens, max_length: 3\) must be "
                                          r"a whole number at least the context draft length \(--context-tokens, "
                                          r"length: 5\): raise it"):
        ContextDrafter(length=5, max_length=3)
    with pytest.raises(GorgonError, match="a merged tree needs a budget of 2 .* to 256 nodes, not 0"):
        MergedDrafter(Fixed(), ContextDrafter(), budget=0)

    class Unranked:
        feature_layers, max_nodes = None, 4

    with pytest.raises(GorgonError, match="Unranked does not rank its candidates by chance .* use it without "
                                          "--context-draft"):
        MergedDrafter(Unranked(), ContextDrafter())


@pytest.mark.slow
def test_cli_takes_context_drafts_alone_and_merged(tmp_path, capsys):
    import json

    from helpers import QUESTIONS, chat_target_with_heads, questions_file

    from gorgon.heads.cli import main as gorgon

    target_path, _, _ = chat_target_with_heads(tmp_path)
    common = ["--target", str(target_path), "--max-new-tokens", "8"]
    assert gorgon(["generate", "--context-draft", "--prompt", "count count count", "--stats"] + common) == 0
    questions = questions_file(tmp_path / "q.jsonl", QUESTIONS[:2])
    out = tmp_path / "bench.json"
    assert gorgon(["bench", "--heads", str(tmp_path / "heads"), "--context-draft", "--tree", "3", "--questions",
                   str(questions), "--baselines", "generate,prompt-lookup,no-context", "--out", str(out)] + common) == 0
    report = json.loads(out.read_text())
    assert report["drafter"].endswith(" + context") and report["identical"] == 2 and report["tree"] == "built per step"
    assert report["context_draft"] == {"ngram": 3, "tokens": 5, "max_tokens": 10, "branches": 2}
    assert "prompt-lookup_speedup" in report and report["no-context_identical"] == 2
    tokens, forwards = ([q[f"no-context_{k}"] for q in report["questions"]] for k in ("tokens", "target_forwards"))
    assert report["no-context_tau"] == pytest.approx(sum(tokens) / sum(forwards))  # pooled, as tau is
    assert "no-context tau" in capsys.readouterr().out
    no_merge = ["bench", "--context-draft", "--questions", str(questions), "--baselines", "no-context"]
    assert gorgon(no_merge + common) == 2
    assert capsys.readouterr().err.strip().endswith("--baselines no-context times the --heads or --draft drafter "
                                                    "without the context draft: it needs --context-draft together "
                                                    "with --heads or --draft")
    capsys.readouterr()
    assert gorgon(["generate", "--prompt", "x"] + common) == 2
    assert capsys.readouterr().err.strip().endswith("no drafter: pass --heads FOLDER or --draft MODEL, and/or "
                                                    "--context-draft")
    assert gorgon(["generate", "--context-draft", "--tree-budget", "4", "--prompt", "x"] + common) == 2
    assert capsys.readouterr().err.strip().endswith("--tree-budget sizes a merged tree: it needs --context-draft "
                                                    "with --heads or --draft")
