"""
What the suffix memory gains across calls (`python -m utils.bench memory`): four workloads that repeat
themselves, each prompt run by every method in turn (interleaved, order rotated per prompt), the memory empty at
the start of each repeat:

- `humaneval_sequence`: HumanEval tuning prompts answered one after another;
- `mt_bench_two_turn`: MT-Bench tuning conversations, both turns (the second turn's prompt holds the first answer);
- `edit`: rewrites of HumanEval canonical solutions (type hints and a docstring, a renamed variable, comments),
  whose answers copy much of their input;
- `sampled_repeat`: the HumanEval prompts asked again, sampled at temperature 0.7.

Methods: greedy (plain sampling for the sampled workload), prompt lookup (10 tokens), `"auto"` without memory and
`"auto"` with memory.
"""

from __future__ import annotations

import re
import statistics
import tracemalloc
import zlib
from collections import defaultdict

import torch

from transformers_lookahead import LookaheadState
from transformers_lookahead.suffix_memory import SuffixMemory, vocabulary_key
from utils.assets import chat_input_ids, humaneval_problems, mtbench_questions, tuning_prompts
from utils.methods import METHODS, methods
from utils.timing import Run

MEMORY_METHODS = {
    **methods("greedy", "prompt_lookup"),
    "auto_no_memory": methods("lookahead_auto", without_memory=True)["lookahead_auto"],
    "auto_memory": {**METHODS["lookahead_auto"], "lookahead_memory": True},
}
WORKLOADS = ("humaneval_sequence", "mt_bench_two_turn", "edit", "sampled_repeat")
SAMPLED_TEMPERATURE = 0.7
EDITS = (
    "Add type hints and a docstring to this function.",
    "Rename the variable `{old}` to `{new}` in this function.",
    "Add a short comment above each line of this function.",
)


def chat_ids(tokenizer, messages: list[dict], device) -> torch.LongTensor:
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)[
        "input_ids"
    ].to(device)


def _without_docstring(code: str) -> str:
    return re.sub(r'\n\s*(""".*?"""|\'\'\'.*?\'\'\')', "", code, count=1, flags=re.DOTALL)


def edit_prompts(count: int, cache_dir=None) -> list[tuple[str, str]]:
    """`(prompt_id, text)` of `count` rewrites of HumanEval tuning solutions (HumanEval/0-81), cycling over `EDITS`."""
    prompts = []
    problems = [p for p in humaneval_problems(cache_dir) if int(p["task_id"].split("/")[1]) <= 81]
    for index, problem in enumerate(problems[:count]):
        code = problem["prompt"] + problem["canonical_solution"]
        kind = index % len(EDITS)
        instruction = EDITS[kind]
        if kind == 0:
            code = _without_docstring(code)
        elif kind == 1:
            signature = re.search(rf"def {problem['entry_point']}\((\w+)", code)
            old = signature.group(1) if signature else problem["entry_point"]
            instruction = instruction.format(old=old, new=f"{old}_renamed")
        prompts.append((f"edit/{problem['task_id']}/{kind}", f"{instruction}\n\n```python\n{code.strip()}\n```"))
    return prompts


def run_memory_benchmark(args, model, tokenizer, device, timer) -> dict:
    """Runs the workloads `args.repeats` times; returns the runs, the memory sizes and the cost table used."""
    from tqdm.auto import tqdm

    humaneval = tuning_prompts("humaneval", args.cache_dir)[: args.num_prompts]
    conversations = [q for q in mtbench_questions(args.cache_dir) if q["question_id"] % 10 in (1, 2, 3, 4, 5)]
    conversations = conversations[: max(args.num_prompts // 2, 1)]
    edits = edit_prompts(args.num_prompts, args.cache_dir)
    # A table measured in this run: the run does not depend on one measured earlier on a busier machine.
    model.lookahead_state = LookaheadState(cost_dir=None, memory_dir=None)
    warm = chat_ids(tokenizer, [{"role": "user", "content": "Say hello."}], device)
    for kwargs in MEMORY_METHODS.values():
        model.generate(warm, max_new_tokens=16, do_sample=False, **kwargs, **own_memory(kwargs, "warm-up"))
    generations = len(MEMORY_METHODS) * (2 * len(humaneval) + 2 * len(conversations) + len(edits)) * args.repeats
    progress = tqdm(total=generations, desc="memory workloads", unit="gen")
    runner = _Runner(timer, progress, args.max_new_tokens)
    memory_sizes, documents = [], []
    for repeat in range(args.repeats):
        runner.repeat, runner.namespace = repeat, f"repeat-{repeat}"
        run = runner.run
        for prompt_id, _, text in humaneval:
            run(
                "humaneval_sequence", prompt_id, chat_input_ids(tokenizer, text, "humaneval").to(device), sampled=False
            )
        for question in conversations:
            messages = [{"role": "user", "content": question["turns"][0]}]
            ids = chat_ids(tokenizer, messages, device)
            answer = run("mt_bench_two_turn", f"mt_bench/{question['question_id']}/1", ids, sampled=False)
            text = tokenizer.decode(answer[0, ids.shape[1] :], skip_special_tokens=True)
            messages += [{"role": "assistant", "content": text}, {"role": "user", "content": question["turns"][1]}]
            second = chat_ids(tokenizer, messages, device)
            run("mt_bench_two_turn", f"mt_bench/{question['question_id']}/2", second, sampled=False)
        for prompt_id, text in edits:
            run("edit", prompt_id, chat_ids(tokenizer, [{"role": "user", "content": text}], device), sampled=False)
        for prompt_id, _, text in humaneval:
            run("sampled_repeat", prompt_id, chat_input_ids(tokenizer, text, "humaneval").to(device), sampled=True)
        memory = model.lookahead_state.memory(model, runner.namespace)
        memory_sizes.append({"repeat": repeat, "tokens": len(memory), "documents": memory.num_documents})
        documents = memory.documents()
    progress.close()
    costs = model.lookahead_state.cost_model(model)
    return {
        "runs": [run.record() for run in runner.runs],
        "memory": memory_sizes,
        "memory_bytes": _measured_bytes(model, documents),
        "step_costs": dict(zip(costs.lengths, costs.costs)),
    }


class _Runner:
    """Runs one prompt with every method in turn (the order rotated per prompt) and records the runs."""

    def __init__(self, timer, progress, max_new_tokens: int):
        # The timer runs the model (`ForwardTimer.generate`).
        self.timer, self.progress, self.max_new_tokens = timer, progress, max_new_tokens
        self.runs: list[Run] = []
        self.repeat, self.namespace = 0, ""

    def run(self, workload: str, prompt_id: str, ids: torch.LongTensor, sampled: bool) -> torch.LongTensor:
        """Returns greedy's output (plain sampling's for a sampled workload)."""
        outputs = {}
        names = list(MEMORY_METHODS)
        shift = len(self.runs) // len(names) % len(names)
        for name in names[shift:] + names[:shift]:
            kwargs = MEMORY_METHODS[name]
            common = {"max_new_tokens": self.max_new_tokens, "do_sample": sampled}
            if sampled:
                common["temperature"] = SAMPLED_TEMPERATURE
                torch.manual_seed(zlib.crc32(prompt_id.encode()) + self.repeat)
            outputs[name], seconds = self.timer.generate(ids, **common, **kwargs, **own_memory(kwargs, self.namespace))
            new_tokens = outputs[name].shape[1] - ids.shape[1]
            self.runs.append(
                Run(
                    workload=workload,
                    prompt_id=prompt_id,
                    method=name,
                    repeat=self.repeat,
                    new_tokens=new_tokens,
                    seconds=seconds,
                    forward_seconds=self.timer.seconds,
                    forward_passes=self.timer.calls,
                )
            )
            self.progress.update()
        if not sampled:
            for record in self.runs[-len(names) :]:
                record.identical_to_greedy = bool(torch.equal(outputs[record.method], outputs["greedy"]))
        return outputs["greedy"]


def own_memory(kwargs: dict, namespace: str) -> dict:
    """
    The extra `generate` arguments that give a method (its arguments `kwargs`) the suffix memory `namespace`, if it
    keeps one (`"auto"` with its memory on): a benchmark that runs a prompt again must not have it answered from the
    memory of the run before.
    """
    keeps_memory = kwargs.get("lookahead_window") == "auto" and kwargs.get("lookahead_memory", False)
    return {"lookahead_memory_namespace": namespace} if keeps_memory else {}


def _measured_bytes(model, documents: list[tuple[int, ...]]) -> int:
    """The host memory a memory holding `documents` takes, measured by rebuilding it under `tracemalloc`."""
    tracemalloc.start()
    memory = SuffixMemory(vocabulary_key(model), 10**9)
    memory.add(documents)
    size = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    del memory
    return size


def summarize_memory(result: dict) -> list[dict]:
    """
    Per workload and method: tokens/s, the ratio to greedy (to plain sampling for the sampled workload: tokens/s over
    tokens/s, since sampled lengths differ; else the sum of greedy's median seconds over the method's), the ratio
    to prompt lookup, tokens per forward, host share of the time, and greedy-identical outputs.
    """
    runs = result["runs"]
    by = defaultdict(list)
    for run in runs:
        by[(run["workload"], run["method"])].append(run)
    rows = []
    for workload in WORKLOADS:
        rates = {}
        for method in MEMORY_METHODS:
            selected = by.get((workload, method), [])
            if selected:
                rates[method] = _rate(selected, by[(workload, "greedy")], workload)
        for method, (tokens_per_s, speedup) in rates.items():
            selected = by[(workload, method)]
            tokens = sum(r["new_tokens"] for r in selected)
            seconds = sum(r["seconds"] for r in selected)
            identical = [r["identical_to_greedy"] for r in selected if r["identical_to_greedy"] is not None]
            rows.append(
                {
                    "workload": workload,
                    "method": method,
                    "generations": len(selected),
                    "tokens_per_s": tokens_per_s,
                    "speedup": speedup,
                    "vs_prompt_lookup": speedup / rates["prompt_lookup"][1] if "prompt_lookup" in rates else None,
                    "tokens_per_forward": tokens / sum(r["forward_passes"] for r in selected),
                    "host_share": 1 - sum(r["forward_seconds"] for r in selected) / seconds,
                    "identical": f"{sum(identical)}/{len(identical)}" if identical else "sampled",
                }
            )
    return rows


def _rate(selected: list[dict], greedy: list[dict], workload: str) -> tuple[float, float]:
    tokens_per_s = sum(r["new_tokens"] for r in selected) / sum(r["seconds"] for r in selected)
    if workload == "sampled_repeat":
        return tokens_per_s, tokens_per_s / (sum(r["new_tokens"] for r in greedy) / sum(r["seconds"] for r in greedy))
    return tokens_per_s, _sum_of_medians(greedy) / _sum_of_medians(selected)


def _sum_of_medians(records: list[dict]) -> float:
    """Each prompt's median time over the repeats, summed over prompts."""
    prompt_ids = {r["prompt_id"] for r in records}
    return sum(statistics.median(r["seconds"] for r in records if r["prompt_id"] == p) for p in prompt_ids)
