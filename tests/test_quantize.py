"""A quantized target (`--quantize int4 | int8 | w8a8 | w4a8`): the kernels' row invariance that exactness rests on,
the layers swapped, heads across precisions, greedy and sampled exactness, data, training and bench on it, refusals."""

import json

import pytest
import torch
from helpers import chat_target_with_heads, questions_file, tiny_chat_target, tiny_model, toy_data
from test_sampling import V, chi_square_p, exact_distribution, sample_counts

from gorgon.decode import Sampling, speculative_generate
from gorgon.decode.kernels import stock_kernels, use_cpu_kernels
from gorgon.decode.options import from_options
from gorgon.heads import GorgonError, MedusaDrafter, MedusaHeads, load_target
from gorgon.heads.cli import main as gorgon
from gorgon.heads.loading import load_heads
from gorgon.heads.quantize import (
    QuantizedLinear,
    check_scheme,
    float_weights,
    quantization,
    quantize_model,
    row_invariance_problem,
)

SCHEMES = ["int4", "int8", "w8a8", "w4a8"]


@pytest.mark.parametrize("scheme", SCHEMES)
def test_each_row_is_computed_alone_whatever_the_rows_beside_it(scheme):
    assert row_invariance_problem(scheme) is None


def test_the_row_check_catches_a_kernel_that_mixes_rows(monkeypatch):
    from gorgon.heads import quantize

    real = quantize.Int8Linear.product
    monkeypatch.setattr(quantize.Int8Linear, "product", lambda self, x: real(self, x) + x.sum(0, keepdim=True)[:, :1])
    assert "rows differ" in row_invariance_problem("int8")


@pytest.mark.parametrize("scheme", SCHEMES)
def test_quantized_layers_compute_their_dequantized_weights(scheme):
    model = tiny_model("llama", seed=1)
    linears = {n: m.weight.detach().clone() for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    fingerprint, head_weight = load_target_like(model), model.get_output_embeddings().weight
    count = quantize_model(model, scheme)
    assert count == len(linears) and quantization(model) == scheme
    for name, layer in model.named_modules():
        if name in linears:
            assert isinstance(layer, QuantizedLinear)
            error = (layer.dequantized() - linears[name]).abs().max() / linears[name].abs().max()
            # half a step (int4, w4a8: a group's range / 30, at most 2 max / 30; int8, w8a8: max / 254) plus the
            # scales' rounding (bfloat16: 2^-8)
            assert error < (2 / 30 if scheme in ("int4", "w4a8") else 1 / 254) + 2 ** -8, (name, float(error))
            x = torch.randn(3, layer.in_features)
            want = torch.nn.functional.linear(layer.rounded(x), layer.dequantized())  # the input as the kernel reads it
            assert torch.allclose(layer(x), want, rtol=1e-2, atol=1e-2)
    head = model.get_output_embeddings()
    assert head.scheme == scheme and head.weight is head_weight  # kept: tied to the embeddings in tied models
    rows = torch.tensor([3, 0, 17, 63, 40])  # a draft vocabulary: any rows, any count
    x = torch.randn(2, 3, head.in_features)
    assert torch.equal(head.rows_product(x, rows), head(x)[..., rows])
    assert load_target_like(model) == fingerprint


def test_the_w4a8_kernels_vector_path_gives_its_plain_loops_bits():
    """The AVX512-VNNI path and the plain loop (any CPU) do the same operations in the same order (w4a8.cpp)."""
    from gorgon.heads.quantize import W4A8Linear, w4a8_kernel

    if not w4a8_kernel().w4a8_vector_path():
        pytest.skip("this CPU has no AVX512-VNNI: the kernel runs its plain loop only")
    layer = W4A8Linear(torch.nn.Linear(320, 48, bias=False))
    x = torch.randn(11, 320) * torch.logspace(-3, 2, 11)[:, None]  # rows of very different sizes
    x[3, :32] = 0  # a block of zeros: its scale is 0
    assert torch.equal(layer.product(x), layer.product(x, plain=True))


def test_w4a8_siblings_share_one_kernel_call_and_keep_each_layers_bits(monkeypatch):
    """A block's q, k and v (and gate and up) are one kernel call on their shared input, every output with the bits
    of its own layer's call; a changed input is computed again, and the joined output is let go once all took it."""
    from gorgon.heads.quantize import w4a8_kernel

    model = tiny_model("llama", seed=2)
    quantize_model(model, "w4a8")
    attention, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    siblings = attention.q_proj.siblings
    assert siblings is not None and attention.k_proj.siblings is attention.v_proj.siblings is siblings
    assert mlp.gate_proj.siblings is mlp.up_proj.siblings is not None and attention.o_proj.siblings is None
    assert attention.q_proj.packed.untyped_storage().data_ptr() == siblings.packed.untyped_storage().data_ptr()
    layers = (attention.q_proj, attention.k_proj, attention.v_proj)
    alone = []
    x = torch.randn(2, 5, attention.q_proj.in_features)
    for layer in layers:
        layer.siblings = None
        alone.append(layer(x))
        layer.siblings = siblings
    kernel, calls = w4a8_kernel(), []
    real = kernel.w4a8_linear
    monkeypatch.setattr(kernel, "w4a8_linear", lambda *args: calls.append(1) or real(*args))
    for mode in (torch.no_grad, torch.inference_mode):
        with mode():
            y = x.clone()
            assert all(torch.equal(layer(y), want) for layer, want in zip(layers, alone))
            assert len(calls) == 1 and siblings.last is None
            calls.clear()
    with torch.no_grad():
        y = x.clone()
        attention.q_proj(y)
        y.mul_(2)  # written in place between two siblings' calls: k computes again
        assert torch.equal(attention.k_proj(y), 2 * alone[1]) and len(calls) == 2


def test_a_head_the_int4_kernel_cannot_take_is_int8():
    model = tiny_model("llama", vocab=8)  # 8 output rows: torch's int4 packing wants multiples of 16
    quantize_model(model, "int4")
    assert model.get_output_embeddings().scheme == "int8"


def load_target_like(model):
    from gorgon.heads.target import fingerprint

    return fingerprint(model)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_greedy_speculation_equals_the_quantized_targets_generate(tmp_path, scheme):
    path = tiny_chat_target(tmp_path)
    target = load_target(str(path), device="cpu", quantize=scheme)
    use_cpu_kernels(target.model, "fast")
    drafter = MedusaDrafter(MedusaHeads.for_target(target.model), tree=[[0], [1], [0, 0], [0, 1], [0, 0, 0]])
    for seed in range(4):
        prompt = torch.randint(4, 128, (1, 9), generator=torch.Generator().manual_seed(seed))  # no specials
        want = target.model.generate(prompt, max_new_tokens=24, do_sample=False)[0, 9:].tolist()
        assert speculative_generate(target.model, drafter, prompt, max_new_tokens=24).tokens == want


@pytest.mark.slow
def test_sampling_on_a_quantized_target_is_exact():
    model = tiny_model("llama", vocab=V, seed=3)
    with torch.no_grad():
        model.lm_head.weight.mul_(40)
    quantize_model(model, "int4")
    s = Sampling(temperature=1.0)
    prompt = torch.tensor([[1, 5, 2]])
    counts, accepted = sample_counts(model, prompt, s)
    assert max(accepted) >= 3
    assert chi_square_p(exact_distribution(model, prompt, s), counts) > 1e-3


def test_heads_trained_on_full_precision_load_on_the_quantized_copy_and_not_on_another(tmp_path):
    path, _, heads = chat_target_with_heads(tmp_path)
    target, loaded = load_heads(heads, str(path), device="cpu", quantize="int4")
    assert quantization(target.model) == "int4" and loaded is not None
    other = tiny_chat_target(tmp_path, seed=5)
    with pytest.raises(GorgonError, match="trained for target .* but this target.s fingerprint is"):
        load_heads(heads, str(other), device="cpu", quantize="int4")


def test_stock_kernels_run_the_kept_float_weights(tmp_path):
    path = tiny_chat_target(tmp_path)
    plain = load_target(str(path), device="cpu")
    target = load_target(str(path), device="cpu", quantize="int4", keep_float=True)
    use_cpu_kernels(target.model, "fast")
    ids = torch.arange(1, 9)[None]
    with torch.no_grad():
        want = plain.model(ids).logits
        with stock_kernels(target.model):
            assert torch.equal(target.model(ids).logits, want)
        assert not torch.equal(target.model(ids).logits, want)  # the quantized weights again
    bare = load_target(str(path), device="cpu", quantize="int4")
    with pytest.raises(GorgonError, match="loaded without its float weights"), float_weights(bare.model):
        pass


def test_schemes_gorgon_lacks_or_cannot_run_here_are_one_line(tmp_path, capsys):
    with pytest.raises(GorgonError, match="fp8 .*not built in gorgon yet: use int4 or int8 on the CPU"):
        check_scheme("fp8")
    with pytest.raises(GorgonError, match="runs on the CPU.*use --device cpu"):
        check_scheme("int4", "cuda")
    with pytest.raises(GorgonError, match="unknown scheme 'int3'"):
        from_options(context_draft=True, quantize="int3")
    with pytest.raises(SystemExit) as stop:
        gorgon(["generate", "--context-draft", "--quantize", "nf4", "--prompt", "hi"])
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "nf4 (bitsandbytes NF4) is not built in gorgon yet" in err[0]


@pytest.mark.slow
def test_bench_on_a_quantized_target_names_it_and_times_stock_full_precision(tmp_path):
    path, _, heads = chat_target_with_heads(tmp_path)
    q = questions_file(tmp_path / "q.jsonl")
    out = tmp_path / "report.json"
    assert gorgon(["bench", "--target", str(path), "--heads", str(heads), "--quantize", "int4", "--questions", str(q),
                   "--max-new-tokens", "8", "--limit", "2", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["quantize"] == "int4" and report["identical"] == report["prompts"] == 2
    assert report["speedup_vs_stock"] == pytest.approx(report["tokens_per_s"] / report["stock_tokens_per_s"])


@pytest.mark.slow
def test_data_and_training_on_a_quantized_target(tmp_path):
    from gorgon.train.data import DataSettings, make_dataset, read_metadata
    from gorgon.train.heads import HeadsTrainConfig, train

    path = tiny_chat_target(tmp_path)
    prompts = toy_data(tmp_path / "toy.jsonl", n=8)
    data = make_dataset(DataSettings(prompts=prompts, target=str(path), max_new_tokens=8, quantize="int4"),
                        tmp_path / "data", progress=False, device="cpu")
    assert read_metadata(data)["settings"]["quantize"] == "int4"
    with pytest.raises(GorgonError, match="made with other settings .*quantize"):
        make_dataset(DataSettings(prompts=prompts, target=str(path), max_new_tokens=8), data, progress=False,
                     device="cpu")
    for arch in ("eagle", "medusa"):  # Medusa heads' loss runs back through the target's quantized LM head
        out = train(HeadsTrainConfig(data=str(data), out=str(tmp_path / arch), target=str(path), quantize="int4",
                                     arch=arch, max_steps=2, batch_size=2, report_to="none", save_every=0))
        assert json.loads((out / "recipe.json").read_text())["quantize"] == "int4"
        assert "with the target quantized int4 (`quantize: int4`)" in (out / "README.md").read_text()
        load_heads(out, str(path), device="cpu", quantize="int4")


def test_a_recipe_that_trains_the_target_refuses_a_quantized_one(tmp_path):
    from gorgon.train.heads import HeadsTrainConfig

    with pytest.raises(GorgonError, match="trains the target's own weights too .*set quantize: none"):
        HeadsTrainConfig(data="d", out=str(tmp_path / "o"), quantize="int4", mode="medusa2").check()
    with pytest.raises(GorgonError, match="quantize: fp8 .*not built"):
        HeadsTrainConfig(data="d", out=str(tmp_path / "o"), quantize="fp8").check()


def test_data_refuses_quantize_with_the_vllm_engine(tmp_path):
    from gorgon.train.data import DataSettings, check_data_settings

    with pytest.raises(GorgonError, match="drop it with --engine vllm"):
        check_data_settings(DataSettings(prompts="p.jsonl", engine="vllm", quantize="int4"), tmp_path / "o")


def gqa_model():
    """A random Llama shaped as the embedded target's attention (9 query heads on 3 key/value heads of 64): the
    shape where torch's batched masked attention rounds apart from a one-token step's, in this check from about
    90 cached tokens on (a narrower model did not show it)."""
    import transformers as tf

    torch.manual_seed(0)
    config = tf.LlamaConfig(vocab_size=128, hidden_size=576, intermediate_size=1152, num_hidden_layers=2,
                            num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=512)
    return tf.LlamaForCausalLM(config).eval()


@pytest.mark.parametrize("kernels, scheme", [("fast", "int4"), ("stock", "int4"), ("fast", "w8a8"), ("fast", "w4a8")])
def test_every_node_verified_gets_what_a_one_token_step_gives_it_to_the_bit(kernels, scheme, monkeypatch):
    """The exactness of greedy output on a quantized target rests on this: each verified node's hidden state is
    bitwise a one-token step's (`rows_alone`), where the batched masked call rounds apart (the same check fails
    with rows_alone off). 20 steps after 84 prompt tokens, each verifying a root and a branch of two, keeping
    the root; then a tree: each of its nodes against steps along its path."""
    import gorgon.decode.verify as verify_module
    from gorgon.decode.attention import rows_alone
    from gorgon.heads.cache import growing_cache, with_cache
    from gorgon.heads.tree import tree_from_token_paths

    model = gqa_model()
    quantize_model(model, scheme)
    use_cpu_kernels(model, kernels)
    decoder = model.get_decoder()
    prompt = torch.randint(4, 128, (1, 84), generator=torch.Generator().manual_seed(1))

    def step(cache, token):
        return decoder(input_ids=torch.tensor([[token]]), **with_cache(decoder, cache),
                       use_cache=True).last_hidden_state[0, -1]

    def prefilled():
        cache = growing_cache()
        decoder(input_ids=prompt, **with_cache(decoder, cache), use_cache=True)
        return cache

    def verified_equal_steps() -> bool:
        with torch.inference_mode():
            steps, verified = prefilled(), prefilled()
            for k in range(20):
                token = 4 + (k * 37) % 120
                tokens, tree = tree_from_token_paths(torch.tensor(token), [[5, 6]])
                past = verified.get_seq_length()
                node = verify_module.verify(model, verified, tokens, tree).last_hidden_state[0, 0]
                verify_module.keep_path(verified, past, verify_module.accepted_rows([0], tokens.device))
                if not torch.equal(node, step(steps, token)):
                    return False
            tokens, tree = tree_from_token_paths(torch.tensor(50), [[60, 61], [70], [60, 80]])
            ranks = [()] + [tuple(p) for p in tree.paths]
            nodes = verify_module.verify(model, verified, tokens, tree).last_hidden_state[0]
            for row, path in enumerate(ranks):
                crop = prefilled()
                for k in range(20):
                    step(crop, 4 + (k * 37) % 120)
                for d in range(len(path) + 1):
                    last = step(crop, int(tokens[ranks.index(path[:d])]))
                if not torch.equal(nodes[row], last):
                    return False
            return True

    assert verified_equal_steps()
    monkeypatch.setattr(verify_module, "rows_alone", lambda on: rows_alone(False))
    assert not verified_equal_steps()


@pytest.mark.parametrize("scheme", ["int4", "w4a8"])
def test_every_node_of_a_batch_gets_what_its_own_rows_one_token_steps_give_it(scheme, monkeypatch):
    """A batch of three prompts of different lengths (`verify_batch`: a cache padded to the longest row, its rows'
    trees side by side): each row's root and first child are bitwise that row's own one-token steps, 10 steps on,
    and the same check fails with rows_alone off (padding and the batch change the batched call's sums)."""
    import copy

    import gorgon.decode.verify as verify_module
    from gorgon.decode.attention import rows_alone
    from gorgon.heads.cache import growing_cache, stacked_cache, with_cache
    from gorgon.heads.tree import tree_from_token_paths

    model = gqa_model()
    quantize_model(model, scheme)
    use_cpu_kernels(model, "fast")
    decoder = model.get_decoder()
    generator = torch.Generator().manual_seed(2)
    prompts = [torch.randint(4, 128, (1, n), generator=generator) for n in (84, 60, 71)]

    def step(cache, token):
        return decoder(input_ids=torch.tensor([[token]]), **with_cache(decoder, cache),
                       use_cache=True).last_hidden_state[0, -1]

    def prefilled(prompt):
        cache = growing_cache()
        decoder(input_ids=prompt, **with_cache(decoder, cache), use_cache=True)
        return cache

    def batch_equals_steps() -> bool:
        with torch.inference_mode():
            alone = [prefilled(p) for p in prompts]
            lengths = [p.shape[1] for p in prompts]
            batch = stacked_cache([prefilled(p) for p in prompts], lengths)
            for k in range(10):
                roots = [4 + (k * 37 + 11 * b) % 120 for b in range(len(prompts))]
                proposals = [tree_from_token_paths(torch.tensor(r), [[5, 6]]) for r in roots]
                past = batch.get_seq_length()
                hidden = verify_module.verify_batch(model, batch, lengths, [t for t, _ in proposals],
                                                    [tree for _, tree in proposals]).last_hidden_state
                verify_module.keep_paths(batch, past, lengths, [[0]] * len(prompts))
                lengths = [n + 1 for n in lengths]
                for b, root in enumerate(roots):
                    ahead = copy.deepcopy(alone[b])
                    if not (torch.equal(hidden[b, 0], step(alone[b], root))
                            and torch.equal(hidden[b, 1], (step(ahead, root), step(ahead, 5))[1])):
                        return False
            return True

    assert batch_equals_steps()
    monkeypatch.setattr(verify_module, "rows_alone", lambda on: rows_alone(False))
    assert not batch_equals_steps()


def test_a_q4_1_gguf_requantizes_onto_its_own_codes(tmp_path):
    """`--quantize int4` of a model read from a Q4_1 GGUF (the embedded target) runs the GGUF's own codes; only
    the steps and minimums are rounded to bfloat16 (scripts/gguf_codes.py, on the embedded target: 100%)."""
    import gguf
    import numpy as np
    from helpers import load_script

    weight = np.random.RandomState(0).randn(64, 96).astype(np.float32)
    writer = gguf.GGUFWriter(str(tmp_path / "tiny.gguf"), "llama")
    writer.add_tensor("blk.0.ffn_up.weight", gguf.quants.quantize(weight, gguf.GGMLQuantizationType.Q4_1),
                      raw_dtype=gguf.GGMLQuantizationType.Q4_1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    found = load_script("gguf_codes").compare(str(tmp_path / "tiny.gguf"))
    assert found["q4_1_tensors"] == 1 and found["codes_equal"] == found["codes"] == 64 * 96
    assert found["largest_difference_in_steps"] < 0.5  # bfloat16 steps and minimums move a weight a little


def test_beside_a_w4a8_target_an_eagle_head_drafts_on_w4a8_and_the_output_stays(tmp_path):
    """`--draft-dtype auto` beside a w4a8 target puts the head's linear layers on w4a8 (`draft_scheme`), and the report
    names it; the drafts change, the output is still the target's own `generate`. bfloat16 stays a choice."""
    from gorgon.decode.options import from_options
    from gorgon.heads import EagleHead
    from gorgon.heads.drafter import dtype_name
    from gorgon.heads.quantize import W4A8Linear

    path = tiny_chat_target(tmp_path)
    target = load_target(str(path), device="cpu")
    EagleHead.for_target(target.model, target_fingerprint=target.fingerprint).save_pretrained(tmp_path / "eagle")
    loaded, drafter = from_options(target=str(path), heads=str(tmp_path / "eagle"), quantize="w4a8", tree=4)
    layers = [m for m in drafter.head.modules() if isinstance(m, (torch.nn.Linear, QuantizedLinear))]
    assert layers and all(isinstance(m, W4A8Linear) for m in layers) and dtype_name(drafter.head) == "w4a8"
    prompt = torch.randint(4, 128, (1, 9), generator=torch.Generator().manual_seed(0))
    want = loaded.model.generate(prompt, max_new_tokens=16, do_sample=False)[0, 9:].tolist()
    assert speculative_generate(loaded.model, drafter, prompt, max_new_tokens=16).tokens == want
    _, kept = from_options(target=str(path), heads=str(tmp_path / "eagle"), quantize="w4a8", tree=4,
                           draft_dtype="bfloat16")
    assert dtype_name(kept.head) == "bfloat16"


def test_a_quantized_targets_attention_takes_each_row_alone_over_its_own_keys():
    """decode/row_attention.cpp: each row of a tree's mask (its keys not all the first ones) within float32 rounding
    of torch's SDPA over the same keys, and bitwise what it computes for that row alone."""
    import torch.nn.functional as F

    from gorgon.decode.attention import row_kernel, row_keys

    g = torch.Generator().manual_seed(0)
    q = torch.randn(4, 9, 64, generator=g)
    k, v = torch.randn(3, 30, 64, generator=g), torch.randn(3, 30, 64, generator=g)
    allowed = torch.ones(4, 30, dtype=torch.bool)
    allowed[:, 26:] = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    counts, positions = row_keys(torch.where(allowed, 0.0, float("-inf"))[None, None])
    assert counts == [27, 28, 28, 29] and positions[2, 26:28].tolist() == [26, 28]
    together = row_kernel().row_attention(q, k, v, counts, positions, 0.125)
    for r in range(4):
        keys = positions[r, :counts[r]]
        want = F.scaled_dot_product_attention(q[r][:, None], k[:, keys].repeat_interleave(3, 0),
                                              v[:, keys].repeat_interleave(3, 0), scale=0.125)[:, 0]
        assert torch.allclose(together[r], want, atol=1e-5)
        alone = row_kernel().row_attention(q[r:r + 1], k, v, counts[r:r + 1], positions[r:r + 1], 0.125)
        assert torch.equal(alone[0], together[r])


def test_a_kernel_that_cannot_build_is_one_line_naming_the_compiler(tmp_path, monkeypatch):
    import torch.utils.cpp_extension

    from gorgon.heads.native import native

    def fails(**kwargs):
        raise RuntimeError("Error building extension\nlong compiler output\ng++: command not found")

    monkeypatch.setattr(torch.utils.cpp_extension, "load", fails)
    source = tmp_path / "kernel.cpp"
    source.write_text("// nothing")
    with pytest.raises(GorgonError, match=r"^gorgon's kernel kernel.cpp did not build here \(g\+\+: command not "
                                          r"found\): quantized targets need a C\+\+ compiler") as err:
        native(source)
    assert "\n" not in str(err.value)
