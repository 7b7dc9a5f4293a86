"""vLLM's side of scripts/serving_parity.py, run by the python of vLLM's venv (scripts/engines.sh builds it), so it
imports vllm and the standard library only.

    python scripts/engine_vllm.py JOB.json RESULT.json

JOB: {"model", "speculative_config" (null: no draft), "prompts": [[token ids]], "max_tokens", "max_model_len"}.
Generates greedily for each prompt in turn (in one batch, the other rows could change the float sums), and writes
RESULT: {"vllm": version, "outputs": [[token ids]], "load_seconds", "seconds" (generation alone),
"spec_decode": vLLM's counters (num_drafts, num_draft_tokens, num_accepted_tokens, num_accepted_tokens_per_pos)}.
"""

import json
import time


def main(job_path: str, result_path: str) -> None:
    with open(job_path) as f:
        job = json.load(f)
    start = time.perf_counter()
    import vllm

    # float32 and eager as gorgon runs on the CPU; log stats on, or get_metrics() has no spec-decode counters.
    llm = vllm.LLM(model=job["model"], speculative_config=job["speculative_config"], dtype="float32",
                   enforce_eager=True, max_model_len=job["max_model_len"], disable_log_stats=False, seed=0)
    loaded = time.perf_counter()
    params = vllm.SamplingParams(temperature=0.0, max_tokens=job["max_tokens"])
    outputs = [list(llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0].outputs[0].token_ids)
               for ids in job["prompts"]]
    seconds = time.perf_counter() - loaded
    counters = {m.name.removeprefix("vllm:spec_decode_"): getattr(m, "values", getattr(m, "value", None))
                for m in llm.get_metrics() if m.name.startswith("vllm:spec_decode_")}
    with open(result_path, "w") as f:
        json.dump({"vllm": vllm.__version__, "outputs": outputs, "load_seconds": loaded - start, "seconds": seconds,
                   "spec_decode": counters}, f)


if __name__ == "__main__":
    import argparse

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("job", help="the job's JSON file (what serving_parity.py writes)")
    p.add_argument("result", help="where the result's JSON goes")
    args = p.parse_args()
    main(args.job, args.result)
