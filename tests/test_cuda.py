"""The decoder on CUDA. Skipped without a GPU (CI has none); run them where one is present."""

import warnings

import pytest
import torch
from helpers import ARCHS, VOCAB, OracleDrafter, tiny_model

from gorgon.decode import Sampling, speculative_generate
from gorgon.heads import EagleDrafter, EagleHead, MedusaDrafter, MedusaHeads

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
PATHS = [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_equals_generate_on_cuda_fp32(arch):
    model = tiny_model(arch).cuda()
    drafter = MedusaDrafter(MedusaHeads.for_target(model, num_heads=3), tree=PATHS)
    gen = torch.Generator().manual_seed(0)
    for _ in range(5):
        ids = torch.randint(0, VOCAB, (1, 9), generator=gen).cuda()
        ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=30, do_sample=False)
        result = speculative_generate(model, drafter, ids, max_new_tokens=30)
        assert result.tokens == ref[0, 9:].tolist()
        oracle = OracleDrafter(ref[0, 9:].tolist(), 9, VOCAB, PATHS)
        oracle.tree = oracle.tree.to("cuda")
        assert speculative_generate(model, oracle, ids, max_new_tokens=30).tokens == ref[0, 9:].tolist()


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_feature_level_drafter_greedy_equals_generate_on_cuda_fp32(arch):
    """The dynamic tree search on the device (parents, attention rows, the early stop) against `generate`."""
    model = tiny_model(arch, vocab=8, layers=4).cuda()  # a small vocabulary: drafts are often right
    with torch.no_grad():
        model.lm_head.weight.mul_(10)
    torch.manual_seed(1)
    head = EagleHead.for_target(model).cuda()
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    accepted = []
    for nodes, depth, topk in [(8, 3, 2), (16, 5, 4)]:
        drafter = EagleDrafter(head, nodes=nodes, depth=depth, topk=topk)
        for seed in range(3):
            ids = torch.randint(0, 8, (1, 5 + seed), generator=torch.Generator().manual_seed(seed)).cuda()
            ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=30, do_sample=False)
            result = speculative_generate(model, drafter, ids, max_new_tokens=30)
            assert result.tokens == ref[0, ids.shape[1]:].tolist()
            accepted += result.accepted
    assert max(accepted) >= 2  # drafts were accepted, not only bonus tokens


def test_level_stops_and_a_draft_vocabulary_keep_greedy_output_exact_on_cuda_fp32():
    """The cost-aware stop (a level's cost timed on the device) for an EAGLE head and for a draft model cut
    to a draft vocabulary (its ids mapped to the target's on the device) against `generate`."""
    from gorgon.decode.calibrate import drafted_level_cost
    from gorgon.heads import DraftModelDrafter
    from gorgon.heads.methods.draft_model import cut_to_draft_vocab

    model = tiny_model("llama", vocab=8, layers=4).cuda()
    with torch.no_grad():
        model.lm_head.weight.mul_(10)
    torch.manual_seed(1)
    head = EagleHead.for_target(model).cuda()
    draft = cut_to_draft_vocab(tiny_model("llama", vocab=8, seed=7).cuda(), torch.tensor([0, 2, 3, 5, 6]))
    for cost in (None, 0.05, 0.5):
        drafters = [EagleDrafter(head, nodes=8, depth=4, topk=2),
                    DraftModelDrafter(draft, k=4, topk=2, token_map=torch.tensor([0, 2, 3, 5, 6]))]
        for drafter in drafters:
            drafter.level_cost = drafted_level_cost(drafter, model, repeat=3) if cost is None else cost
            assert 0 < drafter.level_cost < float("inf")
            for seed in range(2):
                ids = torch.randint(0, 8, (1, 6 + seed), generator=torch.Generator().manual_seed(seed)).cuda()
                ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False)
                result = speculative_generate(model, drafter, ids, max_new_tokens=24)
                assert result.tokens == ref[0, ids.shape[1]:].tolist()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_runs_and_samples_on_cuda(dtype):
    model = tiny_model("llama").to("cuda", dtype)
    drafter = MedusaDrafter(MedusaHeads.for_target(model, num_heads=3), tree=PATHS)
    ids = torch.randint(0, VOCAB, (1, 7), device="cuda")
    greedy = speculative_generate(model, drafter, ids, max_new_tokens=24)
    assert len(greedy.tokens) == 24 and len(greedy.accepted) == greedy.target_forwards  # one count per forward
    assert sum(greedy.accepted) >= 24  # every token kept was emitted by a forward (the last may be cut)
    gen = torch.Generator(device="cuda").manual_seed(0)
    sampled = speculative_generate(model, drafter, ids, max_new_tokens=24, sampling=Sampling(0.8, 20, 0.95),
                                   generator=gen)
    assert len(sampled.tokens) == 24


def test_one_host_sync_per_step():
    """Each verify step reads back to the host once (the acceptance result); nothing else waits."""
    model = tiny_model("llama").cuda()
    drafter = MedusaDrafter(MedusaHeads.for_target(model, num_heads=3), tree=PATHS)
    ids = torch.randint(0, VOCAB, (1, 7), device="cuda")
    speculative_generate(model, drafter, ids, max_new_tokens=8)  # warm-up
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result = speculative_generate(model, drafter, ids, max_new_tokens=40)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in caught if "synchroniz" in str(w.message).lower()]
    assert len(syncs) <= result.target_forwards, [str(w.message)[:120] for w in syncs[:5]]


def test_decoding_never_runs_cudnn_attention():
    """cuDNN's attention (which torch prefers on Hopper and Blackwell) sets up a graph for every new pair of query
    and key lengths, and decoding meets new pairs at almost every call: the target's verify forwards and an
    EAGLE head's per-level attention run on the other backends, and the flag is back after the call."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class CountCudnnAttention(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.calls = self.attention = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = str(func)
            self.attention += "scaled_dot_product" in name
            self.calls += "cudnn_attention" in name
            return func(*args, **(kwargs or {}))

    model = tiny_model("llama", vocab=8, layers=4).to("cuda", torch.bfloat16)
    drafter = EagleDrafter(EagleHead.for_target(model).to("cuda", torch.bfloat16), nodes=8, depth=3, topk=2)
    ids = torch.randint(0, 8, (1, 9), device="cuda")
    with CountCudnnAttention() as count:
        speculative_generate(model, drafter, ids, max_new_tokens=20)
    assert count.attention > 0 and count.calls == 0
    assert torch.backends.cuda.cudnn_sdp_enabled()


def test_a_drafter_left_on_the_cpu_is_named():
    """An EAGLE head or a draft model on the CPU beside a CUDA target failed inside torch at the first step
    ("Expected all tensors to be on the same device"); Medusa heads were already named."""
    from gorgon.heads import DraftModelDrafter, GorgonError

    model = tiny_model("llama", layers=4).cuda()
    ids = torch.randint(0, VOCAB, (1, 6), device="cuda")
    with pytest.raises(GorgonError, match=r"^the head is on cpu but the target on cuda:0: move it"):
        speculative_generate(model, EagleDrafter(EagleHead.for_target(model).cpu(), nodes=4), ids, max_new_tokens=4)
    with pytest.raises(GorgonError, match=r"^the draft model is on cpu but the target on cuda:0: move it"):
        speculative_generate(model, DraftModelDrafter(tiny_model("llama", seed=1)), ids, max_new_tokens=4)


@pytest.mark.parametrize("arch", ["medusa", "eagle"])
def test_from_options_on_cuda_decodes_exactly(tmp_path, arch):
    """The target and drafter as `gorgon generate` builds them on a GPU (the tree sized from verify costs timed
    there, an EAGLE head in its draft dtype), alone and merged with context drafts, against `generate`
    in float32."""
    from helpers import tiny_chat_target
    from transformers import AutoModelForCausalLM

    from gorgon.decode import from_options

    target_dir = tiny_chat_target(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(target_dir)
    heads = MedusaHeads.for_target(model) if arch == "medusa" else EagleHead.for_target(model)
    heads.save_pretrained(tmp_path / "heads")
    for context_draft in (False, True):
        target, drafter = from_options(heads=tmp_path / "heads", target=target_dir, device="cuda", dtype="float32",
                                       context_draft=context_draft)
        assert target.model.device.type == "cuda"
        ids = torch.randint(1, 50, (1, 6), generator=torch.Generator().manual_seed(0)).cuda()
        ref = target.model.generate(ids, max_new_tokens=16, do_sample=False, eos_token_id=None)[0, 6:].tolist()
        assert speculative_generate(target, drafter, ids, 16, eos_token_id=None).tokens == ref


def test_context_drafts_and_a_draft_model_chain_decode_exactly_on_cuda():
    """Prompt lookup alone, and a draft model's chain (one candidate per level), against `generate` in float32."""
    from gorgon.heads import ContextDrafter, DraftModelDrafter

    model = tiny_model("llama", vocab=8, layers=4).cuda()
    draft = tiny_model("llama", vocab=8, seed=7).cuda()
    for drafter in (ContextDrafter(), DraftModelDrafter(draft, k=3)):
        for seed in range(2):
            ids = torch.randint(0, 8, (1, 8 + seed), generator=torch.Generator().manual_seed(seed)).cuda()
            ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False)
            assert speculative_generate(model, drafter, ids, max_new_tokens=24).tokens == ref[0, ids.shape[1]:].tolist()
