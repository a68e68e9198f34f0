"""
What a Hub user gains: SmolLM2-135M-Instruct in a venv with stock torch and Transformers only (`utils/stock_venv.py`),
plain greedy against the generated strategy repository (`custom_generate=<repo>`, its defaults: the core's fixed
window W = 7, N = 5, G = 7), interleaved per prompt, on HumanEval and MT-Bench tuning prompts.

    python utils/hub_benchmark.py                       # 4 + 4 prompts, 128 new tokens, 2 repeats
    python utils/hub_benchmark.py --num-prompts 8 --repeats 3 --output bench_out/hub.json

The same file runs inside the stock venv (`--inside JOB`), where it imports nothing but torch and Transformers.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path


def inside(job: dict) -> dict:
    """Runs in the stock venv: every prompt, every repeat, plain greedy and the Hub strategy in alternating order."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(job["threads"])
    model = AutoModelForCausalLM.from_pretrained(job["model"], dtype=torch.float32)
    passes = []
    model.register_forward_hook(lambda *_: passes.append(1))
    methods = {"greedy": {}, "hub": {"custom_generate": job["repo"], "trust_remote_code": True}}
    common = {"max_new_tokens": job["max_new_tokens"], "do_sample": False}
    # Warm-up: kernels, and the strategy's first call, which loads its modules.
    for kwargs in methods.values():
        model.generate(torch.tensor([job["prompts"][0]["ids"]]), **common, **kwargs)
    runs = []
    for index, prompt in enumerate(job["prompts"]):
        ids = torch.tensor([prompt["ids"]])
        reference = None
        for repeat in range(job["repeats"]):
            order = list(methods) if (index + repeat) % 2 == 0 else list(methods)[::-1]
            for name in order:
                passes.clear()
                start = time.perf_counter()
                out = model.generate(ids, **common, **methods[name])
                seconds = time.perf_counter() - start
                if name == "greedy" and reference is None:
                    reference = out
                runs.append(
                    {
                        "prompt_id": prompt["id"],
                        "method": name,
                        "repeat": repeat,
                        "new_tokens": out.shape[1] - ids.shape[1],
                        "seconds": seconds,
                        "forward_passes": len(passes),
                        "tokens": out[0].tolist(),
                    }
                )
        for run in runs:
            if run["prompt_id"] == prompt["id"]:
                run["identical_to_greedy"] = run.pop("tokens") == reference[0].tolist()
    import transformers

    return {
        "runs": runs,
        "torch_threads": torch.get_num_threads(),
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
    }


def summary(result: dict) -> dict:
    """Per dataset: the median over prompts of each prompt's median tokens/s ratio, tokens per forward, identity."""
    by_dataset: dict = {}
    for dataset in ("humaneval", "mt_bench"):
        runs = [run for run in result["runs"] if run["prompt_id"].lower().startswith(dataset)]
        if not runs:
            continue
        ratios = []
        for prompt_id in sorted({run["prompt_id"] for run in runs}):
            speed = {
                method: statistics.median(
                    run["new_tokens"] / run["seconds"]
                    for run in runs
                    if run["prompt_id"] == prompt_id and run["method"] == method
                )
                for method in ("greedy", "hub")
            }
            ratios.append(speed["hub"] / speed["greedy"])
        hub = [run for run in runs if run["method"] == "hub"]
        by_dataset[dataset] = {
            "prompts": len(ratios),
            "median_speedup": round(statistics.median(ratios), 3),
            "worst_prompt_speedup": round(min(ratios), 3),
            "tokens_per_forward": round(sum(r["new_tokens"] for r in hub) / sum(r["forward_passes"] for r in hub), 2),
            "identical_to_greedy": all(run["identical_to_greedy"] for run in runs),
        }
    return by_dataset


def main() -> None:
    import argparse
    import tempfile

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import torch
    from transformers import AutoTokenizer

    from utils.assets import chat_input_ids, model_path, tuning_prompts
    from utils.build_hub_repo import build_hub_repo
    from utils.stock_venv import run_in_stock_venv
    from utils.timing import native_half_precision, provenance

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-prompts", type=int, default=4, help="tuning prompts per dataset")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--model", default=None, help="smollm2 (default), qwen-coder, or a model folder")
    parser.add_argument("--output", default="bench_out/hub.json")
    args = parser.parse_args()

    # Recorded before the run: the repository is built from the tree as it is now.
    recorded = provenance()
    folder = model_path(args.model)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    prompts = []
    for dataset in ("humaneval", "mt_bench"):
        for prompt_id, _, text in tuning_prompts(dataset)[: args.num_prompts]:
            prompts.append({"id": prompt_id, "ids": chat_input_ids(tokenizer, text, dataset)[0].tolist()})
    with tempfile.TemporaryDirectory() as tmp:
        repo = build_hub_repo(Path(tmp) / "lookahead")
        job = {
            "model": str(folder),
            "repo": str(repo),
            "prompts": prompts,
            "repeats": args.repeats,
            "max_new_tokens": args.max_new_tokens,
            "threads": args.threads,
        }
        result = run_in_stock_venv(Path(__file__).resolve(), {"inside": job}, timeout=5400)
    result["summary"] = summary(result)
    result["settings"] = {key: value for key, value in vars(args).items() if key != "output"}
    result["environment"] = {
        "threads": args.threads,
        "device": "cpu",
        "dtype": "float32",
        "max_new_tokens": args.max_new_tokens,
        "repeats": args.repeats,
        "command": "python -m utils.bench hub-benchmark " + " ".join(sys.argv[1:]),
        "native_half_precision": native_half_precision(torch.device("cpu")),
        **result.pop("versions"),
        **recorded,
    }
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(result, indent=1))
    print(json.dumps(result["summary"], indent=1))
    print(f"Wrote {output}")


if __name__ == "__main__":
    if len(sys.argv) == 2 and sys.argv[1].startswith("{"):
        print(json.dumps(inside(json.loads(sys.argv[1])["inside"])))
    else:
        main()
