"""
What keeping a hybrid model's recurrent states costs a chain step (`CacheCommitter.before_step` and `undo`): the
bytes copied and the time to copy them and to put them back, against the step's own forward pass, on a random model
of a real hybrid shape (Qwen3.5-like: gated-delta-rule linear attention in three layers of four, full attention in
the fourth) built on this machine. Writes `<output-dir>/<stem>.json` (rendered on the results page).

    python utils/recurrent_state_cost.py --dtype float32 --threads 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import DynamicCache  # noqa: E402

from transformers_lookahead.chain_steps import committer_for  # noqa: E402
from utils.render_results import result_table
from utils.workload import environment  # noqa: E402

# About 1.8B parameters (tied embeddings): Qwen3.5's layout at a 2B model's width.
SHAPE = {
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "num_hidden_layers": 24,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 16,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "tie_word_embeddings": True,
}


def build(dtype: torch.dtype) -> transformers.PreTrainedModel:
    config = transformers.Qwen3_5TextConfig(**SHAPE)
    torch.manual_seed(0)
    return transformers.Qwen3_5ForCausalLM(config).to(dtype).eval()


def median_ms(values: list[float]) -> float:
    return round(1000 * statistics.median(values), 3)


@torch.no_grad()
def measure(model: transformers.PreTrainedModel, context: int, chain: int, repeats: int) -> dict:
    """Per repeat, interleaved: a one-token pass, a chain pass of `chain` tokens, the states' copy and put-back."""
    generator = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    ids = torch.randint(vocab // 4, vocab, (1, context + chain), generator=generator)
    cache = DynamicCache(config=model.config)
    model(input_ids=ids[:, :context], cache=cache, use_cache=True)
    committer = committer_for(cache, owner=type(model).__name__)
    committer.start()
    times = {"one_token_pass": [], "chain_pass": [], "save": [], "restore": []}
    for repeat in range(repeats + 1):
        for name, tokens in (("one_token_pass", 1), ("chain_pass", chain)):
            start = time.perf_counter()
            committer.before_step(feeds_guesses=True)
            saved = time.perf_counter()
            model(input_ids=ids[:, context : context + tokens], cache=cache, use_cache=True)
            passed = time.perf_counter()
            committer.undo(tokens)
            undone = time.perf_counter()
            if repeat:  # the first round warms up
                times[name].append(passed - saved)
                if name == "chain_pass":
                    times["save"].append(saved - start)
                    times["restore"].append(undone - passed)
    committer.before_step(feeds_guesses=True)
    state_bytes = committer.states.nbytes()
    return {
        "parameters": sum(parameter.numel() for parameter in model.parameters()),
        "recurrent_layers": len(committer.states.layers),
        "layers": model.config.num_hidden_layers,
        "context": context,
        "chain": chain,
        "state_mib_per_sequence": round(state_bytes / 2**20, 2),
        **{f"{name}_ms": median_ms(values) for name, values in times.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # Without native bf16 on a CPU (`lscpu`: avx512_bf16 or amx_bf16), bf16 is emulated: measure float32 there.
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--chain", type=int, default=8, help="tokens of the timed chain step")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--output-dir", type=Path, default=Path("docs/source/en/benchmarks"))
    parser.add_argument("--stem", default=None, help="file name without suffix")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = build(getattr(torch, args.dtype))
    row = measure(model, args.context, args.chain, args.repeats)
    settings = SimpleNamespace(
        dtype=args.dtype, max_new_tokens=None, repeats=args.repeats, command="python " + " ".join(sys.argv)
    )
    name = {"float32": "fp32", "bfloat16": "bf16"}[args.dtype]
    result = {
        "title": f"Random Qwen3.5-like model, {row['parameters'] / 1e9:.2f}B parameters, {name}",
        "recurrent_state": row,
        "environment": environment(settings, torch.device("cpu")),
    }
    stem = args.output_dir / (args.stem or f"cpu_recurrent_state_qwen3_5_like_{args.dtype}")
    stem.with_suffix(".json").write_text(json.dumps(result, indent=1))
    print("\n".join(result_table(stem.name, result)))


if __name__ == "__main__":
    main()
