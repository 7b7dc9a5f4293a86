"""Greedy verification's argmax on a bfloat16 screen of the output layer: always the float32 argmax
(near ties, exact ties, changed weights), greedy output unchanged, and on only where it may be."""

import pytest
import torch
from helpers import ARCHS, VOCAB, tiny_model

from gorgon.decode import speculative_generate
from gorgon.decode.argmax import argmax_in_use, target_argmax, use_bf16_screen
from gorgon.decode.kernels import fast_kernels_unavailable, stock_kernels, use_cpu_kernels
from gorgon.heads import MedusaDrafter, MedusaHeads
from gorgon.heads.target import lm_logits

BF16_ONEDNN = fast_kernels_unavailable(torch.bfloat16) is None
# torch's own bfloat16 product runs on any CPU, so the bound is checked everywhere; oneDNN's where it runs.
PACKINGS = [False, pytest.param(True, marks=pytest.mark.skipif(not BF16_ONEDNN, reason="no bfloat16 oneDNN here"))]


@pytest.mark.slow
@pytest.mark.parametrize("packed", PACKINGS)
@torch.no_grad()
def test_the_screen_finds_the_float32_argmax_even_on_near_and_exact_ties(packed):
    model = tiny_model("llama")
    use_bf16_screen(model, True, packed)
    hidden = torch.randn(300, 32, generator=torch.Generator().manual_seed(0)) * torch.logspace(-1, 2, 300)[:, None]
    full = lm_logits(model, hidden).argmax(-1)
    assert target_argmax(model, hidden).tolist() == full.tolist()  # so many rows keep much: the full product
    assert [target_argmax(model, h).item() for h in hidden] == full.tolist()  # one by one: screened
    # Rows 3 and 5 differ by 1e-3 of their size, below bfloat16's resolution; rows 2 and 7 are equal.
    weight = model.get_output_embeddings().weight
    direction = torch.randn(32, generator=torch.Generator().manual_seed(1))
    for close, winner in ((1 + 1e-3, 5), (1 - 1e-3, 3)):
        weight[3] = direction
        weight[5] = direction * close
        weight[[2, 7]] = direction * 0.5
        h = direction[None] / direction.norm() * 40
        full = lm_logits(model, h)
        assert full.argmax(-1).item() == winner
        assert target_argmax(model, h).tolist() == [winner]  # the copy was remade from the changed weight
    weight[[3, 5]] = -direction
    assert lm_logits(model, h).argmax(-1).item() == 2 == target_argmax(model, h).item()  # a tie: the first


@pytest.mark.parametrize("packed", PACKINGS)
@torch.no_grad()
def test_the_screen_keeps_a_winner_that_bfloat16_rounding_puts_far_behind(packed):
    """The screen's bound must cover the whole of bfloat16's rounding (2^-7 of each product): here the float32
    winner (row 3) trails row 5 by 10 bfloat16 steps after rounding, each of ten elements rounding row 3 down
    and row 5 up; a bound a quarter as wide dropped row 3. And NaN logits answer as the full product does."""
    model = tiny_model("llama")
    use_bf16_screen(model, True, packed)
    weight = model.get_output_embeddings().weight
    u = 2 ** -7  # bfloat16's spacing at 1
    weight.zero_()
    weight[3, :10] = 1 + 0.49 * u  # rounds down to 1
    weight[5, :10] = 1 + 0.51 * u  # rounds up to 1 + u
    weight[3, 10], weight[5, 10] = 1 + 0.45 * u, 1.0  # both round to 1: row 3 leads by 0.45u - 10 x 0.02u
    h = torch.zeros(1, 32)
    h[0, :11] = 1.0
    assert lm_logits(model, h).argmax(-1).item() == 3
    assert (h @ weight.bfloat16().float().T).argmax(-1).item() == 5
    assert target_argmax(model, h).item() == 3
    h[0, 20] = float("nan")
    assert target_argmax(model, h).tolist() == lm_logits(model, h).argmax(-1).tolist()


@pytest.mark.parametrize("packed", PACKINGS)
@torch.no_grad()
def test_the_screens_bound_grows_with_the_whole_hidden_state(packed):
    """Rounding errors add up over every element of a row, so the bound scales with the hidden state's norm:
    here all 32 elements round against the float32 winner (row 3), which bfloat16 puts 30 steps behind; a
    bound from the largest element alone (sqrt(32) times smaller) dropped it."""
    model = tiny_model("llama")
    use_bf16_screen(model, True, packed)
    weight = model.get_output_embeddings().weight
    u = 2 ** -7  # bfloat16's spacing at 1
    weight.zero_()
    weight[3], weight[5] = 1 + 0.49 * u, 1 + 0.51 * u  # round down to 1, up to 1 + u
    weight[3, 0], weight[5, 0] = 1 + 0.45 * u + 31 * 0.02 * u, 1.0  # row 3 leads by 0.45u in float32
    h = torch.ones(1, 32)
    assert lm_logits(model, h).argmax(-1).item() == 3
    assert (h @ weight.bfloat16().float().T).argmax(-1).item() == 5
    assert target_argmax(model, h).item() == 3


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_output_is_identical_with_the_screen(arch):
    model = tiny_model(arch)
    ids = torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(3))
    expected = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False)
    use_bf16_screen(model, True, packed=False)
    # Gemma 2 soft-caps its logits, so it keeps the full product
    assert argmax_in_use(model) == ("full" if arch == "gemma2" else "bf16 screen")
    drafter = MedusaDrafter(MedusaHeads.for_target(model, num_heads=3), tree=[[0], [1], [0, 0], [0, 0, 0]])
    assert speculative_generate(model, drafter, ids, max_new_tokens=24).tokens == expected[0, 12:].tolist()


def test_the_screen_is_on_only_on_the_fast_path_where_this_cpu_runs_bfloat16():
    model = tiny_model("llama")
    assert argmax_in_use(model) == "full"
    if fast_kernels_unavailable(torch.float32) is None:
        use_cpu_kernels(model, "fast")
        on = "bf16 screen" if BF16_ONEDNN else "full"
        assert argmax_in_use(model) == on
        with torch.no_grad():
            target_argmax(model, torch.randn(2, 32))  # makes the copy where the screen is on
        screen = model.lm_head.__dict__.get("_gorgon_bf16_screen")
        with stock_kernels(model):
            assert argmax_in_use(model) == "full"
        assert argmax_in_use(model) == on
        assert model.lm_head.__dict__.get("_gorgon_bf16_screen") is screen  # the same copy, not made anew
    use_cpu_kernels(model, "stock")
    assert argmax_in_use(model) == "full"
    assert use_bf16_screen(model.model, True) is False  # no output layer: nothing to screen
    bf16 = tiny_model("llama").to(torch.bfloat16)
    use_bf16_screen(bf16, True)
    assert argmax_in_use(bf16) == "full"  # only a float32 layer has a smaller copy to read
