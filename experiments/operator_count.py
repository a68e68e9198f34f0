"""
Operators dispatched per forward pass: a plain one-token greedy pass against a lookahead pass, counted by a
`TorchDispatchMode` around `generate`, split per pass by forward hooks. Operator counts do not depend on the machine's
speed or load, so they show what a step adds to a pass wherever the passes run.

    python -m experiments.operator_count                          # SmolLM2-135M-Instruct and Qwen2.5-Coder-0.5B-Instruct
    python -m experiments.operator_count --model smollm2 --contexts   # operators only, no pass timing

With `--contexts`, it also times one lookahead-shaped pass over caches of those lengths with the key/value heads
repeated for the masked attention (as Transformers' sdpa does) and grouped without copies, interleaved.
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
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from transformers_lookahead import LookaheadState, enable_lookahead  # noqa: E402
from utils.methods import methods  # noqa: E402
from utils.timing import native_half_precision, provenance  # noqa: E402

# The methods counted: plain greedy, and lade's 7/5/7 (every step the same full shape, whatever the text).
METHODS = methods("greedy", "lookahead_7_5_7")


class OperatorCounter(TorchDispatchMode):
    """Counts every operator dispatched while it is active, per operator name."""

    def __init__(self):
        super().__init__()
        self.total = 0
        self.by_name: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.total += 1
        self.by_name[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def operators_per_pass(model, prompt: torch.LongTensor, new_tokens: int, **generate_kwargs) -> list[dict]:
    """
    Every forward pass of `model.generate(prompt, ...)`: its query tokens and the operators it dispatched, by name.

    Args:
        model (`PreTrainedModel`): the model (with lookahead enabled, for lookahead settings).
        prompt (`torch.LongTensor`): the prompt, `(1, length)`.
        new_tokens (`int`): `max_new_tokens` of the call.
    """
    counter = OperatorCounter()
    passes: list[dict] = []
    marks: list[tuple[int, Counter[str]]] = []

    def before(module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        marks.append((ids.shape[-1], counter.by_name.copy()))

    def after(module, args, kwargs, output):
        tokens, start = marks.pop()
        passes.append({"tokens": tokens, "operators": dict(counter.by_name - start)})

    hooks = [
        model.register_forward_pre_hook(before, with_kwargs=True),
        model.register_forward_hook(after, with_kwargs=True),
    ]
    try:
        with torch.no_grad(), counter:
            model.generate(prompt, max_new_tokens=new_tokens, do_sample=False, **generate_kwargs)
    finally:
        for hook in hooks:
            hook.remove()
    return passes


def compare(model, prompt: torch.LongTensor, new_tokens: int = 16) -> dict:
    """
    The median operators of a decoding pass (the prefill left out) per method, the lookahead pass's ratio to a
    one-token pass, and the operators whose counts differ between the two.
    """
    counts = {}
    for name, kwargs in METHODS.items():
        passes = operators_per_pass(model, prompt, new_tokens, **kwargs)[1:]
        totals = [sum(p["operators"].values()) for p in passes]
        middle = sorted(range(len(passes)), key=lambda index: totals[index])[len(passes) // 2]
        counts[name] = {
            "passes": len(passes),
            "tokens": statistics.median(p["tokens"] for p in passes),
            "operators": statistics.median(totals),
            "by_name": passes[middle]["operators"],
        }
    greedy, lookahead = counts["greedy"]["by_name"], counts["lookahead_7_5_7"]["by_name"]
    difference = {
        name: lookahead.get(name, 0) - greedy.get(name, 0)
        for name in sorted(set(greedy) | set(lookahead))
        if lookahead.get(name, 0) != greedy.get(name, 0)
    }
    return {
        "greedy_operators": counts["greedy"]["operators"],
        "lookahead_operators": counts["lookahead_7_5_7"]["operators"],
        "lookahead_tokens": counts["lookahead_7_5_7"]["tokens"],
        "ratio": counts["lookahead_7_5_7"]["operators"] / counts["greedy"]["operators"],
        "difference": difference,
    }


def pass_milliseconds(model, contexts: tuple[int, ...], step_tokens: int = 33, repeats: int = 15) -> list[dict]:
    """
    The median time of one lookahead-shaped pass (`step_tokens` tokens under a mask that is not causal, as a step's
    window and tree are) over a cache of each context length, with the key/value heads repeated for the masked
    attention (Transformers' sdpa) and grouped without copies (`grouped_attention`), interleaved pass by pass.

    Args:
        model (`PreTrainedModel`): a decoder-only model with sdpa attention over grouped key/value heads.
        contexts (`tuple[int]`): cached tokens before the step.
    """
    import time
    from contextlib import nullcontext

    from transformers import DynamicCache

    from transformers_lookahead.compatibility import grouped_sdpa_for
    from transformers_lookahead.grouped_attention import register_grouped_attention
    from transformers_lookahead.step_forward import cache_argument

    register_grouped_attention()
    generator = torch.Generator().manual_seed(0)
    vocabulary = model.config.get_text_config(decoder=True).vocab_size
    rows = []
    for context in contexts:
        prefix = torch.randint(2, vocabulary, (1, context), generator=generator)
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            model(input_ids=prefix, use_cache=True, **{cache_argument(model): cache})
        ids = torch.randint(2, vocabulary, (1, step_tokens), generator=generator)
        positions = torch.arange(context, context + step_tokens)[None]
        # Every step row sees the cache and about half of the step's rows before it: not a causal pattern.
        visible = torch.ones(step_tokens, context + step_tokens, dtype=torch.bool)
        visible[:, context:] = torch.rand(step_tokens, step_tokens, generator=generator).tril() > 0.5
        visible[:, context:].fill_diagonal_(True)
        mask = torch.zeros(1, 1, step_tokens, context + step_tokens, dtype=model.dtype)
        mask.masked_fill_(~visible, torch.finfo(model.dtype).min)
        times = {"repeated": [], "grouped": []}
        # The first round warms kernels and the allocator up, untimed.
        for round_ in range(repeats + 1):
            for name, attention in (("repeated", nullcontext), ("grouped", grouped_sdpa_for)):
                started = time.perf_counter()
                with torch.no_grad(), attention(model.config):
                    model(
                        input_ids=ids,
                        position_ids=positions,
                        attention_mask=mask,
                        use_cache=True,
                        logits_to_keep=1,
                        **{cache_argument(model): cache},
                    )
                if round_:
                    times[name].append(1000 * (time.perf_counter() - started))
                cache.crop(-step_tokens)
        repeated, grouped = (statistics.median(times[name]) for name in ("repeated", "grouped"))
        rows.append({"context": context, "step_tokens": step_tokens, "repeated_ms": repeated, "grouped_ms": grouped})
    return rows


def main(argv: list[str] | None = None) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from utils.assets import chat_input_ids, model_path, tuning_prompts

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", nargs="+", default=["smollm2", "qwen-coder"], help="smollm2, qwen-coder, a folder")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--output-dir", default="bench_out")
    parser.add_argument(
        "--contexts",
        type=int,
        nargs="*",
        default=[128, 1024],
        help="also time a 33-token lookahead-shaped pass over caches of these lengths, key/value heads repeated and "
        "grouped (none: operators only)",
    )
    args = parser.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    rows = []
    for name in args.model:
        path = model_path(name)
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa").eval()
        model = enable_lookahead(model, state=LookaheadState(cost_dir=None))
        prompt_id, _, text = tuning_prompts("humaneval")[0]
        prompt = chat_input_ids(tokenizer, text, "humaneval")
        row = {"model": name, "prompt_id": prompt_id, "prompt_tokens": prompt.shape[1], **compare(model, prompt)}
        if args.contexts:
            row["pass_ms"] = pass_milliseconds(model, tuple(args.contexts))
        rows.append(row)
        print(json.dumps({key: value for key, value in row.items() if key != "difference"}), flush=True)
        print("  differing operators (lookahead - greedy):", row["difference"], flush=True)
    environment = {
        "torch": torch.__version__,
        "device": "cpu",
        "dtype": args.dtype,
        "threads": torch.get_num_threads(),
        "native_half_precision": native_half_precision(torch.device("cpu")),
        "command": "python -m experiments.operator_count " + " ".join(argv if argv is not None else sys.argv[1:]),
        **provenance(),
    }
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "operators.json").write_text(json.dumps({"environment": environment, "operators": rows}, indent=1) + "\n")
    print(f"written: {out / 'operators.json'}")


if __name__ == "__main__":
    main()
