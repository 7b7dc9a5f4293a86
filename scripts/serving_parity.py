"""Serving parity: a drafter's export served by vLLM, beside gorgon's own decoder, on the same prompts.

    bash scripts/engines.sh vllm      # once: vLLM's venv in ~/.cache/gorgon/engines/vllm
    python scripts/serving_parity.py --heads runs/heads/smollm2-135m-quick --format vllm \\
        --questions scripts/data/mt_bench.jsonl --limit 8 --max-new-tokens 64 --out runs/parity/medusa

Exports the heads (`gorgon export --format`; a folder already in an engine's layout is served as it is), then
generates greedily for the first turn of each question three ways: vLLM alone, vLLM with the draft proposing a
chain of --chain tokens a step (vLLM verifies chains only), and gorgon with the same export (imported back: the same
weights) drafting the same chain. Reports whether the three outputs are identical (the target decides every token,
so they must be, up to float rounding where two tokens tie), the mean acceptance length (tokens a verify step emits,
the bonus token included: vLLM's 1 + accepted / drafts from its spec-decode counters, which count the last step's
drafts past the length too, and the same kept in its output; gorgon's over its verify steps, as kept) and the
acceptance at each chain position, and the seconds each took; writes OUT/parity-FORMAT.json. Checks
of several exports in one OUT share the run of vLLM alone (OUT/vllm-alone.json).

vLLM runs in a subprocess with its venv's python (scripts/engine_vllm.py), on one thread and offline
(HF_HUB_OFFLINE=1: an export whose target must be downloaded fails here as it would on a server without a network).
A speculators export is served as `vllm serve <export>` serves it, the target being its verifier.
"""

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
# export format -> vLLM's method (peagle: EAGLE-3 with parallel drafting, the whole chain from one forward)
ENGINE_FORMATS = {"vllm": "medusa", "eagle3": "eagle3", "speculators": "eagle3", "peagle": "eagle3"}
# vLLM on the CPU, as NOTES.md measured it: one OpenMP thread, 1 GiB of KV cache, the engine in this process.
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
            "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def default_engine() -> Path:
    """Where scripts/engines.sh builds vLLM's venv: $GORGON_ENGINES/vllm, else ~/.cache/gorgon/engines/vllm."""
    return Path(os.environ.get("GORGON_ENGINES") or Path.home() / ".cache/gorgon/engines") / "vllm"


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


def chain_drafter(export: Path, target: str | None, chain: int | None):
    """gorgon's target and drafter for the export (imported back: the same weights), drafting one chain as vLLM
    does (`gorgon.decode.options.chain_drafter`: the top candidate of each of `chain` levels, every level drafted;
    default: one per Medusa head, an EAGLE head's saved depth, a parallel drafter's block), in float32 as vLLM runs
    it here (gorgon's default on a CPU with bfloat16 kernels is bfloat16, whose rounding changes some drafts)."""
    from gorgon.decode.options import DecodeSettings, load_chain

    loaded, drafter = load_chain(DecodeSettings(heads=str(export), target=target, draft_dtype="float32"), chain)
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
                                  stderr=subprocess.STDOUT, env={**os.environ, **VLLM_ENV})
        if done.returncode != 0:
            lines = [line for line in log.read_text().splitlines() if line.strip()]
            raise GorgonError(f"vLLM failed ({lines[-1] if lines else 'no output'}): its log is {log}")
        report = json.loads(result.read_text())
    counts = report.pop("spec_decode")
    if speculative_config is not None:
        # vLLM counts a step's accepted drafts before it cuts the output at max_tokens (gorgon after): the tokens
        # its verify steps left in the outputs (all but each prefill's one) measure what gorgon's figure does.
        drafts = max(1, counts.get("num_drafts", 0))
        kept = sum(len(ids) for ids in report["outputs"]) - len(prompts)
        report.update(acceptance_length=1 + counts.get("num_accepted_tokens", 0) / drafts, steps=drafts,
                      kept_acceptance_length=kept / drafts,
                      per_position=[n / drafts for n in counts.get("num_accepted_tokens_per_pos") or []])
    return report


def vllm_alone(python: Path, model: str, prompts: list, max_new_tokens: int, out: Path) -> dict:
    """vLLM's run without a draft, kept in OUT/vllm-alone.json: the next check in the same OUT on the same target,
    prompts and length (another export's) reads it back instead of running it again."""
    saved, job = out / "vllm-alone.json", {"model": model, "prompts": prompts, "max_tokens": max_new_tokens}
    if saved.is_file() and json.loads(saved.read_text())["job"] == job:
        return json.loads(saved.read_text())["result"]
    result = run_vllm(python, model, None, prompts, max_new_tokens, out / "vllm-alone.log")
    saved.write_text(json.dumps({"job": job, "result": result}))
    return result


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first place two outputs differ (the shorter's length where one extends the other), None if equal."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def serving_parity(heads: str, fmt: str | None = None, questions: str = "scripts/data/mt_bench.jsonl",
                   engine: Path | None = None, target: str | None = None, chain: int | None = None, limit: int = 8,
                   max_new_tokens: int = 64, out: Path = Path("runs/parity")) -> dict:
    """The parity report (module docstring) of `heads` served by the vLLM in the venv `engine`; its files in `out`."""
    from gorgon.decode.questions import load_questions
    from gorgon.heads.errors import GorgonError

    python = (engine or default_engine()) / "bin" / "python"
    if not python.is_file():
        raise GorgonError(f"no vLLM venv at {python.parent.parent}: build it with `bash scripts/engines.sh vllm`, or "
                          "pass --engine (the venv's folder)")
    out.mkdir(parents=True, exist_ok=True)
    export, fmt = exported(Path(heads), fmt, target, out)
    chain, loaded, drafter = chain_drafter(export, target, chain)
    prompts = [loaded.chat_ids([{"role": "user", "content": q["turns"][0]}])
               for q in load_questions(questions, limit)]
    started = time.perf_counter()
    ours = run_gorgon(loaded, drafter, prompts, max_new_tokens, chain)
    ours["wall_seconds"] = time.perf_counter() - started
    prompts = [ids[0].tolist() for ids in prompts]
    where = loaded.model.config._name_or_path  # the folder (or Hub id) gorgon loaded the target from
    model, spec = where, {"method": ENGINE_FORMATS[fmt], "model": str(export), "num_speculative_tokens": chain}
    if fmt == "peagle":  # as `gorgon export` prints it: vLLM tells no peagle folder by itself
        spec["parallel_drafting"] = True
    if fmt == "speculators":  # served as `vllm serve <export>`: the target is the verifier it names
        model, spec = str(export), {"num_speculative_tokens": chain}
    alone = vllm_alone(python, where, prompts, max_new_tokens, out)
    drafted = run_vllm(python, model, spec, prompts, max_new_tokens, out / f"vllm-{fmt}.log")
    report = {"export": str(export), "format": fmt, "chain": chain, "questions": len(prompts),
              "max_new_tokens": max_new_tokens, "vllm": drafted["vllm"], "target": where,
              "identical": {"vllm+draft == vllm": drafted["outputs"] == alone["outputs"],
                            "gorgon == vllm": ours["outputs"] == alone["outputs"]},
              "first_differences": {
                  "vllm+draft vs vllm": [first_difference(a, b) for a, b in zip(drafted["outputs"], alone["outputs"])],
                  "gorgon vs vllm": [first_difference(a, b) for a, b in zip(ours["outputs"], alone["outputs"])]},
              "acceptance_length": {"vllm": drafted["acceptance_length"], "gorgon": ours["acceptance_length"],
                                    "vllm_kept": drafted["kept_acceptance_length"]},
              "gorgon_tau": ours["tau"],
              "per_position": {"vllm": drafted["per_position"], "gorgon": ours["per_position"]},
              "verify_steps": {"vllm": drafted["steps"], "gorgon": ours["steps"]},
              "seconds": {"vllm": alone["seconds"], "vllm+draft": drafted["seconds"], "gorgon": ours["seconds"],
                          "vllm_load": drafted["load_seconds"]},
              "tokens": sum(len(o) for o in alone["outputs"]),
              "outputs": {"vllm": alone["outputs"], "vllm+draft": drafted["outputs"], "gorgon": ours["outputs"]}}
    (out / f"parity-{fmt}.json").write_text(json.dumps(report, indent=1))
    return report


def table(report: dict) -> str:
    """The report's figures as a markdown table."""
    same, accept, secs = report["identical"], report["acceptance_length"], report["seconds"]
    gap = 100 * (accept["vllm_kept"] - accept["gorgon"]) / accept["gorgon"]
    return "\n".join([
        f"{report['format']} export, chain of {report['chain']}, {report['questions']} questions, up to "
        f"{report['max_new_tokens']} new tokens ({report['tokens']} generated), vLLM {report['vllm']}:",
        "| | identical to vLLM alone | acceptance length | per position | seconds |",
        "|---|---|---|---|---|",
        f"| vLLM alone | - | 1 | - | {secs['vllm']:.1f} |",
        f"| vLLM + draft | {same['vllm+draft == vllm']} | {accept['vllm']:.3f} ({accept['vllm_kept']:.3f} kept) | "
        f"{' '.join(f'{p:.2f}' for p in report['per_position']['vllm'])} | {secs['vllm+draft']:.1f} |",
        f"| gorgon | {same['gorgon == vllm']} | {accept['gorgon']:.3f} (vLLM's {gap:+.1f}%) | "
        f"{' '.join(f'{p:.2f}' for p in report['per_position']['gorgon'])} | {secs['gorgon']:.1f} |",
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
    p.add_argument("--engine", type=user_path, default=None,
                   help=f"vLLM's venv (default: {default_engine()}, which scripts/engines.sh builds)")
    p.add_argument("--out", type=user_path, default="runs/parity", help="where the export, logs and parity.json go")
    args = p.parse_args()
    report = serving_parity(args.heads, args.format, args.questions, args.engine and Path(args.engine), args.target,
                            args.chain, args.limit, args.max_new_tokens, Path(args.out))
    print(table(report))
    print(f"written: {Path(args.out) / ('parity-' + report['format'] + '.json')}", file=sys.stderr)


if __name__ == "__main__":
    from gorgon.heads.command import run_script

    run_script(main, "scripts/serving_parity.py")
