"""gorgon beside llama.cpp on this CPU: the same prompts, one thread each, timed in turn.

    bash scripts/engines.sh llama.cpp   # once: llama.cpp's server and converter in ~/.cache/gorgon/engines/llama.cpp
    OMP_NUM_THREADS=1 python scripts/llama_cpp_peer.py --heads runs/heads/eagle-fp32-4ep \\
        --questions scripts/data/mt_bench.jsonl --limit 80 --max-new-tokens 64 --out runs/peer

What a CPU user would otherwise run is llama.cpp. The first turn of each question goes, in turn, to:
  generate            transformers' greedy `generate` on gorgon's target and kernels (float32), gorgon's baseline;
  gorgon              the --heads merged with context drafts, the tree sized for this machine: gorgon's best here;
  llama.cpp-F         llama.cpp alone, for each GGUF F of the target: f32 (llama.cpp's converter, the weights gorgon
                      runs) and, with --gguf (default: the embedded target's own Q4_1 file), that one;
  llama.cpp-F-lookup  its prompt lookup (`--spec-type ngram-simple`, on 3-grams, 5 tokens: `LOOKUP`);
  llama.cpp-F-eagle3  its EAGLE-3 with the heads' eagle3 export (llama.cpp's converter), a chain of --chain tokens.
Each llama.cpp row is a `llama-server` of its own (one thread, one slot), all started before the timings, so that
every question is timed on every row within the same minute (which row goes first rotates). Speed is the tokens a
row generated over the wall seconds of its answers, prompt included (gorgon's call, llama.cpp's HTTP request).
Exactness, each against its own plain decoding: gorgon against `generate`, a llama.cpp draft against the same GGUF
alone; llama.cpp f32 against `generate` shows where two float32 kernels round apart.

Writes OUT/peer.json after each question (atomically) and goes on from it when run again with the same settings
(a larger --limit times only the questions it adds).
"""

import json
import statistics
import sys
import time
from pathlib import Path

# llama.cpp's prompt lookup with gorgon's context-draft settings (the last 3 tokens looked up, 5 drafted): its
# defaults (12 and 48) found no match in a first run on MT-Bench, a plain decoding with lookups' cost.
LOOKUP = ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "3", "--spec-ngram-simple-size-m", "5"]


def rows_to_time(heads: str, target: str | None, gguf: str | None, chain: int | None, engines: Path | None,
                 out: Path):
    """gorgon's target and drafter, and the llama.cpp rows: name -> (GGUF, llama-server options)."""
    from serving_parity import default_engine, eagle3_options, exported, target_gguf, to_gguf

    from gorgon.decode import from_options
    from gorgon.heads.target import embedded_gguf_path, embedded_target_dir

    loaded, drafter = from_options(heads=heads, target=target, context_draft=True)
    where = loaded.model.config._name_or_path  # the folder gorgon loaded the target from
    folder = engines / "llama.cpp" if engines else default_engine("llama.cpp")
    export, _ = exported(Path(heads), "eagle3", target, out)
    chain = chain or json.loads((export / "config.json").read_text())["gorgon"]["depth"]
    models = {"f32": target_gguf(folder, where, out / "llama.cpp")}
    if gguf is None and Path(where).resolve() == embedded_target_dir().resolve():  # the target as shipped
        gguf = str(embedded_gguf_path())
    if gguf is not None:
        models[Path(gguf).stem.rsplit(".", 1)[-1]] = Path(gguf)  # SmolLM2-135M-Instruct.Q4_1 -> Q4_1
    draft = to_gguf(folder, export, out / "llama.cpp" / "draft-eagle3.gguf", out / "llama.cpp" / "convert-eagle3.log",
                    "--target-model-dir", str(where))
    servers = {}
    for kind, model in models.items():
        servers[f"llama.cpp-{kind}"] = (model, [])
        servers[f"llama.cpp-{kind}-lookup"] = (model, LOOKUP)
        servers[f"llama.cpp-{kind}-eagle3"] = (model, eagle3_options(draft, chain))
    return loaded, drafter, folder, servers


def timed_llama(url: str, ids: list[int], max_new_tokens: int) -> dict:
    from serving_parity import complete

    start = time.perf_counter()
    answer = complete(url, ids, max_new_tokens)
    seconds = time.perf_counter() - start
    timings = answer["timings"]
    return {"tokens": list(answer["tokens"]), "seconds": seconds, "drafted": timings.get("draft_n", 0),
            "accepted": timings.get("draft_n_accepted", 0)}


def timed_gorgon(model, drafter, ids, max_new_tokens: int) -> dict:
    from gorgon.decode import Sampling
    from gorgon.decode.bench import timed_generate, timed_speculative

    if drafter is None:
        tokens, seconds = timed_generate(model, ids, max_new_tokens, Sampling())
        return {"tokens": tokens, "seconds": seconds}
    result = timed_speculative(model, drafter, ids, max_new_tokens, Sampling())
    return {"tokens": result.tokens, "seconds": result.seconds, "target_forwards": result.target_forwards}


def reference(name: str) -> str | None:
    """The row a row's output must equal: its own plain decoding (None for a plain row)."""
    if name == "gorgon":
        return "generate"
    if name.endswith(("-lookup", "-eagle3")):
        return name.rsplit("-", 1)[0]
    return None


def summary(questions: list[dict]) -> dict:
    """Per row: tokens/s over all questions, speedup over its own plain row, tokens per target forward, identical
    answers to its reference; and llama.cpp f32 alone against `generate`."""
    names = list(questions[0]["rows"])
    tokens = {name: sum(len(q["rows"][name]["tokens"]) for q in questions) for name in names}
    rate = {name: tokens[name] / sum(q["rows"][name]["seconds"] for q in questions) for name in names}
    rows = {}
    for name in names:
        row = {"tokens_per_s": rate[name], "speedup_over_generate": rate[name] / rate["generate"]}
        plain = reference(name)
        if plain is not None:
            row["speedup"] = rate[name] / rate[plain]
            row["identical"] = sum(q["rows"][name]["tokens"] == q["rows"][plain]["tokens"] for q in questions)
            if name == "gorgon":
                forwards = sum(q["rows"][name]["target_forwards"] for q in questions)
            else:  # each verify step emits its accepted drafts and one token of the target's; the prefill one
                forwards = tokens[name] - sum(q["rows"][name]["accepted"] for q in questions)
            row["tau"] = tokens[name] / max(1, forwards)
        rows[name] = row
    same = sum(q["rows"]["llama.cpp-f32"]["tokens"] == q["rows"]["generate"]["tokens"] for q in questions)
    busy = [q["busy_cores"] for q in questions if q["busy_cores"] is not None]
    return {"rows": rows, "llama.cpp-f32 == generate": same,
            "busy_cores": statistics.mean(busy) if busy else None}


def earlier_report(path: Path, settings: dict) -> dict | None:
    """The report a run of the same settings left at `path`, to go on from; None where there is none. Another
    run's report is refused in one line (it is not overwritten)."""
    from gorgon.heads.errors import GorgonError

    if not path.is_file():
        return None
    report = json.loads(path.read_text())
    if report.get("settings") != settings:
        raise GorgonError(f"{path} holds a run of other settings: pass another --out, or the same options")
    return report


def peer(heads: str, questions: str = "scripts/data/mt_bench.jsonl", limit: int = 80, max_new_tokens: int = 64,
         target: str | None = None, gguf: str | None = None, chain: int | None = None, engines: Path | None = None,
         out: Path = Path("runs/peer")) -> dict:
    """The report of the module docstring, written to OUT/peer.json as it grows."""
    from contextlib import ExitStack

    from serving_parity import check_run_folder, llama_server, request
    from tqdm.auto import tqdm

    from gorgon.decode.calibrate import cpu_flags, cpu_reading
    from gorgon.decode.questions import load_questions
    from gorgon.heads.files import atomic_write_text

    check_run_folder(out)
    out.mkdir(parents=True, exist_ok=True)
    loaded, drafter, folder, servers = rows_to_time(heads, target, gguf, chain, engines, out)
    asked = load_questions(questions, limit)
    prompts = [loaded.chat_ids([{"role": "user", "content": q["turns"][0]}]) for q in asked]
    settings = {"heads": str(Path(heads).resolve()), "questions": str(Path(questions).resolve()),
                "max_new_tokens": max_new_tokens,  # and each llama.cpp row's GGUF and options (the chain's among them)
                "llama.cpp": {name: [str(model), *options] for name, (model, options) in servers.items()}}
    report_path = out / "peer.json"
    report = earlier_report(report_path, settings) or {"settings": settings, "questions": [], "cpu_flags": cpu_flags()}
    context = max(ids.shape[1] for ids in prompts) + max_new_tokens + 16
    with ExitStack() as running:
        urls = {name: running.enter_context(llama_server(folder, model, context, out / "llama.cpp" / f"{name}.log",
                                                         options))
                for name, (model, options) in servers.items()}
        report["llama.cpp"] = request(next(iter(urls.values())) + "/props").get("build_info", "unknown")

        def run(name: str, ids, n: int) -> dict:
            if name in urls:
                return timed_llama(urls[name], ids[0].tolist(), n)
            return timed_gorgon(loaded.model, drafter if name == "gorgon" else None, ids, n)

        names = ["generate", "gorgon", *urls]
        for name in names:  # kernels, caches and pages loaded outside the timings
            run(name, prompts[0], 8)
        done = len(report["questions"])
        for qi in tqdm(range(done, len(prompts)), initial=done, total=len(prompts), desc="llama.cpp peer",
                       unit="question"):
            order = names[qi % len(names):] + names[:qi % len(names)]
            start = cpu_reading()
            rows = {name: run(name, prompts[qi], max_new_tokens) for name in order}
            now = cpu_reading()  # one row works at a time, on one core: the rest is other work
            busy = None if start.busy is None else max(0.0, (now.busy - start.busy) / (now.wall - start.wall) - 1)
            report["questions"].append({"question_id": asked[qi]["question_id"], "busy_cores": busy,
                                        "rows": {name: rows[name] for name in names}})
            report["summary"] = summary(report["questions"])
            atomic_write_text(report_path, json.dumps(report, indent=1))
    return report


def table(report: dict) -> str:
    """The summary as a markdown table."""
    s = report["summary"]
    lines = ["| row | tokens/s | speedup over its plain row | over `generate` | tau | identical to its plain row |",
             "|---|---|---|---|---|---|"]
    n = len(report["questions"])
    for name, row in s["rows"].items():
        same = f"{row['identical']}/{n}" if "identical" in row else "-"
        tau = f"{row['tau']:.2f}" if "tau" in row else "-"
        speedup = f"{row['speedup']:.2f}x" if "speedup" in row else "-"
        lines.append(f"| {name} | {row['tokens_per_s']:.1f} | {speedup} | {row['speedup_over_generate']:.2f}x | "
                     f"{tau} | {same} |")
    busy = "unknown" if s["busy_cores"] is None else f"{s['busy_cores']:.2f}"
    lines.append(f"\n{n} questions, llama.cpp {report['llama.cpp']}; llama.cpp f32 alone == generate: "
                 f"{s['llama.cpp-f32 == generate']}/{n}; other work kept {busy} cores busy while timing")
    return "\n".join(lines)


def main() -> None:
    import argparse

    from gorgon.heads.command import ArgumentParser, int_at_least, user_path

    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--heads", type=user_path, required=True,
                   help="an EAGLE head's folder: gorgon drafts with it, llama.cpp with its eagle3 export")
    p.add_argument("--questions", default="scripts/data/mt_bench.jsonl", help="MT-Bench-style .jsonl")
    p.add_argument("--limit", type=int_at_least(1), default=80, help="the first N questions (default 80)")
    p.add_argument("--max-new-tokens", type=int_at_least(1), default=64, help="default 64")
    p.add_argument("--target", default=None, help="the target (default: the one the heads record)")
    p.add_argument("--gguf", type=user_path, default=None,
                   help="a quantized GGUF of the target for llama.cpp's rows too (default: the embedded target's "
                        "Q4_1 file when the target is the embedded one)")
    p.add_argument("--chain", type=int_at_least(1), default=None,
                   help="tokens llama.cpp's EAGLE-3 drafts a step (default: the head's depth, as the export says)")
    p.add_argument("--engines", type=user_path, default=None,
                   help="the folder scripts/engines.sh built the engines in (default: $GORGON_ENGINES, else "
                        "~/.cache/gorgon/engines)")
    p.add_argument("--out", type=user_path, default="runs/peer", help="where the export, GGUFs, logs and peer.json go")
    args = p.parse_args()
    report = peer(args.heads, args.questions, args.limit, args.max_new_tokens, args.target, args.gguf, args.chain,
                  args.engines and Path(args.engines), Path(args.out))
    print(table(report))
    print(f"written: {Path(args.out) / 'peer.json'}", file=sys.stderr)


if __name__ == "__main__":
    from gorgon.heads.command import run_script

    run_script(main, "scripts/llama_cpp_peer.py")
