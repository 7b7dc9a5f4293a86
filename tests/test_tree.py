import pytest
import torch

from gorgon.heads import GorgonError
from gorgon.heads.methods.medusa.drafter import default_tree
from gorgon.heads.tree import (
    build_tree,
    cut_tree,
    expected_accepted,
    interpolate_cost,
    tree_from_accuracies,
    worth_verifying,
)


def test_buffers_of_a_small_tree():
    tree = build_tree([[1], [0], [0, 0], [0, 1], [1, 0]])
    # nodes sorted by depth then ranks: root, [0], [1], [0,0], [0,1], [1,0]
    assert tree.paths == ((0,), (1,), (0, 0), (0, 1), (1, 0))
    assert tree.depth.tolist() == [0, 1, 1, 2, 2, 2]
    assert tree.parent.tolist() == [0, 0, 0, 1, 1, 2]
    assert tree.rank.tolist() == [0, 0, 1, 0, 1, 0]
    assert tree.path_to[5] == (0, 2, 5)
    assert tree.children.tolist() == [[1, 2], [3, 4], [5, -1], [-1, -1], [-1, -1], [-1, -1]]
    expected = torch.tensor([[1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [1, 0, 1, 0, 0, 0],
                             [1, 1, 0, 1, 0, 0], [1, 1, 0, 0, 1, 0], [1, 0, 1, 0, 0, 1]], dtype=torch.bool)
    assert torch.equal(tree.ancestors, expected)


def test_tokens_read_by_depth_and_rank():
    tree = build_tree([[0], [1], [1, 2]])
    topk = torch.tensor([[10, 11, 12], [20, 21, 22]])
    assert tree.tokens(torch.tensor(5), topk).tolist() == [5, 10, 11, 22]


@pytest.mark.parametrize("paths, message", [
    ([[0, 1]], "no parent path"),
    ([], "at least one"),
    ([[-1]], ">= 0"),
])
def test_bad_trees_are_refused(paths, message):
    with pytest.raises(GorgonError, match=message):
        build_tree(paths)


def test_tree_from_accuracies_is_best_first_and_valid():
    acc = [[0.6, 0.2, 0.1], [0.4, 0.2, 0.1], [0.3, 0.1, 0.05]]
    paths = tree_from_accuracies(acc, size=6)
    assert len(paths) == 5
    build_tree(paths)  # prefix-closed
    assert paths[:3] == [[0], [0, 0], [1]]  # 0.6, 0.24, 0.2
    # No other prefix-closed tree of the same size does better (exhaustive over small candidates).
    import itertools
    pool = [list(p) for d in (1, 2, 3) for p in itertools.product(range(3), repeat=d)]
    best = expected_accepted(acc, paths)
    for combo in itertools.combinations(range(len(pool)), 5):
        cand = [pool[i] for i in combo]
        if all(p[:-1] in cand or len(p) == 1 for p in cand):
            assert expected_accepted(acc, cand) <= best + 1e-12


def test_a_node_count_builds_the_tree_from_the_heads_accuracies():
    from helpers import tiny_model

    from gorgon.heads import MedusaDrafter, MedusaHeads

    heads = MedusaHeads.for_target(tiny_model("llama"), num_heads=2)
    heads.trees = {"accuracies": [[0.9, 0.05], [0.1, 0.8]]}
    assert MedusaDrafter(heads, tree=3).tree.paths == ((0,), (0, 1))  # 0.9, then 0.9 * 0.8
    assert MedusaDrafter(heads, tree=4).tree.size == 4


def test_default_trees_fit_the_device_and_the_heads():
    cpu, gpu = build_tree(default_tree(4, "cpu")), build_tree(default_tree(4, "cuda"))
    assert cpu.size == 16 and gpu.size == 64
    assert gpu.max_depth <= 4 and build_tree(default_tree(2, "cuda")).max_depth <= 2


def test_cut_tree_keeps_every_node_within_the_depth():
    tree = build_tree([[0], [1], [0, 0], [0, 1], [0, 0, 0]])
    tokens = torch.arange(10, 16)
    for depth, size in [(3, 6), (2, 5), (1, 3), (0, 1)]:
        kept, cut = cut_tree(tokens, tree, depth)
        assert cut.size == size and cut.paths == tree.paths[:size - 1] and kept.tolist() == list(range(10, 10 + size))


def test_verify_costs_interpolate_and_ties_go_to_the_smaller_tree():
    costs = {1: 1.0, 4: 2.0}
    assert [interpolate_cost(costs, n) for n in (1, 2, 4, 8)] == [1.0, 1.0 + 1 / 3, 2.0, 4.0]  # beyond: in proportion
    flat = {1: 1.0, 8: 1.0}
    assert worth_verifying([0.5, 0.0, 0.0], flat) == 1  # candidates that add nothing are not verified
    assert worth_verifying([0.0, 0.0], flat, at_least=1) == 1
    steep = {1: 1.0, 2: 1.5, 3: 1.8, 4: 4.0}
    assert worth_verifying([0.9, 0.8, 0.7], steep) == 2  # 2.7 tokens per 1.8 beat 1.9 per 1.5 and 3.4 per 4


def test_best_first_takes_a_parent_before_its_child_on_a_tie():
    """A child as likely as its parent (its own chance, given the parent: 1) sorted first was dropped, its
    parent not yet chosen, and a worse path took its place."""
    from gorgon.heads.tree import best_first

    assert best_first({(1, 2): 0.5, (1,): 0.5, (3,): 0.4}, 2) == [(1,), (1, 2)]
    # A child likelier than its parent (no search gives one; the promise holds for any chances) never comes first.
    assert best_first({(1,): 0.1, (1, 2): 0.5, (3,): 0.3}, 2) == [(3,), (1,)]
