"""The CPU fast path (oneDNN prepacked linears): same results as torch's stock kernels, reversible,
a clean fallback where it cannot run, and the bench's two baselines. Its speed is a benchmark
(scripts/profile_step.py), never a test."""

import copy
import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers import (
    ARCHS,
    QUESTIONS,
    VOCAB,
    chat_target_with_heads,
    key_value_copies,
    load_script,
    questions_file,
    tiny_chat_target,
    tiny_model,
)

import gorgon.decode.calibrate as calibrate
from gorgon.decode import speculative_generate
from gorgon.decode.acceptance import Sampling
from gorgon.decode.bench import environment, markdown_table, run_bench
from gorgon.decode.cli import parser as generate_parser
from gorgon.decode.kernels import (
    MAX_STOCK_ROWS,
    fast_kernels_unavailable,
    kernels_in_use,
    set_stock_rows,
    stock_kernels,
    stock_rows,
    use_cpu_kernels,
)
from gorgon.heads import GorgonError, MedusaDrafter, MedusaHeads, load_target
from gorgon.heads.tree import best_tree_size, interpolate_cost

needs_onednn = pytest.mark.skipif(fast_kernels_unavailable(torch.float32) is not None,
                                  reason="this torch build cannot run the oneDNN fast path")


@needs_onednn
@pytest.mark.parametrize("arch", ARCHS)
def test_fast_logits_match_stock_and_greedy_output_is_identical(arch):
    model = tiny_model(arch)
    ids = torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        stock_logits = model(ids).logits
        stock_out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=20, do_sample=False)
    keys = list(model.state_dict())
    assert use_cpu_kernels(model, "fast", stock_rows=0) == "fast" == kernels_in_use(model)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, stock_logits, atol=1e-4, rtol=1e-4)
        fast_out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=20, do_sample=False)
    assert fast_out.tolist() == stock_out.tolist()
    drafter = MedusaDrafter(MedusaHeads.for_target(model, num_heads=3), tree=[[0], [1], [0, 0], [0, 0, 0]])
    assert speculative_generate(model, drafter, ids, max_new_tokens=20).tokens == fast_out[0, 12:].tolist()
    assert list(model.state_dict()) == keys  # parameters and names untouched


def rows_reaching_onednn(monkeypatch) -> list[int]:
    """A list that records the row count of every product the fast path hands to oneDNN from now on."""
    import gorgon.decode.kernels as kernels

    rows, packed_linear = [], kernels.packed_linear
    monkeypatch.setattr(kernels, "packed_linear", lambda x, *a: rows.append(x.numel() // x.shape[-1]) or
                        packed_linear(x, *a))
    return rows


@needs_onednn
def test_stock_rows_are_timed_and_settable_and_route_products_by_row_count(monkeypatch):
    model = tiny_model("llama")
    use_cpu_kernels(model, "fast")
    assert 0 <= stock_rows(model) <= MAX_STOCK_ROWS
    calls = rows_reaching_onednn(monkeypatch)
    ids = torch.randint(0, VOCAB, (1, 9))
    outputs = {}
    for rows in (0, 1, 3, MAX_STOCK_ROWS):
        set_stock_rows(model, rows)
        assert stock_rows(model) == rows
        calls.clear()
        with torch.no_grad():
            for n in range(1, 6):
                model(ids[:, :n])
        assert sorted(set(calls)) == [n for n in range(1, 6) if n > rows]  # fewer rows never reach oneDNN
        outputs[rows] = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False)
    assert all(out.tolist() == outputs[0].tolist() for out in outputs.values())
    for bad in (-1, 1.5, "onednn"):
        with pytest.raises(GorgonError, match="stock rows must be a whole number >= 0"):
            set_stock_rows(model, bad)
    assert stock_rows(tiny_model("llama")) is None


@needs_onednn
def test_stock_rows_are_timed_on_any_module_and_a_drafter_in_another_dtype_gets_its_own(monkeypatch):
    import gorgon.decode.kernels as kernels
    from gorgon.decode.options import use_drafter_kernels

    layers = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))  # no causal LM: timed all the same
    use_cpu_kernels(layers, "fast")
    assert 0 <= stock_rows(layers) <= MAX_STOCK_ROWS
    target = tiny_model("llama")
    use_cpu_kernels(target, "fast", stock_rows=2)
    monkeypatch.setattr(kernels, "fastest_stock_rows", lambda module, repeat=3, most=MAX_STOCK_ROWS: 0)
    same_dtype = MedusaHeads.for_target(target, num_heads=2)
    use_drafter_kernels(same_dtype, target, "fast")
    assert stock_rows(same_dtype) == 2  # the target's, not timed again
    if fast_kernels_unavailable(torch.bfloat16) is None:
        other_dtype = copy.deepcopy(same_dtype).to(torch.bfloat16)
        use_drafter_kernels(other_dtype, target, "fast")
        assert stock_rows(other_dtype) == 0  # timed for its own dtype


@needs_onednn
def test_switch_is_reversible_and_stock_kernels_restores():
    model = tiny_model("llama")
    linear = model.model.layers[0].mlp.up_proj
    use_cpu_kernels(model, "fast")
    assert "forward" in linear.__dict__
    with stock_kernels(model):
        assert kernels_in_use(model) == "stock" and "forward" not in linear.__dict__
    assert kernels_in_use(model) == "fast"
    assert use_cpu_kernels(model, "stock") == "stock"
    assert not any("forward" in m.__dict__ for m in model.modules())


@pytest.mark.parametrize("arch", ARCHS)
def test_tree_attention_shares_key_value_heads_and_changes_nothing(arch, monkeypatch):
    """On the fast path a masked forward over a tree attends with torch's shared key/value heads
    (enable_gqa) instead of transformers' copies, with bit-identical hidden states; stock is as it was."""
    import gorgon.decode.attention as attention
    from gorgon.decode.verify import verify
    from gorgon.heads.cache import with_cache
    from gorgon.heads.tree import build_tree

    model = tiny_model(arch)
    tree = build_tree([[0], [1], [0, 0], [0, 1], [1, 0]])
    prompt = torch.randint(0, VOCAB, (1, 40), generator=torch.Generator().manual_seed(1))

    @torch.no_grad()
    def verified():
        from transformers import DynamicCache

        cache = DynamicCache()
        model(input_ids=prompt, **with_cache(model, cache), use_cache=True)
        return verify(model, cache, torch.tensor([3, 4, 5, 6, 7, 8]), tree).last_hidden_state

    copies = key_value_copies(monkeypatch)
    reference = verified()
    before = model.config._attn_implementation
    attention.use_tree_attention(model, True)
    if before != "sdpa":  # eager attention (Gemma 2) is left alone
        assert model.config._attn_implementation == before
        return
    assert copies  # transformers' SDPA copied the key/value heads for the tree
    assert model.config._attn_implementation == attention.NAME
    copies.clear()
    assert torch.equal(verified(), reference) and not copies
    with stock_kernels(model):
        assert model.config._attn_implementation == "sdpa"
    assert model.config._attn_implementation == attention.NAME
    use_cpu_kernels(model, "stock")
    assert model.config._attn_implementation == "sdpa"


@needs_onednn
def test_changed_weights_autograd_and_copies_never_use_a_stale_pack(monkeypatch):
    """stock_rows 0: every product takes the packed path (a measured cutoff of 3 rows or more, as on the Intel
    Xeon with AMX, sent this test's products to torch's own kernel, where no pack can be stale)."""
    import gorgon.decode.kernels as kernels

    packed, real = [], kernels.packed_linear
    monkeypatch.setattr(kernels, "packed_linear", lambda *args: packed.append(1) or real(*args))
    layer = torch.nn.Linear(16, 8)
    use_cpu_kernels(layer, "fast", stock_rows=0)
    x = torch.randn(3, 16)
    with torch.no_grad():
        layer.weight.mul_(3)  # an in-place update after packing
        torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias))
    assert packed  # the packed path ran
    y = layer(x)  # autograd goes through torch's own linear
    y.sum().backward()
    torch.testing.assert_close(layer.weight.grad, torch.ones(8, 3) @ x)  # d(sum of x W^T + b)/dW
    twin = copy.deepcopy(layer)
    with torch.no_grad():
        twin.weight.zero_()
        torch.testing.assert_close(twin(x), twin.bias.expand(3, 8))  # the copy computes with its own weight
        torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias))


def test_fallback_when_onednn_is_missing(monkeypatch):
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)
    model = tiny_model("llama")
    with pytest.warns(UserWarning, match="fast kernels are off: this torch build has no oneDNN"):
        assert use_cpu_kernels(model, "fast") == "stock"
    assert kernels_in_use(model) == "stock"


@needs_onednn
def test_fallback_when_the_op_fails(monkeypatch):
    def broken(*args):
        raise RuntimeError("no kernel for this CPU")

    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", broken)
    model = tiny_model("qwen2")
    with pytest.warns(UserWarning, match="oneDNN's linear failed a probe"):
        assert use_cpu_kernels(model, "fast") == "stock"
    ids = torch.randint(0, VOCAB, (1, 5))
    model(ids)  # still runs, on stock kernels


def test_unknown_kernels_and_cli_switch():
    with pytest.raises(GorgonError, match="unknown --cpu-kernels 'turbo'"):
        use_cpu_kernels(tiny_model("llama"), "turbo")
    args = generate_parser().parse_args(["--heads", "h", "--prompt", "x"])
    assert args.cpu_kernels == "fast"
    args = generate_parser().parse_args(["--heads", "h", "--prompt", "x", "--cpu-kernels", "stock"])
    assert args.cpu_kernels == "stock"


def sdpa_backends_enabled() -> dict[str, bool]:
    cuda = torch.backends.cuda
    return {"cudnn": cuda.cudnn_sdp_enabled(), "flash": cuda.flash_sdp_enabled(),
            "efficient": cuda.mem_efficient_sdp_enabled(), "math": cuda.math_sdp_enabled()}


def test_decoding_attention_leaves_out_cudnn_on_cuda_only():
    """cuDNN's attention sets up a graph for every new pair of query and key lengths, which decoding meets at
    almost every call: on CUDA the block runs on the other backends, and the flags come back after it."""
    from gorgon.decode.attention import decoding_attention

    before = sdpa_backends_enabled()
    assert all(before.values())  # torch's default: every backend allowed
    with decoding_attention(torch.device("cuda")):
        assert sdpa_backends_enabled() == {"cudnn": False, "flash": True, "efficient": True, "math": True}
    assert sdpa_backends_enabled() == before
    with decoding_attention(torch.device("cpu")):
        assert sdpa_backends_enabled() == before


@needs_onednn
def test_gorgon_and_generate_decode_on_the_same_attention_and_stock_on_torchs_own(tmp_path, monkeypatch):
    """The bench's `generate` baseline and the decoder (drafter included) run under `decoding_attention`;
    the `stock` baseline does not (torch's defaults). Checked on the CPU by recording where the block is open."""
    import contextlib

    import gorgon.decode.bench as bench
    import gorgon.decode.generate as generate_module

    target = load_target(str(tiny_chat_target(tmp_path)), device="cpu")
    use_cpu_kernels(target.model, "fast")
    model, inside, seen = target.model, [], []

    @contextlib.contextmanager
    def recording(device):
        inside.append(device.type)
        try:
            yield
        finally:
            inside.pop()

    monkeypatch.setattr(bench, "decoding_attention", recording)
    monkeypatch.setattr(generate_module, "decoding_attention", recording)
    generate = model.generate
    monkeypatch.setattr(model, "generate", lambda *a, **k: seen.append(("generate", list(inside))) or generate(*a, **k))
    drafter = MedusaDrafter(MedusaHeads.for_target(model), tree=[[0], [1], [0, 0]])
    propose = drafter.propose
    monkeypatch.setattr(drafter, "propose", lambda *a: seen.append(("propose", list(inside))) or propose(*a))
    methods = bench.timed_methods(model, drafter, ("generate", "stock"), None, Sampling(), None)
    ids = target.chat_ids([{"role": "user", "content": "count to five"}])
    calls = {}
    for name in ("baseline", "gorgon", "stock"):
        seen.clear()
        methods[name](ids, 6)
        calls[name] = {(what, tuple(where)) for what, where in seen}  # what ran, inside which blocks
    assert calls == {"baseline": {("generate", ("cpu",))}, "gorgon": {("propose", ("cpu",))},
                     "stock": {("generate", ())}}


@pytest.mark.slow
@needs_onednn
def test_bench_reports_both_ratios(tmp_path):
    target = load_target(str(tiny_chat_target(tmp_path)), device="cpu")
    use_cpu_kernels(target.model, "fast")
    drafter = MedusaDrafter(MedusaHeads.for_target(target.model), tree=[[0], [1], [0, 0]])
    questions = [{"question_id": i, "category": c, "turns": [f"count from {i}"]} for i, c in enumerate("ab")]
    report = run_bench(target, drafter, questions, max_new_tokens=10, progress=False)
    for key in ("stock_tokens", "stock_seconds", "identical_vs_stock"):
        assert all(key in q for q in report["questions"]), key
    stock = sum(q["stock_tokens"] for q in report["questions"]) / sum(q["stock_seconds"] for q in report["questions"])
    assert report["stock_tokens_per_s"] == pytest.approx(stock)
    assert report["speedup_vs_stock"] == pytest.approx(report["tokens_per_s"] / stock)
    assert report["identical"] == report["identical_vs_stock"] == 2
    assert report["per_category"]["a"]["identical_vs_stock"] == 1
    assert "speedup vs stock" in markdown_table(report)
    env = environment(target.model, drafter, Sampling(), 10)
    assert env["attention"] == "gorgon_tree_sdpa"
    assert env["greedy_argmax"] == ("full" if fast_kernels_unavailable(torch.bfloat16) else "bf16 screen")
    use_cpu_kernels(target.model, "stock")  # without the fast path there is one baseline only
    report = run_bench(target, drafter, questions, max_new_tokens=10, progress=False)
    assert "speedup_vs_stock" not in report and "speedup vs stock" not in markdown_table(report)
    env = environment(target.model, drafter, Sampling(), 10)
    assert env["attention"] == "sdpa" and env["greedy_argmax"] == "full"


def test_tree_size_follows_the_verify_costs():
    accuracies = [[0.6, 0.2, 0.1], [0.4, 0.2, 0.1], [0.3, 0.1, 0.1]]
    flat = {1: 10.0, 2: 10.0, 4: 10.0, 8: 10.0, 16: 10.0}
    steep = {1: 10.0, 2: 17.0, 4: 30.0, 8: 60.0, 16: 120.0}
    assert best_tree_size(accuracies, flat) == 16  # extra nodes are free: take them all
    assert best_tree_size(accuracies, steep) < 4
    assert interpolate_cost(steep, 3) == pytest.approx(23.5)
    assert interpolate_cost(steep, 32) == pytest.approx(240.0)
    with pytest.raises(GorgonError, match="must include a one-token forward"):
        best_tree_size(accuracies, {2: 1.0})


def test_a_feature_level_heads_tree_size_follows_the_verify_costs(monkeypatch, tmp_path):
    """--tree auto sizes an EAGLE head's tree for this machine, as Medusa heads', from its held-out
    accuracies per level; a head without them keeps the size saved with it."""
    import gorgon.decode.options as options
    from gorgon.decode.options import DecodeSettings, load_drafter
    from gorgon.heads import EagleHead

    target = load_target(str(tiny_chat_target(tmp_path)), device="cpu")
    head = EagleHead.for_target(target.model, depth=3)
    head.set_trees([], {"cpu": 6, "cuda": 12})
    head.save_pretrained(tmp_path / "bare")
    accuracies = [[0.6, 0.2, 0.1], [0.4, 0.2, 0.1]]
    head.set_trees(accuracies, {"cpu": 6, "cuda": 12})
    head.save_pretrained(tmp_path / "measured")
    assert EagleHead.from_pretrained(tmp_path / "measured", target=target).level_accuracies() == \
        [accuracies[0], accuracies[1], accuracies[1]]  # levels past the unrolled steps take the last step's
    flat = {1: 10.0, 2: 10.0, 4: 10.0, 8: 10.0, 16: 10.0}
    steep = {1: 10.0, 2: 17.0, 4: 30.0, 8: 60.0, 16: 120.0}
    for folder, costs, nodes in (("measured", flat, 16), ("measured", steep, best_tree_size(
            [accuracies[0], accuracies[1], accuracies[1]], steep)), ("bare", steep, 6)):
        monkeypatch.setattr(options, "verify_costs", lambda model, costs=costs: costs)
        args = generate_parser().parse_args(["--target", str(tmp_path / "tiny-llama-0"), "--heads",
                                             str(tmp_path / folder), "--prompt", "hi", "--device", "cpu"])
        _, drafter = load_drafter(DecodeSettings.from_args(args))
        assert drafter.nodes == nodes, (folder, costs)
    assert best_tree_size([accuracies[0], accuracies[1], accuracies[1]], steep) < 6


def test_verify_costs_are_measured_once_per_machine(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("GORGON_CACHE", str(tmp_path))
    calls = []

    def fake_measure(model, **kw):
        calls.append(model)
        return {1: 10.0, 2: 11.0, 4: 12.0}

    monkeypatch.setattr(calibrate, "measure_verify_costs", fake_measure)
    monkeypatch.setattr(calibrate, "busy_cores", lambda: 0.0)
    model = tiny_model("llama")
    assert calibrate.verify_costs(model) == {1: 10.0, 2: 11.0, 4: 12.0}
    assert calibrate.verify_costs(model) == {1: 10.0, 2: 11.0, 4: 12.0}
    assert len(calls) == 1
    said = capsys.readouterr().err  # before the silent seconds: what is timed, once, and how to skip it
    assert said.startswith("gorgon: timing target forwards of 1 to 16 tokens on this machine, to size the tree (once, "
                           "then kept; a fixed --tree N") and said.count("gorgon: timing") == 1
    (saved,) = (tmp_path / "calibration").glob("*.json")
    assert json.loads(saved.read_text())["key"]["kernels"] == "stock"
    saved.write_text("{broken")  # a damaged entry is measured again
    calibrate.verify_costs(model)
    assert len(calls) == 2


def test_a_drafted_levels_cost_times_only_a_plain_step_where_none_is_cached(monkeypatch, tmp_path, capsys):
    """The level cost's denominator timed every verify size (tens of seconds, in silence) even with --tree N."""
    monkeypatch.setenv("GORGON_CACHE", str(tmp_path))
    monkeypatch.setattr(calibrate, "_NOT_CACHED", {})
    timed, levels = [], []
    measure, median_ms = calibrate.measure_verify_costs, calibrate.median_ms
    monkeypatch.setattr(calibrate, "measure_verify_costs", lambda model, sizes=None, **kw: timed.append(
        (sizes, measure(model, sizes=sizes, **kw))) or timed[-1][1])
    monkeypatch.setattr(calibrate, "median_ms", lambda *args: levels.append(median_ms(*args)) or levels[-1])
    model = tiny_model("llama")
    cost = calibrate.level_cost(lambda: None, lambda: None, model, repeat=2)
    assert [sizes for sizes, _ in timed] == [(1,)] and capsys.readouterr().err == ""
    assert cost == pytest.approx(levels[0] / timed[0][1][1])  # the level's time in plain steps


def test_verify_costs_timed_beside_other_work_are_used_but_not_cached(monkeypatch, tmp_path, capsys):
    """Costs timed on a busy machine size that run's trees; cached, they would size every later run's wrongly."""
    threads = torch.get_num_threads()
    monkeypatch.setattr(calibrate.os, "getloadavg", lambda: (threads + 1.25, 0.0, 0.0))  # 1.25 besides ours
    assert calibrate.busy_cores() == 1.25
    monkeypatch.setattr(calibrate.os, "getloadavg", lambda: (threads - 0.5, 0.0, 0.0))
    assert calibrate.busy_cores() == 0.0
    monkeypatch.setenv("GORGON_CACHE", str(tmp_path))
    calls = []
    monkeypatch.setattr(calibrate, "measure_verify_costs", lambda model, **kw: calls.append(1) or {1: 10.0, 2: 10.5})
    monkeypatch.setattr(calibrate, "busy_cores", lambda: 1.8)
    monkeypatch.setattr(calibrate, "_NOT_CACHED", {})
    model = tiny_model("llama")
    assert calibrate.verify_costs(model) == {1: 10.0, 2: 10.5}
    assert "other work kept about 1.8 of" in capsys.readouterr().err
    assert not list(tmp_path.glob("calibration/*.json"))
    assert calibrate.verify_costs(model) == {1: 10.0, 2: 10.5} and len(calls) == 1  # timed once per process


def test_measured_verify_costs_cover_the_sizes():
    costs = calibrate.measure_verify_costs(tiny_model("gemma3"), sizes=(1, 2, 4), context=16, repeat=1)
    assert sorted(costs) == [1, 2, 4] and all(ms > 0 for ms in costs.values())
    assert calibrate.measured_sizes(torch.device("cpu")) == tuple(range(1, 17))  # a CPU's costs step: all timed


@needs_onednn
def test_verify_costs_are_timed_on_the_kernels_decoding_uses(monkeypatch):
    """Timed with autograd on, the fast path would hand every product to torch's stock kernels and the tree
    sizes would follow their costs (a misplaced decorator once did that: 4 tokens 1.4x one instead of 0.9x)."""
    model = tiny_model("llama")
    use_cpu_kernels(model, "fast", stock_rows=0)
    rows = rows_reaching_onednn(monkeypatch)
    calibrate.measure_verify_costs(model, sizes=(1, 4), context=16, repeat=1)
    assert {1, 4} <= set(rows)


@pytest.mark.slow
@pytest.mark.parametrize("kernels", ["fast", "stock"])
def test_profile_step_prints_one_json_line(tmp_path, kernels):
    tiny_model("llama").config.save_pretrained(tmp_path)
    run = subprocess.run([sys.executable, "scripts/profile_step.py", "--random-target", str(tmp_path / "config.json"),
                          "--tree", "4", "--json", "--repeat", "1", "--context", "16", "--cpu-kernels", kernels],
                         capture_output=True, text=True, cwd=Path(__file__).parents[1], timeout=300)
    assert run.returncode == 0, run.stderr
    (line,) = run.stdout.strip().splitlines()
    report = json.loads(line)
    assert {"plain_ms", "verify_ratio", "step_ratio", "tree_size", "kernels", "cpu_flags"} <= set(report)
    assert list(report["verify_ratio"]) == [str(n) for n in range(1, 17)] and report["verify_ratio"]["1"] == 1.0
    assert report["tree_size"] == 4
    assert report["kernels"] == (kernels if fast_kernels_unavailable(torch.float32) is None else "stock")


@pytest.mark.slow
def test_profile_step_caches_a_real_conversation_with_questions(tmp_path):
    target_path, target, _ = chat_target_with_heads(tmp_path)
    questions = questions_file(tmp_path / "q.jsonl")
    script = [sys.executable, "scripts/profile_step.py", "--repeat", "1", "--json", "--questions", str(questions)]
    run = subprocess.run(script + ["--target", str(target_path), "--heads", str(tmp_path / "heads"), "--context", "40",
                                   "--tree", "3"], capture_output=True, text=True, cwd=Path(__file__).parents[1],
                         timeout=300)
    assert run.returncode == 0, run.stderr
    report = json.loads(run.stdout.strip().splitlines()[-1])
    assert report["context"] == 40 and report["tree_size"] == 3 and report["cache"] == "conversation"
    profile_step = load_script("profile_step")
    ids = target.chat_ids([{"role": "user", "content": QUESTIONS[0]["turns"][0]}])
    cached = profile_step.conversation(target, str(questions), 40)
    answer = target.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=40 - ids.shape[1],
                                   min_new_tokens=40 - ids.shape[1], do_sample=False)
    assert cached.shape == (1, 40) and torch.equal(cached, answer)  # the question, then the greedy answer
    tiny_model("llama").config.save_pretrained(tmp_path / "random")
    bad = subprocess.run(script + ["--random-target", str(tmp_path / "random" / "config.json")], capture_output=True,
                         text=True, cwd=Path(__file__).parents[1], timeout=300)
    assert bad.returncode == 2 and "--questions needs a real target's tokenizer" in bad.stderr


@pytest.mark.slow
def test_trace_generation_labels_each_step_part(tmp_path):
    target_path, _, _ = chat_target_with_heads(tmp_path)
    questions = questions_file(tmp_path / "q.jsonl")
    run = subprocess.run([sys.executable, "scripts/trace_generation.py", "--target", str(target_path), "--heads",
                          str(tmp_path / "heads"), "--questions", str(questions), "--limit", "2",
                          "--max-new-tokens", "6", "--trace", str(tmp_path / "trace.json")],
                         capture_output=True, text=True, cwd=Path(__file__).parents[1], timeout=300)
    assert run.returncode == 0, run.stderr
    assert "== gorgon:" in run.stdout and "== generate:" in run.stdout
    (parts,) = [line for line in run.stdout.splitlines() if line.startswith("host time per verify step:")]
    for part in ("drafter propose", "verify forward", "greedy acceptance", "cache compaction"):
        assert part in parts, part
    (ops,) = [line for line in run.stdout.splitlines() if line.startswith("operators per verify step")]
    counts = dict(re.findall(r"(drafter propose|verify forward) (\d+)", ops))
    assert int(counts["verify forward"]) > int(counts["drafter propose"]) > 0  # the target's layers cost most
    assert re.search(r"operators per token \(views left out; the prefill's included\): [1-9]", run.stdout)
    assert json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    mine = tmp_path / "mine.json"
    mine.write_text("a user's file")
    bad = subprocess.run([sys.executable, "scripts/trace_generation.py", "--target", str(target_path), "--heads",
                          str(tmp_path / "heads"), "--questions", str(questions), "--trace", str(mine)],
                         capture_output=True, text=True, cwd=Path(__file__).parents[1], timeout=300)
    assert bad.returncode == 2 and bad.stderr.strip().splitlines()[-1].endswith("already exists: choose a new file")
    assert mine.read_text() == "a user's file"


@pytest.mark.slow
def test_revision_ab_runs_a_revisions_own_code_beside_the_working_trees(tmp_path):
    """scripts/revision_ab.py copies a revision's (or a folder's) heads/ and decode/ into a package of their
    own, whose imports stay inside it; against the same code both sides give the same tokens (and, with heads/ and
    decode/ unchanged since HEAD, the same trees and operator counts), one row at a time or in batches; a bad
    revision is one line."""
    root = Path(__file__).parents[1]
    if subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True).returncode:
        pytest.skip("not a git checkout")
    from gorgon.heads import EagleHead

    target_path, target, _ = chat_target_with_heads(tmp_path)
    EagleHead.for_target(target.model, target_fingerprint=target.fingerprint).save_pretrained(tmp_path / "eagle")
    revision_ab = load_script("revision_ab")
    for against in ("HEAD", str(root)):  # a revision, or a folder holding a copy's heads/ and decode/
        copy = tmp_path / f"copy-{len(against)}"
        name = revision_ab.revision_package(against, copy)
        sys.path.insert(0, str(copy))
        try:
            options = importlib.import_module(f"{name}.decode.options")
        finally:
            sys.path.remove(str(copy))
        assert Path(options.__file__).is_relative_to(copy) and options.ContextDrafter.__module__.startswith(name)
    with pytest.raises(GorgonError, match="this folder has no heads or decode"):
        revision_ab.revision_package(str(tmp_path / "eagle"), tmp_path / "copy-bad")
    script = [sys.executable, "scripts/revision_ab.py", "--target", str(target_path), "--heads",
              str(tmp_path / "eagle"), "--questions", str(questions_file(tmp_path / "q.jsonl")), "--limit", "2",
              "--rounds", "1", "--max-new-tokens", "6", "--draft-level-cost", "0"]  # a timed stop differs by side
    run = subprocess.run(script + ["--against", "HEAD"], capture_output=True, text=True, cwd=root, timeout=300)
    assert run.returncode == 0, run.stderr
    report = json.loads(run.stdout)
    assert report["same tokens"] and report["HEAD"]["proposals"] == report["working tree"]["proposals"] > 0
    if not subprocess.run(["git", "-C", str(root), "diff", "--quiet", "HEAD", "--", "heads", "decode"]).returncode:
        assert report["same trees"]
        assert report["HEAD"]["operators_per_proposal"] == report["working tree"]["operators_per_proposal"] > 0
    batched = subprocess.run(script + ["--against", "HEAD", "--batch-size", "2"], capture_output=True, text=True,
                             cwd=root, timeout=300)  # the two questions as one batch
    assert batched.returncode == 0, batched.stderr
    report = json.loads(batched.stdout)
    assert report["same tokens"] and report["HEAD"]["groups"] == report["working tree"]["groups"] == 1
    assert report["working tree"]["tau"] >= 1
    sampled = subprocess.run(script + ["--against", "HEAD", "--batch-size", "2", "--temperature", "0.7"],
                             capture_output=True, text=True, cwd=root, timeout=300)
    assert sampled.returncode == 2 and "leave out --temperature" in sampled.stderr.strip().splitlines()[-1]
    bad = subprocess.run(script + ["--against", "no-such-revision"], capture_output=True, text=True, cwd=root,
                         timeout=300)
    assert bad.returncode == 2 and "--against no-such-revision: no such revision" in bad.stderr.strip().splitlines()[-1]


def test_trace_generation_counts_each_part_once_when_cuda_annotates_it_too():
    trace_generation = load_script("trace_generation")
    from torch.autograd import DeviceType

    def event(key, device_type, cpu_us):  # as key_averages() gives them on CUDA
        return SimpleNamespace(key=key, device_type=device_type, cpu_time_total=cpu_us)

    events = [event("verify forward", DeviceType.CPU, 4000.0), event("verify forward", DeviceType.CUDA, 0.0),
              event("drafter propose", DeviceType.CPU, 1000.0), event("drafter propose", DeviceType.CUDA, 0.0),
              event("aten::mm", DeviceType.CPU, 9000.0)]
    assert trace_generation.host_ms_per_step(events, steps=2) == {"verify forward": 2.0, "drafter propose": 0.5}


@pytest.mark.slow
def test_attention_ab_times_both_and_finds_them_identical(tmp_path):
    target = tiny_chat_target(tmp_path)
    run = subprocess.run([sys.executable, "scripts/attention_ab.py", "--target", str(target), "--contexts", "16", "32",
                          "--repeat", "1", "--nodes", "4"],
                         capture_output=True, text=True, cwd=Path(__file__).parents[1], timeout=300)
    assert run.returncode == 0, run.stderr
    rows = [line for line in run.stdout.splitlines() if line.startswith("| 16 |") or line.startswith("| 32 |")]
    assert len(rows) == 2 and all(row.endswith("| True |") for row in rows)


def test_auto_tree_is_sized_from_accuracies_and_measured_costs(tmp_path, monkeypatch, capsys):
    import gorgon.decode.options as options

    target_path = tiny_chat_target(tmp_path)
    target = load_target(str(target_path), device="cpu")
    heads = MedusaHeads.for_target(target.model, num_heads=3, target_fingerprint=target.fingerprint)
    heads.trees = {"accuracies": [[0.6, 0.2, 0.1], [0.4, 0.2, 0.1], [0.3, 0.1, 0.1]], "cpu": [[0]]}
    heads.save_pretrained(tmp_path / "heads")
    args = generate_parser().parse_args(["--heads", str(tmp_path / "heads"), "--target", str(target_path),
                                         "--prompt", "x", "--cpu-kernels", "stock"])
    for costs, size in [({1: 10.0, 2: 10.0, 4: 10.0, 8: 10.0, 16: 10.0}, 16), ({1: 10.0, 2: 10.0, 4: 40.0}, 2)]:
        monkeypatch.setattr(options, "verify_costs", lambda model, costs=costs: costs)
        _, drafter = options.load_drafter(options.DecodeSettings.from_args(args))
        assert drafter.tree.size == size
        assert f"a {size}-node tree fits {tmp_path / 'heads'} best on this machine" in capsys.readouterr().err
    _, drafter = options.load_drafter(options.DecodeSettings.from_args(args, tree=3))  # an explicit size is kept
    assert drafter.tree.size == 3
