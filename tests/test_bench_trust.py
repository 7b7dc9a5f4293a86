"""A bench report that checks itself (issue 65): a speedup above what tau allows, step costs spread beyond the run's
own noise, or other work busy while timing flag it, in its JSON, table and plot, and `--update-card` refuses it."""

import json

import pytest
from helpers import QUESTIONS, chat_target_with_heads, questions_file, tiny_chat_target

import gorgon.decode.bench as bench
import gorgon.decode.calibrate as calibrate
from gorgon.decode.bench import bench_report, markdown_table, speedup_bound, spread_beyond_noise
from gorgon.heads import GorgonError, MedusaDrafter, MedusaHeads, load_target


def row(qid: int, tau: float, speedup: float, plain_ms: float = 50.0, busy: float = 0.0) -> dict:
    """A question's row as the bench records it: 100 tokens each way, gorgon's in 100 / tau target forwards, the
    baseline's at `plain_ms` a token, gorgon's `speedup` times as fast."""
    baseline_seconds = 100 * plain_ms / 1000
    return {"question_id": qid, "category": "writing" if qid % 2 else "math", "tokens": 100,
            "seconds": baseline_seconds / speedup, "target_forwards": round(100 / tau), "baseline_tokens": 100,
            "baseline_seconds": baseline_seconds, "identical": True, "speedup": speedup, "busy_cores": busy}


def report_of(rows: list[dict]) -> dict:
    return bench_report(rows, [], {1: 10}, greedy=True, extra=(), stock=False, busy_before=0.0)


def test_a_speedup_tau_cannot_give_is_flagged_and_a_plausible_one_is_not():
    """Issue 65's report: 3.68x at tau 1.03, on a machine shared with training. A speculative step costs at least
    about a plain one, so tau 1.03 allows about 1.03x."""
    assert speedup_bound(1.0) == pytest.approx(1.5)
    impossible = report_of([row(i, tau=1.03, speedup=3.68) for i in range(4)])
    assert impossible["trust"]["ok"] is False
    assert "all: speedup 3.68x at tau 1.03, above the 1.55x that tau allows" in impossible["trust"]["reasons"]
    plausible = report_of([row(i, tau=1.6, speedup=1.94) for i in range(4)])  # MT-Bench coding: 0.82 steps a step
    assert plausible["trust"] == {"ok": True, "reasons": []}


def test_each_speculative_method_and_category_is_held_to_its_tau():
    rows = [{**row(i, tau=2.0, speedup=1.5), "no-context_tokens": 100, "no-context_seconds": 5.0 / 3,
             "no-context_target_forwards": 100, "no-context_identical": True} for i in range(4)]
    report = bench_report(rows, [], {}, greedy=True, extra=("no-context",), stock=False, busy_before=0.0)
    assert report["no-context_speedup"] == pytest.approx(3.0)  # at tau 1: impossible
    assert [r.split(":")[0] for r in report["trust"]["reasons"]] == ["math (no-context)", "writing (no-context)",
                                                                     "all (no-context)"]


def test_step_costs_spread_beyond_the_runs_noise_are_flagged():
    """The baseline's seconds per token spread 1.0x over the questions here (a quiet run): its step costs may
    spread SPREAD_ALLOWANCE = 3x. One question's gorgon run slowed 4x is beyond that; the same with a baseline that
    itself spread 1.5x is not (a noisy run: 3 x 1.5^2 = 6.75x)."""
    quiet = [row(i, tau=2.0, speedup=s) for i, s in enumerate((1.6, 1.5, 1.7, 0.4))]
    assert "spread 4.2x, beyond the 3.0x that the baseline's own spread (1.00x" in spread_beyond_noise(quiet)
    assert spread_beyond_noise(quiet[:3]) is None  # trees that differ between questions
    noisy = [row(i, tau=2.0, speedup=s, plain_ms=ms) for i, (s, ms) in enumerate(zip((1.6, 1.5, 1.7, 0.4),
                                                                                      (50, 60, 75, 50)))]
    assert spread_beyond_noise(noisy) is None
    assert spread_beyond_noise(quiet[:2] + quiet[3:]) is not None and spread_beyond_noise(quiet[:2]) is None


def test_other_work_while_timing_is_flagged_in_the_json_and_the_table():
    busy = report_of([row(i, tau=2.0, speedup=1.6, busy=b) for i, b in enumerate((1.6, 1.8, 2.0, 1.8))])
    assert busy["busy_cores"]["while_timing"] == pytest.approx(1.8) and busy["busy_cores"]["before"] == 0.0
    saved = json.loads(json.dumps(busy))
    assert saved["trust"]["ok"] is False
    assert saved["trust"]["reasons"][0].startswith("other work kept about 1.8 of ")
    table = markdown_table(busy)
    assert "**These figures are not to be trusted** (rerun on a quiet machine):\n- other work kept about 1.8" in table
    assert "not to be trusted" not in markdown_table(report_of([row(i, tau=2.0, speedup=1.6, busy=0.3)
                                                                for i in range(4)]))


def test_the_plot_says_so(monkeypatch, tmp_path):
    import matplotlib.pyplot as plt

    drawn = []

    def title_drawn(fig, path):
        drawn.append(fig.get_suptitle().replace("\n", " "))
        plt.close(fig)

    monkeypatch.setattr(bench, "save_figure", title_drawn)
    bench.plot_report(report_of([row(i, tau=1.03, speedup=3.68) for i in range(4)]), tmp_path / "r.png")
    bench.plot_report(report_of([row(i, tau=2.0, speedup=1.6) for i in range(4)]), tmp_path / "r.png")
    assert drawn[0] == ("NOT TO BE TRUSTED: math: speedup 3.68x at tau 1.03, above the 1.55x that tau allows (and 2 "
                        "more reasons); rerun on a quiet machine")
    assert drawn[1] == ""


def test_busy_cores_over_an_interval_leave_this_process_out(monkeypatch):
    """4 s of busy cores in 2 s of wall time, 1 s of it this process's: the others kept 1.5 cores busy."""
    monkeypatch.setattr(calibrate, "cpu_reading", lambda: calibrate.CpuReading(wall=12.0, busy=54.0, own=6.0))
    assert calibrate.busy_cores(calibrate.CpuReading(wall=10.0, busy=50.0, own=5.0)) == 1.5
    assert calibrate.busy_cores(calibrate.CpuReading(wall=10.0, busy=None, own=5.0)) == 0.0  # no /proc/stat


def test_a_real_bench_beside_a_spinning_process_flags_its_report(tmp_path, monkeypatch):
    """The tiny target's bench, with the load measure reading 1.9 other cores busy (as a second process spinning
    on both cores of this machine would): every question records it and the report is flagged."""
    target = load_target(str(tiny_chat_target(tmp_path)), device="cpu")
    drafter = MedusaDrafter(MedusaHeads.for_target(target.model), tree=[[0], [1], [0, 0]])
    measured = []
    monkeypatch.setattr(bench, "busy_cores", lambda since=None: measured.append(since) or 1.9)
    report = bench.run_bench(target, drafter, QUESTIONS, max_new_tokens=6, baselines=("generate",), progress=False)
    assert measured[0] is None and all(isinstance(m, calibrate.CpuReading) for m in measured[1:])  # before, then each
    assert [q["busy_cores"] for q in report["questions"]] == [1.9] * 4
    assert report["busy_cores"] == {"before": 1.9, "while_timing": 1.9, "cores": report["busy_cores"]["cores"]}
    assert report["trust"]["ok"] is False and report["trust"]["reasons"][0].startswith("other work kept about 1.9")


def test_update_card_refuses_a_flagged_report(tmp_path, monkeypatch, capsys):
    """The report is written and printed, saying why; the card and the metrics it is built from stay as they were."""
    target_path, _, heads = chat_target_with_heads(tmp_path)
    (heads / "recipe.json").write_text("{}")
    (heads / "metrics.json").write_text("{}")
    before = {p.name: p.read_bytes() for p in heads.iterdir()}
    flagged = report_of([row(i, tau=1.03, speedup=3.68, busy=1.9) for i in range(4)])
    monkeypatch.setattr(bench, "run_bench", lambda *args, **kwargs: flagged)
    out = tmp_path / "report.json"
    with pytest.raises(GorgonError) as refused:
        bench.main(["--target", str(target_path), "--heads", str(heads), "--tree", "3", "--questions",
                    str(questions_file(tmp_path / "q.jsonl")), "--out", str(out), "--update-card"])
    said = str(refused.value)
    assert "\n" not in said and said.startswith("these figures are not to be trusted, so the model card is left as it "
                                               "was: other work kept about 1.9 of")
    assert said.endswith("while timing (and 3 more reasons); rerun on a quiet machine")
    assert {p.name: p.read_bytes() for p in heads.iterdir()} == before
    assert json.loads(out.read_text())["trust"]["ok"] is False
    assert "**These figures are not to be trusted**" in capsys.readouterr().out
