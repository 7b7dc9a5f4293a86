"""Serving parity: a drafter's export served by an engine (vLLM or llama.cpp), beside gorgon's own decoder, on the
same prompts.

    bash scripts/engines.sh vllm      # once: vLLM's venv in ~/.cache/gorgon/engines/vllm
    python scripts/serving_parity.py --heads runs/heads/smollm2-135m-quick --format vllm \\
        --questions scripts/data/mt_bench.jsonl --limit 8 --max-new-tokens 64 --out runs/parity/medusa
    bash scripts/engines.sh llama.cpp # once: llama.cpp's server and converter in ~/.cache/gorgon/engines/llama.cpp
    python scripts/serving_parity.py --engine llama.cpp --heads runs/heads/eagle --format eagle3 --out runs/parity

Exports the heads (`gorgon export --format`; a folder already in an engine's layout is served as it is), then
generates greedily for the first turn of each question three ways: the engine alone, the engine with the draft
proposing a chain of --chain tokens a step (vLLM and llama.cpp verify chains only), and gorgon with the same export
(imported back: the same weights) drafting the same chain. Reports whether the three outputs are identical (the
target decides every token, so they must be, up to float rounding where two tokens tie), the mean acceptance length
(tokens a verify step emits, the bonus token included: vLLM's 1 + accepted / drafts from its spec-decode counters,
which count the last step's drafts past the length too, and the same kept in its output; llama.cpp's as kept in its
output, from the drafted tokens each request reports; gorgon's over its verify steps, as kept) and, from vLLM, the
acceptance at each chain position, and the seconds each took; writes OUT/parity-ENGINE-FORMAT.json. Checks of
several exports in one OUT share the run of the engine alone (OUT/ENGINE-alone.json).

vLLM runs in a subprocess with its venv's python (scripts/engine_vllm.py), on one thread and offline
(HF_HUB_OFFLINE=1: an export whose target must be downloaded fails here as it would on a server without a network).
A speculators export is served as `vllm serve <export>` serves it, the target being its verifier. llama.cpp serves
EAGLE-3 drafts (`--format eagle3`): its own converter turns the target (in float32, as gorgon runs it here) and the
export into GGUF files, and `llama-server` (one thread, one slot) answers each prompt's token ids in turn.
"""

import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
# export format -> vLLM's method (peagle: EAGLE-3 with parallel drafting, the whole chain from one forward)
ENGINE_FORMATS = {"vllm": "medusa", "eagle3": "eagle3", "speculators": "eagle3", "peagle": "eagle3"}
# Every engine process (vLLM, llama.cpp's converter and server): one OpenMP thread, offline; for vLLM on the CPU,
# as NOTES.md measured it, 1 GiB of KV cache and the engine in this process.
ENGINE_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
              "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
              "TOKENIZERS_PARALLELISM": "false"}


ENGINES = ("vllm", "llama.cpp")
LLAMA_CPP_FORMATS = ("eagle3",)  # what llama.cpp's converter reads (LlamaForCausalLMEagle3)
# What this script and scripts/llama_cpp_peer.py write into --out (the two may share one), atomic writes' temporary
# files included: the exports, llama.cpp's GGUFs, each engine's runs and logs, the reports.
RUN_ENTRIES = ("export-*", "llama.cpp", "llama.cpp-*", "vllm-*", "parity-*.json", "peer.json", ".*.tmp")


def check_run_folder(out: Path) -> None:
    """Before any work: --out is new or empty, or holds only what these scripts write there (a run goes on from an
    earlier one's files), so none writes among a user's own files."""
    from fnmatch import fnmatch

    from gorgon.heads.errors import GorgonError

    if out.exists() and not out.is_dir():
        raise GorgonError(f"--out {out} is a file: pass a folder")
    foreign = sorted(p.name for p in out.iterdir() if not any(fnmatch(p.name, e) for e in RUN_ENTRIES)) \
        if out.is_dir() else []
    if foreign:
        raise GorgonError(f"--out {out} holds {foreign[0]}, which these engine checks did not write: choose a new or "
                          "empty folder")


def default_engine(name: str = "vllm") -> Path:
    """Where scripts/engines.sh builds an engine: $GORGON_ENGINES/NAME, else ~/.cache/gorgon/engines/NAME."""
    return Path(os.environ.get("GORGON_ENGINES") or Path.home() / ".cache/gorgon/engines") / name


def engine_layout(folder: Path) -> str | None:
    """The vLLM format a folder already holds (an export, or a checkpoint in an engine's layout), else None."""
    from gorgon.heads.files import config_or_none
    from gorgon.heads.methods.eagle.formats import foreign_format as eagle_format
    from gorgon.heads.methods.medusa.formats import foreign_format as medusa_format
    from gorgon.heads.methods.parallel.formats import is_peagle

    config = config_or_none(folder)
    if not isinstance(config, dict):
        return None
    fmt = "peagle" if is_peagle(config) else eagle_format(config) or medusa_format(folder, config)
    return fmt if fmt in ENGINE_FORMATS else None


def exported(heads: Path, fmt: str | None, target: str | None, out: Path) -> tuple[Path, str]:
    """The export to serve and its format: `heads` itself when it is in an engine's layout, else written to
    OUT/export-FORMAT by `gorgon export`."""
    from gorgon.heads.errors import GorgonError
    from gorgon.heads.export import main as export

    held = engine_layout(heads)
    if held:
        if fmt not in (None, held):
            raise GorgonError(f"{heads} is a {held} export already: drop --format {fmt}, or pass the heads folder")
        return heads, held
    if fmt is None:
        raise GorgonError(f"{heads} is a heads folder: pass --format ({', '.join(ENGINE_FORMATS)}) to export it")
    export(["--heads", str(heads), "--format", fmt, "--out", str(out / f"export-{fmt}"), "--overwrite"]
           + (["--target", target] if target else []))
    return out / f"export-{fmt}", fmt


def chain_drafter(export: Path, fmt: str, target: str | None, chain: int | None):
    """gorgon's target and drafter for the export (imported back: the same weights), drafting one chain as vLLM
    does (`gorgon.decode.options.chain_drafter`: the top candidate of each of `chain` levels, every level drafted;
    default: one per Medusa head, an EAGLE head's saved depth, a parallel drafter's block), in float32 as vLLM runs
    it here (gorgon's default on a CPU with bfloat16 kernels is bfloat16, whose rounding changes some drafts;
    Medusa heads, `--format vllm`, are in the target's dtype always)."""
    from gorgon.decode.options import DecodeSettings, load_chain

    dtype = "auto" if fmt == "vllm" else "float32"
    loaded, drafter = load_chain(DecodeSettings(heads=str(export), target=target, draft_dtype=dtype), chain)
    return drafter.max_nodes - 1, loaded, drafter


def run_gorgon(target, drafter, prompts: list, max_new_tokens: int, chain: int) -> dict:
    """gorgon's outputs, its acceptance length over its verify steps (the prefill's token left out, as vLLM counts),
    the share of steps that accepted each chain position, its tau (tokens per target forward, the prefill's
    included) and the seconds its decoding took."""
    from gorgon.decode import speculative_generate

    outputs, steps, forwards, seconds = [], [], 0, 0.0
    for ids in prompts:
        result = speculative_generate(target.model, drafter, ids, max_new_tokens)
        outputs.append(result.tokens)
        steps += result.accepted[1:]  # tokens each verify step emitted, the bonus included
        forwards += result.target_forwards
        seconds += result.seconds
    return {"outputs": outputs, "acceptance_length": sum(steps) / max(1, len(steps)), "steps": len(steps),
            "per_position": [sum(n - 1 > i for n in steps) / max(1, len(steps)) for i in range(chain)],
            "tau": sum(map(len, outputs)) / max(1, forwards), "seconds": seconds}


def run_vllm(python: Path, model: str, speculative_config: dict | None, prompts: list, max_new_tokens: int,
             log: Path) -> dict:
    """One vLLM run in the engine's venv (scripts/engine_vllm.py), its output in `log`; a failure is one line."""
    from gorgon.heads.errors import GorgonError

    with tempfile.TemporaryDirectory() as tmp:
        job, result = Path(tmp) / "job.json", Path(tmp) / "result.json"
        longest = max(len(ids) for ids in prompts) + max_new_tokens
        job.write_text(json.dumps({"model": model, "speculative_config": speculative_config, "prompts": prompts,
                                   "max_tokens": max_new_tokens, "max_model_len": longest + 16}))
        with open(log, "w") as out:
            done = subprocess.run([str(python), str(HERE / "engine_vllm.py"), str(job), str(result)], stdout=out,
                                  stderr=subprocess.STDOUT, env={**os.environ, **ENGINE_ENV})
        if done.returncode != 0:
            lines = [line for line in log.read_text().splitlines() if line.strip()]
            raise GorgonError(f"vLLM failed ({lines[-1] if lines else 'no output'}): its log is {log}")
        report = json.loads(result.read_text())
    counts = report.pop("spec_decode")
    report["engine"] = f"vLLM {report.pop('vllm')}"
    if speculative_config is not None:
        # vLLM counts a step's accepted drafts before it cuts the output at max_tokens (gorgon after): the tokens
        # its verify steps left in the outputs (all but each prefill's one) measure what gorgon's figure does.
        drafts = max(1, counts.get("num_drafts", 0))
        kept = sum(len(ids) for ids in report["outputs"]) - len(prompts)
        report.update(acceptance_length=1 + counts.get("num_accepted_tokens", 0) / drafts, steps=drafts,
                      kept_acceptance_length=kept / drafts,
                      per_position=[n / drafts for n in counts.get("num_accepted_tokens_per_pos") or []])
    return report


def vllm_runs(folder: Path, where: str, export: Path, fmt: str, chain: int, prompts: list, max_new_tokens: int,
              out: Path) -> tuple[dict, dict]:
    """vLLM alone and with the draft, on the target gorgon loaded from `where`."""
    from gorgon.heads.errors import GorgonError

    python = folder / "bin" / "python"
    if not python.is_file():
        raise GorgonError(f"no vLLM venv at {folder}: build it with `bash scripts/engines.sh vllm`, or pass --engines")
    model, spec = where, {"method": ENGINE_FORMATS[fmt], "model": str(export), "num_speculative_tokens": chain}
    if fmt == "peagle":  # as `gorgon export` prints it: vLLM tells no peagle folder by itself
        spec["parallel_drafting"] = True
    if fmt == "speculators":  # served as `vllm serve <export>`: the target is the verifier it names
        model, spec = str(export), {"num_speculative_tokens": chain}
    job = {"model": where, "prompts": prompts, "max_tokens": max_new_tokens}
    alone = kept_run(out / "vllm-alone.json", job,
                     lambda: run_vllm(python, where, None, prompts, max_new_tokens, out / "vllm-alone.log"))
    return alone, run_vllm(python, model, spec, prompts, max_new_tokens, out / f"vllm-{fmt}.log")


def kept_run(saved: Path, job: dict, run) -> dict:
    """`run()`'s result, kept in `saved` with the `job` it did: the next check in the same OUT on the same target,
    prompts and length (another export's) reads it back instead of running it again."""
    if saved.is_file() and json.loads(saved.read_text())["job"] == job:
        return json.loads(saved.read_text())["result"]
    result = run()
    saved.write_text(json.dumps({"job": job, "result": result}))
    return result


def check_llama_cpp_format(fmt: str) -> None:
    from gorgon.heads.errors import GorgonError

    if fmt not in LLAMA_CPP_FORMATS:
        raise GorgonError(f"llama.cpp serves EAGLE-3 drafts: pass an EAGLE head with --format eagle3, not {fmt}")


def to_gguf(folder: Path, source: Path, gguf: Path, log: Path, *extra: str) -> Path:
    """llama.cpp's converter (in the venv scripts/engines.sh built beside it): a Hugging Face folder as a float32
    GGUF file; a failure is one line."""
    from gorgon.heads.errors import GorgonError

    command = [str(folder / "venv" / "bin" / "python"), str(folder / "bin" / "convert_hf_to_gguf.py"), str(source),
               "--outtype", "f32", "--outfile", str(gguf), *extra]
    with open(log, "w") as written:
        done = subprocess.run(command, stdout=written, stderr=subprocess.STDOUT, env={**os.environ, **ENGINE_ENV})
    if done.returncode != 0:
        lines = [line for line in log.read_text().splitlines() if line.strip()]
        raise GorgonError(f"llama.cpp's converter failed on {source} ({lines[-1] if lines else 'no output'}): "
                          f"its log is {log}")
    return gguf


def llama_cpp_runs(folder: Path, where: str, export: Path, fmt: str, chain: int, prompts: list, max_new_tokens: int,
                   out: Path) -> tuple[dict, dict]:
    """llama.cpp alone and with the EAGLE-3 draft: the target gorgon loaded from `where` (a local folder) and the
    export, each converted to a float32 GGUF (the target once per OUT)."""
    check_llama_cpp_format(fmt)
    target = target_gguf(folder, where, out / "llama.cpp")
    draft = to_gguf(folder, export, out / "llama.cpp" / f"draft-{fmt}.gguf", out / "llama.cpp" / f"convert-{fmt}.log",
                    "--target-model-dir", str(where))
    job = {"model": str(Path(where).resolve()), "prompts": prompts, "max_tokens": max_new_tokens}
    alone = kept_run(out / "llama.cpp-alone.json", job,
                     lambda: run_llama_server(folder, target, None, chain, prompts, max_new_tokens,
                                              out / "llama.cpp-alone.log"))
    return alone, run_llama_server(folder, target, draft, chain, prompts, max_new_tokens,
                                   out / f"llama.cpp-{fmt}.log")


def target_gguf(folder: Path, where: str, work: Path) -> Path:
    """The target gorgon loaded from `where` (a local folder) as llama.cpp's converter writes it in float32,
    WORK/target-f32.gguf, converted once per WORK and source folder."""
    from gorgon.heads.errors import GorgonError

    if not (folder / "bin" / "llama-server").is_file():
        raise GorgonError(f"no llama.cpp build at {folder}: build it with `bash scripts/engines.sh llama.cpp`, or "
                          "pass --engines")
    if not Path(where).is_dir():
        raise GorgonError(f"llama.cpp's converter reads the target from a folder, and it loaded from {where}: pass "
                          "--target FOLDER")
    work.mkdir(parents=True, exist_ok=True)
    target = work / "target-f32.gguf"
    source, record = {"source": str(Path(where).resolve())}, work / "target-f32.json"
    if not (target.is_file() and record.is_file() and json.loads(record.read_text()) == source):
        to_gguf(folder, Path(where), target, work / "convert-target.log")
        record.write_text(json.dumps(source))
    return target


def eagle3_options(draft: Path, chain: int) -> list[str]:
    """llama-server's options for an EAGLE-3 draft GGUF drafting `chain` tokens a step, the whole chain every step
    (no early stop on the draft's confidence)."""
    return ["-md", str(draft), "--spec-type", "draft-eagle3", "--spec-draft-n-max", str(chain),
            "--spec-draft-p-min", "0"]


@contextlib.contextmanager
def llama_server(folder: Path, model: Path, context: int, log: Path, options: list[str] = ()):
    """A running `llama-server` on `model` (one thread, one slot, `context` tokens, the extra `options`), its URL;
    stopped on leaving. A server that does not start is one line naming its log."""
    from gorgon.heads.errors import GorgonError

    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    command = [str(folder / "bin" / "llama-server"), "-m", str(model), "-t", "1", "-c", str(context), "-np", "1",
               "--no-webui", "--host", "127.0.0.1", "--port", str(port), *options]
    url, start = f"http://127.0.0.1:{port}", time.perf_counter()
    with open(log, "w") as written:
        server = subprocess.Popen(command, stdout=written, stderr=subprocess.STDOUT, env={**os.environ, **ENGINE_ENV},
                                  preexec_fn=dies_with_parent if sys.platform == "linux" else None)
        try:
            while not ready(url):
                if server.poll() is not None or time.perf_counter() - start > 300:
                    lines = [line for line in log.read_text().splitlines() if line.strip()]
                    raise GorgonError(f"llama-server did not start ({lines[-1] if lines else 'no output'}): its log "
                                      f"is {log}")
                time.sleep(0.5)
            yield url
        finally:
            server.terminate()
            server.wait()


def dies_with_parent() -> None:
    """In a server's process before it starts (Linux): it is sent SIGTERM when the process that started it dies,
    even by `kill -9`, so that no server outlives its script holding memory and a port."""
    import ctypes
    import signal

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1: PR_SET_PDEATHSIG


def complete(url: str, ids: list[int], max_new_tokens: int) -> dict:
    """llama-server's greedy answer to a prompt's token ids (its `tokens`, the end-of-sequence token kept as vLLM and
    gorgon keep it, and its `timings`), the prompt's cache not reused."""
    return request(url + "/completion", {"prompt": ids, "n_predict": max_new_tokens, "temperature": 0,
                                         "return_tokens": True, "cache_prompt": False})


def run_llama_server(folder: Path, model: Path, draft: Path | None, chain: int, prompts: list, max_new_tokens: int,
                     log: Path) -> dict:
    """One `llama-server`'s greedy answers to each prompt in turn, as run_vllm reports them. Acceptance is counted
    in the output: each verify step emits its accepted drafts and one token of the target's, after the prefill's."""
    longest = max(len(ids) for ids in prompts) + max_new_tokens
    start = time.perf_counter()
    with llama_server(folder, model, longest + 16, log, eagle3_options(draft, chain) if draft else []) as url:
        loaded = time.perf_counter()
        build = request(url + "/props").get("build_info", "unknown")
        answers = [complete(url, ids, max_new_tokens) for ids in prompts]
    outputs = [list(a["tokens"]) for a in answers]
    accepted = sum(a["timings"].get("draft_n_accepted", 0) for a in answers)
    kept = sum(map(len, outputs)) - len(prompts)
    steps = max(1, kept - accepted)
    return {"engine": f"llama.cpp {build}", "outputs": outputs, "load_seconds": loaded - start,
            "seconds": sum(a["timings"]["prompt_ms"] + a["timings"]["predicted_ms"] for a in answers) / 1000,
            "acceptance_length": kept / steps, "kept_acceptance_length": kept / steps, "steps": steps,
            "per_position": []}


def ready(url: str) -> bool:
    try:
        return request(url + "/health").get("status") == "ok"
    except OSError:
        return False


def request(url: str, body: dict | None = None) -> dict:
    data = None if body is None else json.dumps(body).encode()
    with urllib.request.urlopen(urllib.request.Request(url, data, {"Content-Type": "application/json"})) as answer:
        return json.load(answer)


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first place two outputs differ (the shorter's length where one extends the other), None if equal."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def identical(a: list[list[int]], b: list[list[int]]) -> int:
    """How many answers of two runs are the same tokens."""
    return sum(x == y for x, y in zip(a, b, strict=True))


def serving_parity(heads: str, fmt: str | None = None, questions: str = "scripts/data/mt_bench.jsonl",
                   engine: str = "vllm", engines: Path | None = None, target: str | None = None,
                   chain: int | None = None, limit: int = 8, max_new_tokens: int = 64,
                   out: Path = Path("runs/parity")) -> dict:
    """The parity report (module docstring) of `heads` served by `engine` (vllm or llama.cpp), built by
    scripts/engines.sh in the folder `engines` (default: $GORGON_ENGINES or ~/.cache/gorgon/engines); its files in
    `out`."""
    from gorgon.decode.questions import load_questions
    from gorgon.heads.errors import GorgonError
    from gorgon.heads.files import atomic_write_text

    if engine not in ENGINES:
        raise GorgonError(f"no engine {engine!r}: use {' or '.join(ENGINES)}")
    if engine == "llama.cpp" and fmt is not None:  # before anything loads; a folder's own format after its export
        check_llama_cpp_format(fmt)
    folder = (engines / engine) if engines else default_engine(engine)
    check_run_folder(out)
    out.mkdir(parents=True, exist_ok=True)
    export, fmt = exported(Path(heads), fmt, target, out)
    chain, loaded, drafter = chain_drafter(export, fmt, target, chain)
    prompts = [loaded.chat_ids([{"role": "user", "content": q["turns"][0]}])
               for q in load_questions(questions, limit)]
    started = time.perf_counter()
    ours = run_gorgon(loaded, drafter, prompts, max_new_tokens, chain)
    ours["wall_seconds"] = time.perf_counter() - started
    prompts = [ids[0].tolist() for ids in prompts]
    where = loaded.model.config._name_or_path  # the folder (or Hub id) gorgon loaded the target from
    runs = vllm_runs if engine == "vllm" else llama_cpp_runs
    alone, drafted = runs(folder, where, export, fmt, chain, prompts, max_new_tokens, out)
    report = {"export": str(export), "format": fmt, "chain": chain, "questions": len(prompts),
              "max_new_tokens": max_new_tokens, "engine": engine, "engine_version": drafted["engine"],
              "target": where,
              "identical": {"engine+draft == engine": identical(drafted["outputs"], alone["outputs"]),
                            "gorgon == engine": identical(ours["outputs"], alone["outputs"])},
              "first_differences": {
                  "engine+draft vs engine": [first_difference(a, b)
                                             for a, b in zip(drafted["outputs"], alone["outputs"])],
                  "gorgon vs engine": [first_difference(a, b) for a, b in zip(ours["outputs"], alone["outputs"])]},
              "acceptance_length": {"engine": drafted["acceptance_length"], "gorgon": ours["acceptance_length"],
                                    "engine_kept": drafted["kept_acceptance_length"]},
              "gorgon_tau": ours["tau"],
              "per_position": {"engine": drafted["per_position"], "gorgon": ours["per_position"]},
              "verify_steps": {"engine": drafted["steps"], "gorgon": ours["steps"]},
              "seconds": {"engine": alone["seconds"], "engine+draft": drafted["seconds"], "gorgon": ours["seconds"],
                          "engine_load": drafted["load_seconds"]},
              "tokens": sum(len(o) for o in alone["outputs"]),
              "outputs": {"engine": alone["outputs"], "engine+draft": drafted["outputs"], "gorgon": ours["outputs"]}}
    atomic_write_text(out / f"parity-{engine}-{fmt}.json", json.dumps(report, indent=1))
    return report


def table(report: dict) -> str:
    """The report's figures as a markdown table."""
    same, accept, secs, name = report["identical"], report["acceptance_length"], report["seconds"], report["engine"]
    gap = 100 * (accept["engine_kept"] - accept["gorgon"]) / accept["gorgon"]
    n = report["questions"]
    engine_positions = " ".join(f"{p:.2f}" for p in report["per_position"]["engine"]) or "-"
    gorgon_positions = " ".join(f"{p:.2f}" for p in report["per_position"]["gorgon"])
    return "\n".join([
        f"{report['format']} export, chain of {report['chain']}, {n} questions, up to "
        f"{report['max_new_tokens']} new tokens ({report['tokens']} generated), {report['engine_version']}:",
        f"| | identical to {name} alone | acceptance length | per position | seconds |",
        "|---|---|---|---|---|",
        f"| {name} alone | - | 1 | - | {secs['engine']:.1f} |",
        f"| {name} + draft | {same['engine+draft == engine']}/{n} | {accept['engine']:.3f} "
        f"({accept['engine_kept']:.3f} kept) | {engine_positions} | {secs['engine+draft']:.1f} |",
        f"| gorgon | {same['gorgon == engine']}/{n} | {accept['gorgon']:.3f} ({name}'s {gap:+.1f}%) | "
        f"{gorgon_positions} | {secs['gorgon']:.1f} |",
        f"(gorgon's tau, tokens per target forward with the prefill's: {report['gorgon_tau']:.3f})"])


def main() -> None:
    import argparse

    from gorgon.heads.command import ArgumentParser, int_at_least, user_path

    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--heads", type=user_path, required=True, help="a heads folder, or an export to serve as it is")
    p.add_argument("--format", choices=list(ENGINE_FORMATS), default=None,
                   help="the export's format, for a heads folder: vllm (Medusa), eagle3 or speculators (an EAGLE "
                        "head), peagle (a parallel drafter)")
    p.add_argument("--questions", default="scripts/data/mt_bench.jsonl", help="MT-Bench-style .jsonl")
    p.add_argument("--limit", type=int_at_least(1), default=8, help="the first N questions (default 8)")
    p.add_argument("--max-new-tokens", type=int_at_least(1), default=64, help="default 64")
    p.add_argument("--chain", type=int_at_least(1), default=None,
                   help="tokens drafted a step (default: one per Medusa head, an EAGLE head's depth, a parallel "
                        "drafter's block)")
    p.add_argument("--target", default=None, help="the target (default: the one the heads record)")
    p.add_argument("--engine", choices=ENGINES, default="vllm",
                   help="the engine that serves the export: vllm (default) or llama.cpp (EAGLE-3 drafts)")
    p.add_argument("--engines", type=user_path, default=None,
                   help=f"the folder scripts/engines.sh built the engines in (default: {default_engine('').parent})")
    p.add_argument("--out", type=user_path, default="runs/parity", help="where the export, logs and parity.json go")
    args = p.parse_args()
    report = serving_parity(args.heads, args.format, args.questions, args.engine, args.engines and Path(args.engines),
                            args.target, args.chain, args.limit, args.max_new_tokens, Path(args.out))
    print(table(report))
    written = Path(args.out) / f"parity-{args.engine}-{report['format']}.json"
    print(f"written: {written}", file=sys.stderr)


if __name__ == "__main__":
    from gorgon.heads.command import run_script

    run_script(main, "scripts/serving_parity.py")
