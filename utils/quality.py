"""
`python -m utils.bench quality`: HumanEval pass@1 of each decoding method, as users judge a code model. Every method
completes each tuning problem (the chat prompt the other benchmarks use), and each completion runs against the
problem's own tests in a subprocess of its own, in a temporary directory, with a timeout.

    python -m utils.bench quality --model qwen-coder --dtype bfloat16 --num-prompts 16 --max-new-tokens 384

A run too long for one sitting splits by `--first-problem`; `python -m utils.quality merge OUT.json RUN.json...`
writes the runs' problems as one result and prints its table.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
from pathlib import Path

from utils.assets import chat_input_ids, humaneval_problems
from utils.methods import methods
from utils.render_results import result_table
from utils.tiny_models import left_padded

# What is compared; "batched_greedy" decodes the problem in a left-padded batch of two (with the next problem).
QUALITY_METHODS = {
    **methods("greedy"),
    "batched_greedy": None,
    **methods("prompt_lookup", "lookahead_auto", without_memory=True),
}
TUNING_PROBLEMS = 82
_FENCED = re.compile(r"```[ \t]*(?:python|py|Python)?[ \t]*\n(.*?)(?:```|\Z)", re.DOTALL)


def completion_program(problem: dict, completion: str) -> str:
    """
    The program that tests a completion: the problem's prompt (its imports and stub), the completion's code, the
    problem's tests and the call of its `check`. The code is the first fenced block that defines the entry point (or
    the first block, or the whole answer where there is none); a block that only continues the function body is
    appended to the prompt, one that defines the function replaces the stub.
    """
    blocks = _FENCED.findall(completion)
    entry = problem["entry_point"]
    code = next((block for block in blocks if f"def {entry}" in block), blocks[0] if blocks else completion)
    return f"{problem['prompt']}\n{code}\n\n{problem['test']}\n\ncheck({entry})\n"


def program_passes(program: str, timeout: float = 10.0) -> bool:
    """Whether `program` exits cleanly within `timeout` seconds, run by an isolated interpreter in a fresh directory."""
    with tempfile.TemporaryDirectory(prefix="humaneval-") as directory:
        path = Path(directory, "program.py")
        path.write_text(program)
        try:
            result = subprocess.run(
                [sys.executable, "-I", str(path)], cwd=directory, capture_output=True, timeout=timeout, check=False
            )
        except subprocess.TimeoutExpired:
            return False
    return result.returncode == 0


def run_quality(args, model, tokenizer) -> dict:
    """
    For `args.num_prompts` HumanEval tuning problems from `args.first_problem` on (at most up to the 82nd): every
    method of `QUALITY_METHODS` generates up to `args.max_new_tokens` tokens greedily, and each completion is tested.
    """
    from tqdm.auto import tqdm

    first = args.first_problem
    problems = humaneval_problems(args.cache_dir)[first : min(first + args.num_prompts, TUNING_PROBLEMS)]
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    device = model.device
    inputs = [chat_input_ids(tokenizer, problem["prompt"], "humaneval").to(device) for problem in problems]
    common = {"max_new_tokens": args.max_new_tokens, "do_sample": False, "pad_token_id": pad_id}
    results = []
    for index, (problem, ids) in enumerate(zip(tqdm(problems, desc="quality", unit="problem"), inputs)):
        entry = {"task_id": problem["task_id"], "passed": {}, "same_text_as_greedy": {}}
        texts = {}
        for method, kwargs in QUALITY_METHODS.items():
            if kwargs is None:
                batch = left_padded([ids, inputs[(index + 1) % len(inputs)]], pad_id)
                generated = model.generate(**batch, **common)[0, batch["input_ids"].shape[1] :]
            else:
                generated = model.generate(ids, **common, **kwargs)[0, ids.shape[1] :]
            texts[method] = tokenizer.decode(generated, skip_special_tokens=True)
            entry["passed"][method] = program_passes(completion_program(problem, texts[method]))
            entry["same_text_as_greedy"][method] = texts[method] == texts["greedy"]
        entry["completions"] = texts
        results.append(entry)
    return {"problems": results, "dtype": args.dtype, "max_new_tokens": args.max_new_tokens}


def merge_quality(results: list[dict], files: list[str] | None = None) -> dict:
    """
    One result of several `--quality` runs over different problems (`--first-problem`), of one dtype and length: a
    long run can be split where time forbids running it at once. Batched greedy pairs each problem with the next one
    of its own run, so the last problem of each run has another partner than in one long run. Each run's problems,
    environment (machine, command) and file (from `files`) are kept under `runs`, a merged result's own runs in its
    place: the parts may have run on different machines.
    """
    settings = {(result["dtype"], result["max_new_tokens"]) for result in results}
    if len(settings) != 1:
        raise ValueError(f"Only runs of one dtype and --max-new-tokens merge; these have {sorted(settings)}.")
    problems = [entry for result in results for entry in result["problems"]]
    task_ids = [entry["task_id"] for entry in problems]
    if len(set(task_ids)) != len(task_ids):
        raise ValueError("The runs overlap: each problem must come from one run only.")
    dtype, max_new_tokens = settings.pop()
    runs = []
    for index, result in enumerate(results):
        own = {
            "task_ids": [entry["task_id"] for entry in result["problems"]],
            "environment": result.get("environment"),
        }
        if files is not None:
            own["file"] = files[index]
        runs.extend(result.get("runs") or [own])
    return {"problems": problems, "dtype": dtype, "max_new_tokens": max_new_tokens, "runs": runs}


def summarize_quality(result: dict) -> list[dict]:
    """Per method: problems passed, pass@1, and how many completions have greedy's exact text."""
    problems = result["problems"]
    return [
        {
            "method": method,
            "problems": len(problems),
            "passed": sum(entry["passed"][method] for entry in problems),
            "pass_at_1": sum(entry["passed"][method] for entry in problems) / len(problems),
            "same_text_as_greedy": sum(entry["same_text_as_greedy"][method] for entry in problems),
        }
        for method in QUALITY_METHODS
    ]


def main(argv: list[str] | None = None) -> None:
    import argparse
    import json

    parser = argparse.ArgumentParser(description="Merges `quality` runs over different problems into one result.")
    parser.add_argument("output", type=Path, help="the merged result (.json)")
    parser.add_argument("runs", type=Path, nargs="+", help="the runs' .json files, in problem order")
    args = parser.parse_args(argv)
    result = merge_quality([json.loads(path.read_text()) for path in args.runs], [path.name for path in args.runs])
    result["summary"] = summarize_quality(result)
    args.output.write_text(json.dumps(result, indent=1))
    print("\n".join(result_table(args.output.name, result)))


if __name__ == "__main__":
    main()
