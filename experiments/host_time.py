"""
Host time per decoding step as the text grows: the time from a step's forward pass's end to the next pass's start
(verifying, committing and learning from the step, planning and laying out the next), for steps early in the text
and steps near its end, per method, on the real model. End-of-sequence is ignored so that every text reaches its
length.

    python -m experiments.host_time                                   # SmolLM2, 2 + 2 tuning prompts, 1024 new tokens
    python -m experiments.host_time --model qwen-coder --num-prompts 1

Steps are grouped by the tokens generated before them: the first `--window` tokens and the last `--window` tokens.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from transformers_lookahead import LookaheadState, enable_lookahead  # noqa: E402
from utils.methods import methods  # noqa: E402
from utils.timing import ForwardTimer, native_half_precision, provenance  # noqa: E402

METHODS = methods("greedy", "lookahead_auto", "lookahead_7_5_7", without_memory=True)


def step_host_times(
    timer: ForwardTimer, prompt: torch.LongTensor, new_tokens: int, **kwargs
) -> list[tuple[int, float, float, int, int]]:
    """
    One call's decoding steps but the last, as `(tokens generated before the step, host ms after its pass, its
    pass's ms, tokens it kept, tokens its pass fed)`. A step's host time runs from its pass's end to the next pass's
    start: verifying and committing what it kept, learning from it, and planning and laying out the next step.

    Args:
        timer (`ForwardTimer`): the timer hooked to the model.
    """
    out, _ = timer.generate(prompt, max_new_tokens=new_tokens, do_sample=False, return_dict_in_generate=True, **kwargs)
    spans = timer.spans
    accepted = list(getattr(out, "accepted_per_step", None) or [1] * (len(spans) - 1))
    generated = 1  # the prefill's token
    steps = []
    # Pass 0 is the prefill; the last step has no next pass to time its host work against.
    for index, kept in enumerate(accepted[:-1], start=1):
        (started, ended), (following, _) = spans[index], spans[index + 1]
        fed = timer.passes[index][0]
        steps.append((generated, 1000 * (following - ended), 1000 * (ended - started), kept, fed))
        generated += kept
    return steps


def summarize_host_time(runs: list[dict], new_tokens: int, window: int) -> list[dict]:
    """
    Per method: median host and pass ms of the steps in the first and the last `window` tokens, the ratio, and the
    tokens those steps kept on average (a step that keeps more also verifies, appends and commits more).
    """
    rows = []
    for method in METHODS:
        steps = [step for run in runs if run["method"] == method for step in run["steps"]]
        early = [step for step in steps if step[0] < window]
        late = [step for step in steps if step[0] >= new_tokens - window]
        if not early or not late:
            continue
        row = {"method": method, "window": window, "early_steps": len(early), "late_steps": len(late)}
        for name, group in (("early", early), ("late", late)):
            row[f"{name}_host_ms"] = statistics.median(step[1] for step in group)
            row[f"{name}_pass_ms"] = statistics.median(step[2] for step in group)
            row[f"{name}_kept"] = statistics.mean(step[3] for step in group)
        row["host_ratio"] = row["late_host_ms"] / row["early_host_ms"]
        # The same comparison between steps that kept as many tokens, which do the same work whatever the length:
        # the count most late steps kept among those at least 3 early steps kept too.
        counts = Counter(step[3] for step in late)
        shared = [kept for kept, _ in counts.most_common() if sum(step[3] == kept for step in early) >= 3]
        if shared:
            kept = shared[0]
            row["matched_kept"] = kept
            row["matched_early_host_ms"] = statistics.median(step[1] for step in early if step[3] == kept)
            row["matched_late_host_ms"] = statistics.median(step[1] for step in late if step[3] == kept)
            row["matched_ratio"] = row["matched_late_host_ms"] / row["matched_early_host_ms"]
        # And between steps of one shape (as many tokens fed and kept), whose host work differs only by what the
        # text's length adds: "auto" feeds more late in a text that repeats itself (the window, longer candidates).
        shapes = Counter((step[4], step[3]) for step in late)
        shared = [shape for shape, _ in shapes.most_common() if sum((s[4], s[3]) == shape for s in early) >= 3]
        if shared:
            fed, kept = shared[0]
            row["shape_fed"], row["shape_kept"] = fed, kept
            row["shape_early_host_ms"] = statistics.median(s[1] for s in early if (s[4], s[3]) == (fed, kept))
            row["shape_late_host_ms"] = statistics.median(s[1] for s in late if (s[4], s[3]) == (fed, kept))
            row["shape_ratio"] = row["shape_late_host_ms"] / row["shape_early_host_ms"]
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from utils.assets import chat_input_ids, model_path, tuning_prompts

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2", help="smollm2, qwen-coder, or a model folder")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--num-prompts", type=int, default=2, help="tuning prompts per dataset")
    parser.add_argument("--new-tokens", type=int, default=1024)
    parser.add_argument("--window", type=int, default=128, help="tokens at the start and at the end compared")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--output-dir", default="bench_out")
    args = parser.parse_args(argv)
    if args.new_tokens < 2 * args.window:
        parser.error(f"--new-tokens ({args.new_tokens}) must be at least twice --window ({args.window}).")
    if args.threads:
        torch.set_num_threads(args.threads)
    path = model_path(args.model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    dtype = getattr(torch, args.dtype)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa").eval()
    model = enable_lookahead(model, state=LookaheadState(cost_dir=None))
    # Every text runs to its length: the steps near the end are the ones measured.
    model.generation_config.eos_token_id = None
    if model.generation_config.pad_token_id is None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id or 0
    prompts = [
        (prompt_id, chat_input_ids(tokenizer, text, dataset))
        for dataset in ("humaneval", "mt_bench")
        for prompt_id, _, text in tuning_prompts(dataset)[: args.num_prompts]
    ]
    timer = ForwardTimer(model)
    runs = []
    with torch.no_grad():
        for repeat in range(args.repeats):
            for prompt_id, prompt in prompts:
                # Methods interleaved per prompt, so that a slower spell of a shared machine falls on all of them.
                for method, settings in METHODS.items():
                    steps = step_host_times(timer, prompt, args.new_tokens, **settings)
                    runs.append({"prompt_id": prompt_id, "method": method, "repeat": repeat, "steps": steps})
                    print(f"{prompt_id} {method} repeat {repeat}: {len(steps)} steps", flush=True)
    summary = summarize_host_time(runs, args.new_tokens, args.window)
    command = "python -m experiments.host_time " + " ".join(argv if argv is not None else sys.argv[1:])
    environment = {
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "threads": torch.get_num_threads(),
        "device": str(model.device),
        "dtype": args.dtype,
        "model": args.model,
        "new_tokens": args.new_tokens,
        "command": command.strip(),
        "native_half_precision": native_half_precision(model.device),
        **provenance(),
    }
    output = Path(args.output_dir)
    output.mkdir(parents=True, exist_ok=True)
    name = f"host_time_{Path(args.model).name}_{args.dtype}.json"
    (output / name).write_text(json.dumps({"environment": environment, "host_time": summary, "runs": runs}, indent=1))
    print(f"{'method':<18} {'early host ms':>13} {'late host ms':>12} {'ratio':>6} {'kept early / late':>17}")
    for row in summary:
        print(
            f"{row['method']:<18} {row['early_host_ms']:>13.2f} {row['late_host_ms']:>12.2f} {row['host_ratio']:>5.2f}x "
            f"{row['early_kept']:>8.2f} / {row['late_kept']:<6.2f}"
        )
    print(f"wrote {output / name}")


if __name__ == "__main__":
    main()
