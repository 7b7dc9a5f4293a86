"""Batched speculative decoding: every row is what its own greedy `generate` gives, rows finish on their own, drafts
follow each row's acceptance and the batch's verify cost, sampling stays exact per row, and bad input is one line."""

import json
import time

import pytest
import torch
from helpers import TargetRolloutDrafter, import_families, reference, tiny_model
from scipy.stats import chisquare

from gorgon.decode import Sampling, speculative_generate
from gorgon.decode.batch import BatchCosts, Pace, batch_width, speculative_generate_batch
from gorgon.decode.bench_batch import left_padded
from gorgon.decode.calibrate import calibration_entry, verify_costs
from gorgon.decode.kernels import use_cpu_kernels
from gorgon.heads import EagleDrafter, EagleHead, GorgonError, MedusaDrafter, MedusaHeads, load_target
from gorgon.heads.methods.context import ContextDrafter, MergedDrafter
from gorgon.heads.quantize import quantize_model

V = 8
FAMILIES = ["llama", "mistral"]  # full attention; a sliding window shorter than the prompts


@pytest.fixture(scope="module", autouse=True)
def families():
    import_families(FAMILIES + ["gemma2"])


def sharp_model(arch, seed=0):
    model = tiny_model(arch, vocab=V, layers=4, seed=seed)
    with torch.no_grad():  # a small vocabulary and sharp logits: drafts are often right, so paths go deep
        model.lm_head.weight.mul_(10)
    return model


def prompts_of(lengths, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, V, (n,), generator=generator) for n in lengths]


def eagle(model, **search):
    torch.manual_seed(1)
    head = EagleHead.for_target(model)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return EagleDrafter(head, **search)


def assert_rows_are_their_own(model, drafter, prompts, new=20):
    """Every row of the batch decoded greedily is the model's own `generate` on that prompt alone."""
    ids, mask = left_padded(prompts, 0)
    batch = speculative_generate_batch(model, drafter, ids, attention_mask=mask, max_new_tokens=new, costs=None)
    assert [row.tokens for row in batch.rows] == [reference(model, p[None], new) for p in prompts]
    return batch


@pytest.mark.parametrize("arch", FAMILIES)
@pytest.mark.parametrize("merged", [False, True])
def test_every_row_is_its_own_greedy_generate(arch, merged, monkeypatch):
    model = sharp_model(arch)
    drafter = eagle(model, nodes=8, depth=3, topk=2)
    together, rows = EagleDrafter.scored_paths_together, []
    monkeypatch.setattr(EagleDrafter, "scored_paths_together",
                        staticmethod(lambda drafters, *args: rows.append(len(drafters)) or together(drafters, *args)))
    if merged:
        drafter = MergedDrafter(drafter, ContextDrafter())
    batch = assert_rows_are_their_own(model, drafter, prompts_of([5, 9, 3, 7]), new=25)
    assert max(a for row in batch.rows for a in row.accepted) >= 3  # drafted paths were accepted, deep
    assert max(batch.widths) > 1
    assert rows[0] == 4 and sum(rows) == sum(batch.drafting)  # the drafting rows drafted together, once a step


@pytest.mark.parametrize("kind", ["draft model", "parallel"])
def test_a_draft_model_and_a_parallel_drafter_decode_a_batch(kind):
    from gorgon.heads import DraftModelDrafter
    from gorgon.heads.methods.parallel import ParallelDrafter, ParallelHead

    model = sharp_model("llama")
    if kind == "draft model":
        drafter = DraftModelDrafter(sharp_model("llama", seed=1), k=3, topk=2)
    else:
        torch.manual_seed(0)
        drafter = ParallelDrafter(ParallelHead.for_target(model, 3), tree=6)
    assert_rows_are_their_own(model, drafter, prompts_of([5, 8, 3], seed=5))


def test_medusa_heads_decode_a_batch_of_a_family_with_mixed_layers():
    model = sharp_model("gemma2")
    torch.manual_seed(0)
    heads = MedusaHeads.for_target(model, num_heads=3)
    drafter = MergedDrafter(MedusaDrafter(heads, tree=[[0], [1], [0, 0], [0, 0, 0]]), ContextDrafter())
    assert_rows_are_their_own(model, drafter, prompts_of([6, 10, 4], seed=2))


def test_rows_stop_on_their_own_and_leave_the_batch():
    model = sharp_model("llama")
    prompts = prompts_of([5, 8, 6, 4], seed=9)
    references = [reference(model, p[None], 30) for p in prompts]
    eos = next(t for t in references[1] if t not in references[0])  # the second row ends early, the first does not
    ids, mask = left_padded(prompts, 0)
    batch = speculative_generate_batch(model, eagle(model, nodes=6, depth=3, topk=2), ids, attention_mask=mask,
                                       max_new_tokens=30, eos_token_id=eos, costs=None)
    for expected, row in zip(references, batch.rows):
        end = expected.index(eos) + 1 if eos in expected else len(expected)
        assert row.tokens == expected[:end]
        assert sum(row.accepted) == len(row.tokens)
    assert len(batch.rows[0].tokens) == 30 and len(batch.rows[1].tokens) < 30
    assert batch.drafting[-1] < len(prompts)  # the batch was smaller at the end: finished rows left it


class KnowingDrafter:
    """Knows each prompt's greedy continuation: drafts it (a chain of 4) for the prompts in `right`, and for those in
    `wrong` drafts other tokens, slowly (2 ms), as a drafter that fits the text badly would."""

    feature_layers = None
    max_nodes = 5

    def __init__(self, right: dict[tuple[int, ...], list[int]], wrong: dict[tuple[int, ...], list[int]]):
        self.right, self.wrong = right, wrong

    def fresh(self):
        return self

    def scored_paths(self, root, features, context):
        ids = context.tolist()
        for prompt, continuation in {**self.right, **self.wrong}.items():
            if tuple(ids[:len(prompt)]) == prompt:
                done = len(ids) - len(prompt) + 1  # the root is the output's token `done - 1`
                chain = continuation[done:done + 4]
                if prompt in self.wrong:
                    time.sleep(0.002)
                    chain = [(t + 1) % V for t in chain]
                return [(chain[:d], 0.9 ** d) for d in range(1, len(chain) + 1)]
        raise AssertionError("a prompt it was not told about")

    def propose(self, root, features, context):
        raise AssertionError("a batch asks for scored_paths")


def test_a_row_whose_drafts_fail_stops_drafting_while_one_that_accepts_goes_on():
    model = sharp_model("llama")
    good, bad = prompts_of([6, 7], seed=4)
    drafter = KnowingDrafter({tuple(good.tolist()): reference(model, good[None], 40)},
                             {tuple(bad.tolist()): reference(model, bad[None], 40)})
    ids, mask = left_padded([good, bad], 0)
    costs = {2: {1: 10.0, 2: 10.5, 3: 11.0, 4: 11.5, 5: 12.0}}  # candidates nearly free, drafting 2 ms a row
    batch = speculative_generate_batch(model, drafter, ids, attention_mask=mask, max_new_tokens=40, costs=costs)
    assert [row.tokens for row in batch.rows] == [reference(model, p[None], 40) for p in (good, bad)]
    assert max(batch.rows[0].accepted) == 5          # the row that is drafted right accepts whole chains
    assert set(batch.rows[1].accepted[1:]) == {1}    # the other accepts nothing drafted...
    assert 1 in batch.drafting                        # ...and stops drafting, while the first goes on


def test_a_pace_passed_from_call_to_call_goes_on_from_what_earlier_calls_measured():
    """A serving loop's calls share one Pace: where earlier calls found drafted steps losing, the next call starts
    with plain steps instead of trying drafts again; a fresh pace drafts first. Rows stay their own either way."""
    model = sharp_model("llama")
    good, other = prompts_of([6, 7], seed=4)
    drafter = KnowingDrafter({tuple(good.tolist()): reference(model, good[None], 12)},
                             {tuple(other.tolist()): reference(model, other[None], 12)})
    ids, mask = left_padded([good, other], 0)
    costs = {2: {1: 10.0, 2: 10.5, 3: 11.0, 4: 11.5, 5: 12.0}}
    losing = Pace(on=True)
    losing.rate, losing.wait = {True: 1.0, False: 100.0}, 64  # what earlier calls measured
    carried = speculative_generate_batch(model, drafter, ids, attention_mask=mask, max_new_tokens=12, costs=costs,
                                         pace=losing)
    fresh = speculative_generate_batch(model, drafter, ids, attention_mask=mask, max_new_tokens=12, costs=costs)
    want = [reference(model, p[None], 12) for p in (good, other)]
    assert [r.tokens for r in carried.rows] == want == [r.tokens for r in fresh.rows]
    assert set(carried.drafting) == {0} and losing.plain == len(carried.drafting)  # the pace went on counting
    assert fresh.drafting[0] > 0


def test_the_batch_verifies_no_candidates_where_they_cannot_pay():
    assert batch_width([[0.9, 0.8], [0.1]], {1: 10.0, 2: 10.0, 3: 10.0}) == 3
    assert batch_width([[0.9, 0.8], [0.1]], {1: 10.0, 2: 20.0, 3: 30.0}) == 1  # each node costs a whole step
    assert batch_width([[0.9, 0.8], [0.1]], {1: 10.0, 2: 13.0, 3: 20.0}) == 2
    assert batch_width([[], []], {1: 10.0}) == 1
    assert batch_width([[0.5], [0.1, 0.1]], None) == 3  # unsized: every candidate


def test_costs_at_a_batch_size_come_from_the_nearest_measured_size_above():
    sizing = BatchCosts(None, 8, {1: {1: 1.0}, 2: {1: 2.0}, 4: {1: 4.0}, 8: {1: 8.0}})
    assert [sizing.at(b)[1] for b in (1, 2, 3, 5, 8)] == [1.0, 2.0, 4.0, 8.0, 8.0]
    assert BatchCosts(None, 8, None).at(3) is None


def test_verify_costs_of_a_batch_are_timed_once_and_kept_apart_from_one_rows(monkeypatch, tmp_path):
    import gorgon.decode.calibrate as calibrate

    monkeypatch.setenv("GORGON_CACHE", str(tmp_path))
    monkeypatch.setattr(calibrate, "busy_cores", lambda since=None: 0.0)  # a busy machine's costs are not kept
    model = tiny_model("llama")
    assert calibration_entry(model, 4)[1] != calibration_entry(model, 1)[1]
    costs = verify_costs(model, 4)
    assert sorted(costs) == [1, 2, 3, 4, 6, 8] and all(ms > 0 for ms in costs.values())
    assert calibration_entry(model, 4)[2].exists()


def test_a_batch_of_one_is_the_one_row_decoder():
    model = sharp_model("llama")
    prompt = prompts_of([6])[0][None]
    batch = speculative_generate_batch(model, eagle(model, nodes=6, depth=3, topk=2), prompt, max_new_tokens=20)
    one = speculative_generate(model, eagle(model, nodes=6, depth=3, topk=2), prompt, max_new_tokens=20)
    assert batch.rows[0].tokens == one.tokens and batch.rows[0].accepted == one.accepted


def test_bad_batches_are_refused_in_one_line():
    model = tiny_model("llama")
    drafter = eagle(model, nodes=4, depth=2, topk=2)
    ids, mask = left_padded(prompts_of([4, 5]), 0)
    class OneRowDrafter:
        feature_layers, max_nodes = None, 1

        def propose(self, root, features, context):
            return root.reshape(1), None

    cases = [
        (dict(input_ids=ids[:0]), "the batch is empty"),
        (dict(input_ids=ids, attention_mask=mask[:, 1:]), "attention_mask has shape"),
        (dict(input_ids=ids, attention_mask=mask.flip(1)), "after its start"),  # right padding
        (dict(input_ids=ids, attention_mask=mask, drafter=OneRowDrafter()), "cannot draft for a batch"),
    ]
    for arguments, message in cases:
        with pytest.raises(GorgonError, match=message) as refused:
            speculative_generate_batch(model, **{"drafter": drafter, **arguments})
        assert "\n" not in str(refused.value)
    with pytest.raises(GorgonError, match="speculative_generate_batch decodes several"):
        speculative_generate(model, drafter, ids)


@pytest.mark.slow
def test_sampling_is_exact_in_every_row():
    """Two rows of different prompts sampled together: each row's 3-token continuations fit its own exact
    distribution (chi-square), from drafts the target often accepts."""
    import itertools

    from gorgon.decode.acceptance import target_probs

    model = tiny_model("llama", vocab=V, seed=3)
    with torch.no_grad():
        model.lm_head.weight.mul_(40)
    s, samples, new = Sampling(temperature=1.0), 2000, 3
    prompts = [torch.tensor([1, 5, 2]), torch.tensor([4, 4, 0, 6, 3])]
    ids, mask = left_padded(prompts, 0)
    drafter = TargetRolloutDrafter(model, [[0], [1], [0, 0], [1, 0]])
    generator = torch.Generator().manual_seed(1234)
    counts, accepted = [{}, {}], []
    for _ in range(samples):
        batch = speculative_generate_batch(model, drafter, ids, attention_mask=mask, max_new_tokens=new, sampling=s,
                                           generator=generator, costs=None)
        for row, result in zip(counts, batch.rows):
            row[tuple(result.tokens)] = row.get(tuple(result.tokens), 0) + 1
            accepted += result.accepted[1:]
    assert max(accepted) >= 2  # drafted tokens, not only bonus ones, were accepted
    seqs = torch.tensor(list(itertools.product(range(V), repeat=new)))
    for prompt, row in zip(prompts, counts):
        full = torch.cat([prompt.expand(len(seqs), -1), seqs], 1)
        with torch.no_grad():
            logits = model(full).logits[:, prompt.numel() - 1:-1]
        exact = target_probs(logits, s).gather(2, seqs[..., None])[..., 0].prod(1)
        expected = exact * samples
        common = expected >= 5
        observed = [row.get(tuple(seq.tolist()), 0) for seq in seqs]
        obs = [o for o, c in zip(observed, common) if c] + [sum(o for o, c in zip(observed, common) if not c)]
        exp = expected[common].tolist() + [float(expected[~common].sum())]
        assert len(obs) >= 6
        assert chisquare(obs, [e * sum(obs) / sum(exp) for e in exp]).pvalue > 1e-3


def test_the_schedule_gives_each_measured_batch_size_the_drafts_it_chose_and_none_where_they_lost():
    from gorgon.decode.bench_batch import schedule

    entries = [{"batch": 1, "draft_gain": 1.8, "median_width": 5},
               {"batch": 4, "draft_gain": 1.1, "median_width": 2.5},
               {"batch": 16, "draft_gain": 0.99, "median_width": 2},
               {"batch": 32, "draft_gain": 1.0, "median_width": 1}]
    assert schedule(entries) == [[1, 1, 4], [2, 4, 2], [5, 16, 0], [17, 32, 0]]


def test_an_export_serves_with_the_measured_draft_length_per_batch_size(tmp_path, capsys):
    """What `bench --batch-sizes --update-card` kept in metrics.json goes into vLLM's speculative config, in the
    format vLLM 0.32 validates (vllm/v1/spec_decode/dynamic/utils.py: inclusive ranges from 1)."""
    from helpers import tiny_chat_target

    from gorgon.heads.cli import main as gorgon

    target = tiny_chat_target(tmp_path, layers=6)
    model = load_target(str(target), device="cpu").model
    EagleHead.for_target(model).save_pretrained(tmp_path / "head")
    plan = [[1, 1, 9], [2, 8, 2], [9, 32, 0]]  # 9 drafts at batch 1: more than the head's chain drafts
    (tmp_path / "head" / "metrics.json").write_text(json.dumps({"batch_bench": {"schedule": plan}}))
    assert gorgon(["export", "--heads", str(tmp_path / "head"), "--target", str(target), "--format", "eagle3",
                   "--out", str(tmp_path / "out")]) == 0
    captured = capsys.readouterr()
    command = next(line for line in captured.out.splitlines() if "next, serve them" in line)
    spec = json.loads(command.split("--speculative-config ", 1)[1].strip("'"))
    most = spec["num_speculative_tokens"]
    assert most < 9 and spec["method"] == "eagle3"
    assert spec["num_speculative_tokens_per_batch_size"] == [[1, 1, most], [2, 8, 2], [9, 32, 0]]
    assert "llama.cpp have no such setting" in captured.err


@pytest.mark.slow
def test_bench_batch_sizes_reports_each_size_plots_it_and_goes_on_after_a_stop(tmp_path, capsys, monkeypatch):
    from helpers import questions_file, tiny_chat_target

    import gorgon.decode.bench as bench
    import gorgon.decode.bench_batch as bench_batch
    from gorgon.heads.cli import main as gorgon

    target = tiny_chat_target(tmp_path)
    model = load_target(str(target), device="cpu").model
    MedusaHeads.for_target(model, num_heads=2).save_pretrained(tmp_path / "heads")
    questions = questions_file(tmp_path / "q.jsonl")
    out = tmp_path / "b" / "batch.json"
    command = ["--target", str(target), "--heads", str(tmp_path / "heads"), "--context-draft", "--questions",
               str(questions), "--batch-sizes", "1,2", "--max-new-tokens", "6", "--out", str(out)]
    real, calls = bench_batch.batch_figures, []

    def stopped_in_the_second_size(*args):
        calls.append(args[0])
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args)

    monkeypatch.setattr(bench_batch, "batch_figures", stopped_in_the_second_size)
    with pytest.raises(KeyboardInterrupt):
        bench.main(command)
    stopped = json.loads(out.read_text())
    assert stopped["complete"] is False and [e["batch"] for e in stopped["batches"]] == [1]
    monkeypatch.setattr(bench_batch, "batch_figures", real)
    assert bench.main(command) == 0  # goes on: batch 1 is kept, batch 2 run
    report = json.loads(out.read_text())
    assert report["complete"] and [e["batch"] for e in report["batches"]] == [1, 2]
    assert report["batches"][0] == stopped["batches"][0]
    for entry in report["batches"]:
        assert entry["identical"] == entry["rows"] and entry["speedup"] > 0 and entry["tau"] >= 1
    assert report["schedule"][0][:2] == [1, 1] and report["schedule"][-1][1] == 2
    assert out.with_suffix(".png").stat().st_size > 0
    assert "| batch | rows | tau |" in capsys.readouterr().out
    assert gorgon(["bench", *command[:-2], "--out", str(tmp_path / "c.json"), "--temperature", "0.7"]) == 2
    assert "--batch-sizes benches greedy decoding" in capsys.readouterr().err


def test_a_card_shows_the_speedup_by_batch_size_and_the_schedule():
    from gorgon.heads.card import batch_section

    report = {"batches": [{"batch": 1, "tau": 1.8, "tokens_per_s": 23.1, "baseline_tokens_per_s": 13.9,
                           "speedup": 1.66, "identical": 80, "rows": 80},
                          {"batch": 4, "tau": 1.07, "tokens_per_s": 47.4, "baseline_tokens_per_s": 46.2,
                           "speedup": 1.03, "identical": 80, "rows": 80}],
              "schedule": [[1, 1, 5], [2, 4, 0]], "device": "cpu (AMD EPYC)", "threads": 1,
              "command": "gorgon bench --batch-sizes 1,4"}
    section = batch_section(report)
    assert "| 1 | 1.80 | 23.1 | 13.9 | 1.66x | 80/80 |" in section and "| 4 | 1.07 |" in section
    assert "`[[1, 1, 5], [2, 4, 0]]`" in section and "`gorgon bench --batch-sizes 1,4`" in section
    assert batch_section(None) == ""


@pytest.mark.parametrize("scheme", ["w4a8", "int4"])
def test_a_quantized_targets_rows_are_each_its_own_generate(scheme):
    """Each node of each row attends alone (the row kernel, skipping the keys padding hides) on products that read
    only their own row, so a quantized batch gives every row its own one-row output."""
    model = tiny_model("llama", vocab=64, layers=2, seed=4)  # shapes the 4-bit kernels take
    with torch.no_grad():
        model.lm_head.weight.mul_(4)
    quantize_model(model, scheme)
    use_cpu_kernels(model, "stock")  # a quantized target's attention
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 64, (n,), generator=generator) for n in (6, 11, 3, 8)]
    batch = assert_rows_are_their_own(model, MergedDrafter(eagle(model, nodes=6, depth=2, topk=2), ContextDrafter()),
                                      prompts, new=16)
    assert max(batch.widths) > 1
