"""
Gather vs refeed cache commit on SmolLM2-135M-Instruct, interleaved per prompt (the numbers in the guide):

    python -m experiments.cache_commit_time --prompts 3 --repeats 2
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from transformers_lookahead import enable_lookahead  # noqa: E402
from utils.assets import chat_input_ids, smollm2_path, tuning_prompts  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--prompts", type=int, default=3, help="prompts per dataset")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--window", default="7", help="lookahead_window (an int or auto)")
    args = parser.parse_args()
    window = args.window if args.window == "auto" else int(args.window)
    torch.set_num_threads(2)
    path = smollm2_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = enable_lookahead(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval())
    prompts = [
        chat_input_ids(tokenizer, text, dataset)
        for dataset in ("mt_bench", "humaneval")
        for _, _, text in tuning_prompts(dataset)[: args.prompts]
    ]
    seconds = {"gather": [], "refeed": []}
    tokens = {"gather": 0, "refeed": 0}
    passes = {"gather": 0, "refeed": 0}
    for ids in prompts:
        per_strategy = {"gather": [], "refeed": []}
        for _ in range(args.repeats):
            for strategy in per_strategy:
                start = time.perf_counter()
                out = model.generate(
                    ids,
                    max_new_tokens=args.max_new_tokens,
                    do_sample=False,
                    lookahead_window=window,
                    lookahead_ngram=4,
                    lookahead_cache_commit=strategy,
                    return_dict_in_generate=True,
                )
                per_strategy[strategy].append(time.perf_counter() - start)
                tokens[strategy] += out.sequences.shape[1] - ids.shape[1]
                passes[strategy] += out.num_forward_passes
        for strategy, values in per_strategy.items():
            seconds[strategy].append(statistics.median(values))
    for strategy in seconds:
        total = sum(seconds[strategy])
        print(
            f"{strategy:>7}: {total:7.2f} s over {len(prompts)} prompts (sum of medians), "
            f"{tokens[strategy] / passes[strategy]:.2f} tokens per forward"
        )
    print(f"refeed / gather time: {sum(seconds['refeed']) / sum(seconds['gather']):.3f}")


if __name__ == "__main__":
    main()
