"""`gorgon bench`: the report's fields, the identical count catching a broken decoder, bad question files."""

import json
import re
import subprocess
import sys

import pytest
from helpers import (
    QUESTIONS,
    ROOT,
    another_live_process,
    chat_target_with_heads,
    env,
    questions_file,
    saved_heads,
    tiny_chat_target,
    tiny_model,
)
from transformers import AutoModelForCausalLM

import gorgon.decode.acceptance as acceptance
import gorgon.decode.bench as bench
import gorgon.decode.generate as generate_module
from gorgon.decode.bench import markdown_table, run_bench, summarize
from gorgon.decode.questions import load_questions
from gorgon.heads import GorgonError, MedusaDrafter, MedusaHeads, load_target
from gorgon.heads.cli import main as gorgon
from gorgon.train.data import DataSettings, make_dataset


@pytest.fixture
def setup(tmp_path):
    target = load_target(str(tiny_chat_target(tmp_path)), device="cpu")
    drafter = MedusaDrafter(MedusaHeads.for_target(target.model), tree=[[0], [1], [0, 0]])
    return target, drafter


@pytest.mark.slow
def test_report_fields(setup):
    target, drafter = setup
    report = run_bench(target, drafter, QUESTIONS, max_new_tokens=12, baselines=("generate", "prompt-lookup"),
                       progress=False)
    for key in ["tau", "tokens_per_s", "baseline_tokens_per_s", "speedup", "speedup_median", "identical", "prompts",
                "per_category", "accepted_histogram", "prompt-lookup_speedup"]:
        assert key in report, key
    assert report["prompts"] == 4 and report["identical"] == 4
    assert set(report["per_category"]) == {"writing", "math", "coding"}
    assert report["per_category"]["writing"]["prompts"] == 2
    steps = sum(report["accepted_histogram"].values())
    tokens = sum(int(k) * v for k, v in report["accepted_histogram"].items())
    forwards = sum(q["target_forwards"] for q in report["questions"])
    assert report["tau"] == pytest.approx(sum(q["tokens"] for q in report["questions"]) / forwards)
    assert report["speedup"] == pytest.approx(report["tokens_per_s"] / report["baseline_tokens_per_s"])
    assert steps == forwards - 8  # every verify step, i.e. all forwards but the 4 x 2 prefills
    assert tokens + 8 >= sum(q["tokens"] for q in report["questions"])  # output is cut at max_new_tokens
    assert "| **all** | 4 |" in markdown_table(report)


def test_summary_figures_on_hand_made_rows():
    """Rates are pooled (all tokens over all seconds), a speedup is gorgon's rate over the baseline's, tau counts
    every target forward (prefills included), and the median is the middle question's speedup."""
    rows = [dict(tokens=t, seconds=s, target_forwards=f, speedup=x, identical=1, baseline_tokens=t, baseline_seconds=b,
                 stock_tokens=t, stock_seconds=3 * b, identical_vs_stock=1, **{
                     "prompt-lookup_tokens": t, "prompt-lookup_seconds": b / 2,
                     "no-context_tokens": t, "no-context_seconds": s, "no-context_target_forwards": 2 * f,
                     "no-context_identical": 1})
            for t, s, b, f, x in [(30, 1.0, 2.0, 12, 2.0), (10, 1.0, 0.5, 8, 0.5), (20, 1.0, 1.0, 10, 1.0)]]
    report = summarize(rows, greedy=True, extra=("prompt-lookup", "no-context"), stock=True)
    # 60 tokens in 3 s, the baseline's in 3.5 s (stock: 10.5 s, prompt lookup: 1.75 s), over 30 forwards
    expected = {"prompts": 3, "tau": 2.0, "tokens_per_s": 20.0, "baseline_tokens_per_s": 120 / 7,
                "speedup": 7 / 6, "speedup_median": 1.0, "identical": 3, "stock_tokens_per_s": 40 / 7,
                "speedup_vs_stock": 3.5, "identical_vs_stock": 3, "prompt-lookup_tokens_per_s": 240 / 7,
                "prompt-lookup_speedup": 2.0, "no-context_tokens_per_s": 20.0, "no-context_speedup": 7 / 6,
                "no-context_tau": 1.0, "no-context_identical": 3}
    assert report == pytest.approx(expected)


@pytest.mark.slow
def test_identical_count_drops_when_the_decoder_is_broken(setup, monkeypatch):
    target, drafter = setup

    def accept_first_child(tree, tokens, best):  # accepts drafts without checking them
        path = tree.path_to[int(tree.children[0, 0])]
        return path, tokens[list(path[1:])].tolist() + [int(best[path[-1]])]

    monkeypatch.setattr(generate_module, "accept_greedy", accept_first_child)
    report = run_bench(target, drafter, QUESTIONS, max_new_tokens=12, progress=False)
    assert report["identical"] < 4
    monkeypatch.setattr(generate_module, "accept_greedy", acceptance.accept_greedy)
    assert run_bench(target, drafter, QUESTIONS, max_new_tokens=12, progress=False)["identical"] == 4


def test_bad_question_files(tmp_path):
    with pytest.raises(GorgonError, match="not found"):
        load_questions(str(tmp_path / "nope.jsonl"))
    (tmp_path / "a.jsonl").write_text(json.dumps({"question_id": 1, "prompt": "hi"}) + "\n")
    with pytest.raises(GorgonError, match="record 1 has no usable 'turns'"):
        load_questions(str(tmp_path / "a.jsonl"))
    (tmp_path / "b.jsonl").write_text("{oops\n")
    with pytest.raises(GorgonError, match="line 1 is not valid JSON"):
        load_questions(str(tmp_path / "b.jsonl"))
    (tmp_path / "c.jsonl").write_text("\n")
    with pytest.raises(GorgonError, match="holds no questions"):
        load_questions(str(tmp_path / "c.jsonl"))


@pytest.mark.slow
def test_cli_writes_an_atomic_report_and_plot(tmp_path):
    target_path, _, _ = chat_target_with_heads(tmp_path)
    q = questions_file(tmp_path / "q.jsonl")
    run = subprocess.run([sys.executable, "-m", "gorgon.heads.cli", "bench", "--target", str(target_path), "--heads",
                          str(tmp_path / "heads"), "--questions", str(q), "--max-new-tokens", "8", "--limit", "3",
                          "--per-category", "1", "--out", str(tmp_path / "r" / "report.json")],
                         env=env(), capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    report = json.loads((tmp_path / "r" / "report.json").read_text())
    # --limit 3 keeps questions 0-2 (writing, math, writing), --per-category 1 the first of each category
    assert report["prompts"] == 2 and set(report["per_category"]) == {"writing", "math"}
    assert report["threads"] == 1 and report["dtype"] == "float32"  # env() sets OMP_NUM_THREADS=1
    assert report["versions"]["transformers"] and report["tree_size"] >= 2
    assert report["complete"] is True and report["questions_planned"] == 2
    assert (tmp_path / "r" / "report.png").stat().st_size > 1000
    assert "| **all** |" in run.stdout and f"tree of {report['tree_size']} nodes" in run.stdout
    bad = subprocess.run([sys.executable, "-m", "gorgon.heads.cli", "bench", "--heads", str(tmp_path / "heads"),
                          "--questions", str(q), "--baselines", "medusa"], capture_output=True, text=True)
    assert bad.returncode == 2 and "unknown baseline 'medusa'" in bad.stderr


@pytest.mark.slow
def test_a_bench_stopped_early_leaves_the_questions_it_ran(tmp_path, monkeypatch, capsys):
    """A time limit or Ctrl-C in the third question: --out holds the first two, marked incomplete, and the
    bench says so."""
    target_path, _, _ = chat_target_with_heads(tmp_path)
    q = questions_file(tmp_path / "q.jsonl")
    calls, timed = [], bench.timed_speculative

    def stopped_in_the_third_question(*args, **kwargs):
        calls.append(None)
        if len(calls) == 1 + 2 * 2 + 1:  # the warm-up, two questions of two turns, then the third's first turn
            raise KeyboardInterrupt
        return timed(*args, **kwargs)

    monkeypatch.setattr(bench, "timed_speculative", stopped_in_the_third_question)
    out = tmp_path / "report.json"
    with pytest.raises(KeyboardInterrupt):
        bench.main(["--target", str(target_path), "--heads", str(tmp_path / "heads"), "--questions", str(q),
                    "--max-new-tokens", "6", "--baselines", "generate", "--out", str(out)])
    assert (f"gorgon bench: {out} keeps the 2 questions finished so far: rerun the same command to go on from them"
            in capsys.readouterr().err)
    report = json.loads(out.read_text())
    assert report["complete"] is False and report["questions_planned"] == 4
    assert [r["question_id"] for r in report["questions"]] == [0, 1] and report["prompts"] == 2
    assert report["identical"] == 2 and report["target"]
    assert report["tau"] == pytest.approx(sum(q["tokens"] for q in report["questions"]) /
                                          sum(q["target_forwards"] for q in report["questions"]))
    assert bench.is_report(out) and not out.with_suffix(".png").exists()
    # The same command goes on from them (it was refused: only --overwrite, which lost them); other settings not.
    command = ["--target", str(target_path), "--heads", str(tmp_path / "heads"), "--questions", str(q),
               "--max-new-tokens", "6", "--baselines", "generate", "--out", str(out)]
    with pytest.raises(GorgonError, match=r"report.json holds an unfinished bench with other settings "
                                          r"\(max_new_tokens\): rerun with the same ones to go on from it"):
        bench.main([*command, "--max-new-tokens", "5"])
    out.with_suffix(".png").write_bytes(b"an image of mine")  # the plot the resumed bench would write
    with pytest.raises(GorgonError, match=r"report.png already holds files this command did not write"):
        bench.main(command)
    out.with_suffix(".png").unlink()
    calls.clear()
    monkeypatch.setattr(bench, "timed_speculative", timed)
    assert bench.main(command) == 0
    whole = json.loads(out.read_text())
    assert whole["complete"] is True and [r["question_id"] for r in whole["questions"]] == [0, 1, 2, 3]
    assert whole["questions"][:2] == report["questions"] and whole["prompts"] == 4


@pytest.mark.slow
def test_update_card_writes_the_measured_figures(tmp_path, monkeypatch):
    import gorgon.decode.bench as bench
    from gorgon.train.heads import HeadsTrainConfig, train

    monkeypatch.setattr(bench, "busy_cores", lambda since=None: 0.0)  # a busy machine's report is refused a card

    target_path = tiny_chat_target(tmp_path)
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"q{i}"},
                                                     {"role": "assistant", "content": "an answer " * 3}]}) + "\n"
                            for i in range(8)))
    heads = train(HeadsTrainConfig(data=str(data), out=str(tmp_path / "h"), target=str(target_path), max_steps=2,
                                   batch_size=4, report_to="none", save_every=0))
    card = (heads / "README.md").read_text()
    assert card.startswith("---\nlibrary_name: gorgon\npipeline_tag: text-generation\ntags:\n- medusa\n")
    assert "base_model" not in card.split("---")[1]  # a local target: the Hub refuses a path there (and the push)
    assert "| 1 | t+2 |" in card and "Not measured yet" in card and "--format vllm" in card
    assert f"gorgon generate --heads {heads} " in card  # the folder, which gorgon push makes the repo id
    q = questions_file(tmp_path / "q.jsonl")
    assert gorgon(["bench", "--target", str(target_path), "--heads", str(heads), "--questions", str(q),
                   "--max-new-tokens", "6", "--limit", "2", "--update-card"]) == 0
    card = (heads / "README.md").read_text()
    assert "Not measured yet" not in card and "| questions | tau |" in card and "gorgon bench --target" in card
    kept = json.loads((heads / "metrics.json").read_text())["bench"]  # a card made again (push's) keeps them
    assert kept["prompts"] == 2 and "questions" not in kept
    from gorgon.decode.calibrate import cpu_flags

    assert not cpu_flags() or f"(CPU flags: {', '.join(cpu_flags())})" in card  # the flags decide the kernels' speed


@pytest.mark.slow
def test_bench_with_a_draft_model(tmp_path, monkeypatch, capsys):
    from helpers import toy_data

    import gorgon.decode.bench as bench
    from gorgon.train.draft import DraftTrainConfig, train

    monkeypatch.setattr(bench, "busy_cores", lambda since=None: 0.0)  # a busy machine's report is refused a card

    target_path = tiny_chat_target(tmp_path)
    draft_path = train(DraftTrainConfig(data=toy_data(tmp_path / "toy.jsonl", n=8), out=str(tmp_path / "draft"),
                                        target=str(target_path), student_layers=1, max_steps=0, report_to="none",
                                        draft_vocab_size=32))
    q = questions_file(tmp_path / "q.jsonl")
    capsys.readouterr()
    assert gorgon(["bench", "--target", str(target_path), "--draft", str(draft_path), "--draft-tokens", "3",
                   "--questions", str(q), "--max-new-tokens", "8", "--limit", "2", "--out", str(tmp_path / "r.json"),
                   "--update-card"]) == 0
    err = capsys.readouterr().err
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["identical"] == 2 and report["tree_size"] == 4 and report["drafter"] == str(draft_path)
    assert "the draft drafts from its 32-token draft vocabulary" in err
    cost = float(re.search(r"a drafted level costs (\d+\.\d+) target steps here", err).group(1))
    assert 0 < cost < 5
    assert report["tree"] == f"built per step (depth 3, top-k 1, no deeper once chances sum below {cost:.2f})"
    card = (draft_path / "README.md").read_text()
    assert "# Draft model for" in card and "| questions | tau |" in card and "Not measured yet" not in card
    bad = subprocess.run([sys.executable, "-m", "gorgon.heads.cli", "bench", "--target", str(target_path), "--draft",
                          str(tmp_path / "nope"), "--questions", str(q)], capture_output=True, text=True)
    assert bad.returncode == 2 and "no draft model" in bad.stderr.strip().splitlines()[-1]
    tokenizer = load_target(str(draft_path), device="cpu").tokenizer
    tokenizer.add_tokens(["<extra>"])
    tokenizer.save_pretrained(draft_path)
    bad = subprocess.run([sys.executable, "-m", "gorgon.heads.cli", "bench", "--target", str(target_path), "--draft",
                          str(draft_path), "--questions", str(q)], capture_output=True, text=True)
    assert bad.returncode == 2 and "tokenizer differs from the target's (1 tokens" in bad.stderr


def test_tau_without_timing_counts_every_step(setup):
    from gorgon.decode.generate import speculative_generate
    from gorgon.decode.questions import per_category_sample
    from gorgon.decode.tau import measure_tau

    target, drafter = setup
    assert [q["question_id"] for q in per_category_sample(QUESTIONS, 1)] == [0, 1, 3]  # one writing, math, coding
    report = measure_tau(target, drafter, QUESTIONS, max_new_tokens=10)
    assert set(report["per_category"]) == {"writing", "math", "coding"} and report["tokens"] > 8 * 4
    assert report["nodes_per_step"] == 4.0  # the fixed 4-node tree, every step
    one = [{"question_id": 0, "category": "a", "turns": ["count from 1"]}]
    ids = target.tokenizer.apply_chat_template([{"role": "user", "content": "count from 1"}],
                                               add_generation_prompt=True, return_tensors="pt",
                                               return_dict=True)["input_ids"]
    alone = speculative_generate(target.model, drafter, ids, 10)
    assert measure_tau(target, drafter, one, max_new_tokens=10)["tau"] == alone.tau
    # The drafter's check of its target is passed through too (skipped, heads for other shapes failed inside torch)
    from gorgon.heads import GorgonError, MedusaDrafter, MedusaHeads
    with pytest.raises(GorgonError, match="trained for another target, of a vocabulary of 64, but the target has 128"):
        measure_tau(target, MedusaDrafter(MedusaHeads.for_target(tiny_model("llama"))), one, max_new_tokens=10)


@pytest.mark.slow
def test_tau_scripts_refuse_bad_input_in_one_line(tmp_path):
    """scripts/tau.py and scripts/learning_curve.py: a missing question file, and a --out they did not write,
    each end in one line and exit 2 before any model is loaded; an earlier curve needs --overwrite."""
    def script(name, *args):
        run = subprocess.run([sys.executable, str(ROOT / "scripts" / name), *args], capture_output=True, text=True,
                             timeout=120)
        return run.returncode, run.stderr.strip()

    code, err = script("tau.py", "--context-draft", "--questions", str(tmp_path / "none.jsonl"))
    assert code == 2 and err.startswith("scripts/tau.py: error: questions file") and "\n" not in err
    code, err = script("tau.py", "--heads", "h", "--context-draft", "--chain", "--questions", "q.jsonl")
    assert code == 2 and "error: --chain drafts the --heads or --draft drafter alone: drop --context-draft" in err \
        and "\n" not in err
    foreign = tmp_path / "notes.json"
    foreign.write_text('{"mine": true}')
    code, err = script("learning_curve.py", "--heads", "h", "--questions", "q.jsonl", "--out", str(foreign))
    assert (code, err) == (2, f"scripts/learning_curve.py: error: --out {foreign} already holds files this command did "
                              "not write: choose a new file")
    assert foreign.read_text() == '{"mine": true}'
    earlier = tmp_path / "curve.json"
    earlier.write_text(json.dumps({"points": [], "nodes": 8}))
    code, err = script("learning_curve.py", "--heads", "h", "--questions", "q.jsonl", "--out", str(earlier))
    assert code == 2 and err.endswith("holds earlier gorgon output: pass --overwrite to replace it, or choose another "
                                      "--out")


def test_the_learning_curve_fits_each_methods_gain_per_doubling_of_the_data(tmp_path):
    """Two methods on shares of 100, 200 and 400 conversations; one method measured at one share has no line.
    The plot draws every draft position."""
    from helpers import load_script

    curve = load_script("learning_curve")
    points = [{"arch": "parallel", "train_conversations": n, "tau": 1.3 + 0.05 * d,
               "top1_per_position": [0.3 + 0.04 * d, 0.1 + 0.02 * d - (0.01 if d == 1 else 0)], "top1": 0.3 + 0.04 * d}
              for d, n in enumerate((100, 200, 400))]
    points += [{"arch": "eagle", "train_conversations": 400, "tau": 1.5, "top1_per_position": [0.4, 0.3],
                "top1": 0.4}]
    gains = curve.per_doubling(points)
    assert list(gains) == ["parallel"]
    assert gains["parallel"]["tau"] == pytest.approx(0.05)
    assert gains["parallel"]["top1_per_position"] == pytest.approx([0.04, 0.02])  # the dip at 200 is symmetric
    curve.plot(points, tmp_path / "curve.png")
    assert (tmp_path / "curve.png").stat().st_size > 0


@pytest.mark.slow
def test_compare_heads_are_timed_in_the_same_rotation_and_drafted_as_the_heads(tmp_path, capsys, monkeypatch):
    """Each compared drafter's tau (two heads folders and a draft model) equals its own run as --heads or
    --draft, merged with its own context drafter and alone; other heads' folders and a Medusa-2 folder are
    refused in one line."""
    import shutil

    from helpers import toy_data

    import gorgon.decode.bench as bench
    from gorgon.heads import EagleHead, MergedDrafter
    from gorgon.heads.cli import main as gorgon
    from gorgon.train.draft import DraftTrainConfig, train

    timed = set()  # which drafters ran: (the merged drafter's inner drafter or the drafter, merged or not)

    def spy(model, drafter, *args, **kwargs):
        merged = isinstance(drafter, MergedDrafter)
        timed.add((type(drafter.drafter if merged else drafter).__name__, merged))
        return speculative_generate(model, drafter, *args, **kwargs)

    speculative_generate = bench.speculative_generate
    monkeypatch.setattr(bench, "speculative_generate", spy)
    # A search stops at the same level in every run, not at a level cost timed anew by each.
    monkeypatch.setattr("gorgon.decode.options.drafted_level_cost", lambda drafter, model: 0.5)

    target_path = tiny_chat_target(tmp_path)
    target = load_target(str(target_path), device="cpu")
    EagleHead.for_target(target.model, target_fingerprint=target.fingerprint).save_pretrained(tmp_path / "eagle")
    MedusaHeads.for_target(target.model, target_fingerprint=target.fingerprint).save_pretrained(tmp_path / "medusa")
    EagleHead.for_target(target.model, target_fingerprint=target.fingerprint).save_pretrained(tmp_path / "eagle2")
    draft = train(DraftTrainConfig(data=toy_data(tmp_path / "toy.jsonl", n=8), out=str(tmp_path / "draft"),
                                   target=str(target_path), student_layers=1, max_steps=0, report_to="none"))
    q = questions_file(tmp_path / "q.jsonl", QUESTIONS[:3])
    common = ["--target", str(target_path), "--questions", str(q), "--max-new-tokens", "10", "--tree", "3",
              "--context-draft", "--baselines", "generate,no-context"]
    assert gorgon(["bench", "--heads", str(tmp_path / "eagle"), "--compare-heads", str(tmp_path / "medusa"),
                   str(tmp_path / "eagle2"), "--compare-draft", str(draft), "--out", str(tmp_path / "all.json")]
                  + common) == 0
    assert gorgon(["bench", "--heads", str(tmp_path / "medusa"), "--out", str(tmp_path / "medusa.json")] + common) == 0
    assert gorgon(["bench", "--draft", str(draft), "--out", str(tmp_path / "draft.json")] + common[:6]
                  + common[8:]) == 0  # no --tree: a compared draft model drafts its own default chain
    both, alone, drafted = (json.loads((tmp_path / name).read_text()) for name in ("all.json", "medusa.json",
                                                                                  "draft.json"))
    assert [(c["name"], c.get("heads") or c["draft"]) for c in both["compare"]] == [
        ("compare", str(tmp_path / "medusa")), ("compare2", str(tmp_path / "eagle2")), ("compare3", str(draft))]
    assert both["compare"][0]["tree"] == "built per step" and both["compare"][0]["tree_size"] == 16
    for name in ("compare", "compare2", "compare3"):
        assert both["identical"] == both[f"{name}_identical"] == both[f"{name}-no-context_identical"] == 3
    assert both["compare_tau"] == alone["tau"] and both["compare-no-context_tau"] == alone["no-context_tau"]
    assert both["compare2_tau"] == both["tau"]  # a copy of the heads under test drafts the same trees
    assert both["compare3_tau"] == drafted["tau"] and both["compare3-no-context_tau"] == drafted["no-context_tau"]
    assert timed >= {("EagleDrafter", True), ("EagleDrafter", False), ("MedusaDrafter", True), ("MedusaDrafter", False),
                     ("DraftModelDrafter", True), ("DraftModelDrafter", False)}
    out = capsys.readouterr().out
    assert "compare-no-context tau" in out and "tree built per step, up to 16 nodes" in out  # a merged tree's budget
    assert f"compare: the heads in {tmp_path / 'medusa'}" in out  # the table and the plot name them
    assert f"compare3: the draft model {draft}" in out
    assert [bench.baseline_label(both, name) for name in ("no-context", "compare-no-context", "compare3")] == [
        "no-context", "compare-no-context (medusa)", "compare3 (draft)"]

    other = load_target(str(tiny_chat_target(tmp_path, seed=1)), device="cpu")
    MedusaHeads.for_target(other.model, target_fingerprint=other.fingerprint).save_pretrained(tmp_path / "foreign")
    shutil.copytree(tmp_path / "medusa", tmp_path / "medusa2")
    (tmp_path / "medusa2" / "adapter").mkdir()
    for folder, extra, says in (("foreign", [], "fingerprint"),
                                ("medusa2", [], "holds Medusa heads with an adapter (adapter/) that changes the "
                                                "target: compare them as --heads"),
                                ("medusa", ["--draft-dtype", "bfloat16"], "keep the target's dtype")):
        assert gorgon(["bench", "--heads", str(tmp_path / "eagle"), "--compare-heads", str(tmp_path / folder)]
                      + common + extra) == 2
        last = capsys.readouterr().err.strip().splitlines()[-1]
        assert last.startswith("gorgon bench: error: ") and says in last, last
    assert gorgon(["bench", "--context-draft", "--compare-heads", str(tmp_path / "medusa"), "--questions", str(q)]) == 2
    assert capsys.readouterr().err.strip().endswith("--compare-heads times other drafters beside the --heads or "
                                                    "--draft under test: pass one too")


@pytest.mark.slow
def test_the_chain_baseline_drafts_what_vllm_verifies(tmp_path, capsys):
    """--baselines chain: the heads' top candidate per level, every level drafted, for each method (an EAGLE
    head's search and Medusa's and the parallel drafter's rank paths), with the tau and output of the same chain
    asked for by hand; context drafts alone have no chain."""
    from gorgon.heads import EagleHead
    from gorgon.heads.methods.parallel import ParallelHead

    target_path = tiny_chat_target(tmp_path)
    target = load_target(str(target_path), device="cpu")
    EagleHead.for_target(target.model, target_fingerprint=target.fingerprint, depth=3).save_pretrained(
        tmp_path / "eagle")
    MedusaHeads.for_target(target.model, num_heads=2, target_fingerprint=target.fingerprint).save_pretrained(
        tmp_path / "medusa")
    ParallelHead.for_target(target.model, 3, None, None, "tiny", target.fingerprint).save_pretrained(
        tmp_path / "parallel")
    q = questions_file(tmp_path / "q.jsonl", QUESTIONS[:2])
    common = ["--target", str(target_path), "--questions", str(q), "--max-new-tokens", "12"]
    (tmp_path / "chain2.json").write_text("[[0], [0, 0]]")
    (tmp_path / "chain3.json").write_text("[[0], [0, 0], [0, 0, 0]]")
    by_hand = {"eagle": ["--tree", "4", "--draft-depth", "3", "--draft-topk", "1", "--draft-level-cost", "0"],
               "medusa": ["--tree", str(tmp_path / "chain2.json")],
               "parallel": ["--tree", str(tmp_path / "chain3.json")]}
    for heads, chain in by_hand.items():
        out, hand = tmp_path / f"{heads}.json", tmp_path / f"{heads}-hand.json"
        assert gorgon(["bench", "--heads", str(tmp_path / heads), "--baselines", "generate,chain", "--out", str(out)]
                      + common) == 0
        assert gorgon(["bench", "--heads", str(tmp_path / heads), "--baselines", "generate", "--out", str(hand)]
                      + common + chain) == 0
        report, alone = json.loads(out.read_text()), json.loads(hand.read_text())
        assert report["chain_tau"] == alone["tau"] and report["chain_identical"] == 2, heads
        assert report["chain"] == alone["tree"], heads
    both = tmp_path / "both.json"  # a compared drafter's chain too
    assert gorgon(["bench", "--heads", str(tmp_path / "eagle"), "--compare-heads", str(tmp_path / "medusa"),
                   "--baselines", "generate,chain", "--out", str(both)] + common) == 0
    report = json.loads(both.read_text())
    assert report["chain_tau"] == json.loads((tmp_path / "eagle.json").read_text())["chain_tau"]
    assert report["compare-chain_tau"] == json.loads((tmp_path / "medusa-hand.json").read_text())["tau"]
    assert report["compare"][0]["chain"] == json.loads((tmp_path / "medusa-hand.json").read_text())["tree"]
    assert bench.baseline_label(report, "compare-chain") == "compare-chain (medusa)"
    assert gorgon(["bench", "--context-draft", "--baselines", "generate,chain"] + common) == 2
    assert capsys.readouterr().err.strip().endswith("--baselines chain drafts the --heads or --draft drafter as one "
                                                    "chain: pass one of them")


@pytest.mark.slow
def test_a_report_named_like_its_plot_is_refused(tmp_path, capsys):
    message = "--out is the JSON report, and its plot is written beside it with the suffix .png: pass a .json path"
    assert gorgon(["bench", "--context-draft", "--questions", "q.jsonl", "--out", str(tmp_path / "r.png")]) == 2
    assert capsys.readouterr().err.strip().endswith(message)
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "learning_curve.py"), "--heads", "h", "--questions",
                          "q.jsonl", "--out", str(tmp_path / "curve.png")], env=env(), capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 2 and run.stderr.strip().endswith(message), run.stderr[-2000:]
    assert not list(tmp_path.iterdir())


def test_a_card_update_that_cannot_be_made_is_refused_before_the_benchmark(tmp_path, capsys):
    """--update-card on heads without training's recipe.json and metrics.json (save_pretrained's, a download's)
    ran the whole benchmark, then failed, its figures lost; now it fails first (the questions file named here
    does not exist, an error of its own)."""
    heads = saved_heads(tmp_path)
    for folder in (str(heads), "someone/heads"):
        assert gorgon(["bench", "--heads", folder, "--questions", "nowhere.jsonl", "--update-card"]) == 2
        assert capsys.readouterr().err == (f"gorgon bench: error: {folder} has no recipe.json/metrics.json, so its "
                                           "card cannot be rebuilt: --update-card works on folders written by "
                                           "gorgon's training\n")


@pytest.mark.slow
def test_a_report_another_live_bench_writes_is_refused(tmp_path, capsys):
    """Two benches into one --out both wrote the report after each question, and one's figures were lost."""
    from gorgon.heads.files import host_name
    from gorgon.heads.outputs import process_start

    target = tiny_chat_target(tmp_path)
    heads = tmp_path / "heads"
    MedusaHeads.for_target(AutoModelForCausalLM.from_pretrained(target)).save_pretrained(heads)
    out = tmp_path / "r.json"
    bench = ["bench", "--heads", str(heads), "--target", str(target), "--questions",
             str(questions_file(tmp_path / "q.jsonl", QUESTIONS[:1])), "--max-new-tokens", "4", "--out", str(out)]
    with another_live_process() as pid:
        (tmp_path / ".r.json.lock").write_text(f"{host_name()} {pid} {process_start(pid)}\n")
        assert gorgon(bench) == 2
        assert capsys.readouterr().err.strip().endswith(f"{out} is being written by another gorgon bench "
                                                        f"(process {pid}, still running): wait for it to "
                                                        f"end, or stop it (kill {pid}), then retry")
    assert gorgon(bench) == 0 and out.is_file()  # its process gone, the lock is stale
    assert not (tmp_path / ".r.json.lock").exists()  # given back at the end


@pytest.mark.slow
def test_bench_counts_only_the_questions_it_ran(tmp_path):
    target = load_target(str(tiny_chat_target(tmp_path)), device="cpu")  # context 512, one token per character
    drafter = MedusaDrafter(MedusaHeads.for_target(target.model), tree=[[0], [1], [0, 0]])
    too_long = {"question_id": 99, "category": "roleplay", "turns": ["x" * 600]}
    report = run_bench(target, drafter, [QUESTIONS[0], too_long], max_new_tokens=8, progress=False)
    assert report["prompts"] == 1 and report["identical"] == 1 and "roleplay" not in report["per_category"]
    assert report["speedup"] == pytest.approx(report["questions"][0]["speedup"]) == report["speedup_median"]
    assert [q["question_id"] for q in report["skipped"]] == [99]
    assert "exceeds the context" in report["skipped"][0]["reason"]
    with pytest.raises(GorgonError, match="no question fits the context"):
        run_bench(target, drafter, [too_long], max_new_tokens=8, progress=False)
    questions = tmp_path / "q.jsonl"
    questions.write_text(json.dumps(QUESTIONS[0]) + "\n")
    with pytest.raises(GorgonError, match="--limit must be at least 1"):
        load_questions(str(questions), limit=0)
    with pytest.raises(GorgonError, match="questions file .* is a folder: pass a .jsonl"):
        load_questions(str(tmp_path))
    with pytest.raises(GorgonError, match="--limit must be at least 1"):
        make_dataset(DataSettings(prompts=str(questions), limit=0), tmp_path / "data", progress=False)


def test_a_turn_fits_the_context_as_the_decoder_counts_it(tmp_path):
    """The bench asked a turn only with a position to spare, while the decoder takes a reply whose last token
    lands on the context's end (that token is never fed back): both now count as `fits_context` does."""
    from gorgon.decode.questions import ask

    target = load_target(str(tiny_chat_target(tmp_path)), device="cpu")  # context 512, one token per character
    base = target.chat_ids([{"role": "user", "content": "x"}]).shape[1]
    for extra, asked in [(0, 1), (1, 0)]:  # a prompt of 505 (+ 8 new - 1 = 512 positions), then of 506
        turn = "x" * (512 - 8 + 1 - base + 1 + extra)
        question = {"question_id": 1, "category": "writing", "turns": [turn]}
        assert ask(target, question, 8, lambda ids: [5] * 8) == asked
