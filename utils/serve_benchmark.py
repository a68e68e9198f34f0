"""
What a served user gains: `transformers serve` with and without lookahead decoding, side by side in one run.

Two real servers on 127.0.0.1 (SmolLM2-135M-Instruct saved by stock Transformers, and the same model saved with
`save_lookahead_model`), only one of them busy at a time: for each number of concurrent clients and each dataset,
the same prompts are replayed through the `openai` client against one server, then the other (the order alternates
between repeats). Reported per request: latency and time to first token (p50 / p95); per batch: total tokens/s.

    python utils/serve_benchmark.py                       # 4 + 4 tuning prompts, 1, 2 and 4 clients
    python utils/serve_benchmark.py --num-prompts 8 --repeats 2 --concurrency 1 2 4
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from utils.assets import chat_messages, tuning_prompts  # noqa: E402
from utils.render_results import result_table
from utils.serving import ServeProcess, lookahead_folder  # noqa: E402
from utils.timing import percentile  # noqa: E402

DATASETS = ("humaneval", "mt_bench")


def _request(client, model_id: str, messages: list[dict], max_tokens: int, namespace: str | None = None) -> dict:
    """
    One streamed request: when it started, its first text and its end, the tokens it got, and the text. A
    `namespace` goes to the lookahead server as the request's `lookahead_memory_namespace`.
    """
    started = time.perf_counter()
    first = None
    parts, tokens = [], None
    extra = {}
    if namespace is not None:
        extra["extra_body"] = {"generation_config": json.dumps({"lookahead_memory_namespace": namespace})}
    # The usage chunk comes only when asked for, as the OpenAI API specifies (`transformers serve` follows it).
    stream = client.chat.completions.create(
        model=model_id,
        messages=messages,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        **extra,
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or time.perf_counter()
            parts.append(chunk.choices[0].delta.content)
        if getattr(chunk, "usage", None) is not None:
            tokens = chunk.usage.completion_tokens
    ended = time.perf_counter()
    if tokens is None:
        raise RuntimeError("the server's stream carried no usage chunk: cannot count the generated tokens")
    return {
        "latency": ended - started,
        "ttft": (first or ended) - started,
        "tokens": tokens,
        "text": "".join(parts),
        "started": started,
        "ended": ended,
    }


def _replay(
    client, model_id: str, requests: list[list[dict]], clients: int, max_tokens: int, namespace: str | None = None
) -> dict:
    """All `requests` through `clients` concurrent clients (each takes the next request when it is done)."""
    pending = list(enumerate(requests))
    results: dict[int, dict] = {}
    lock = threading.Lock()
    errors = []

    def worker() -> None:
        while True:
            with lock:
                if not pending:
                    return
                index, messages = pending.pop(0)
            try:
                results[index] = _request(client, model_id, messages, max_tokens, namespace)
            except Exception as error:  # reported after the batch
                errors.append(repr(error))
                return

    threads = [threading.Thread(target=worker) for _ in range(clients)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=3600)
    wall = time.perf_counter() - started
    if errors or len(results) != len(requests):
        raise RuntimeError(f"requests failed: {errors}")
    ordered = [results[index] for index in range(len(requests))]
    return {"wall": wall, "requests": ordered, "tokens": sum(r["tokens"] for r in ordered)}


def summarize(runs: list[dict]) -> list[dict]:
    """Per dataset, number of clients and server: median tokens/s over repeats, latency and TTFT percentiles."""
    grouped = defaultdict(list)
    for run in runs:
        grouped[(run["dataset"], run["clients"], run["server"])].append(run)
    rows = []
    for (dataset, clients, server), group in sorted(grouped.items()):
        requests = [request for run in group for request in run["requests"]]
        rows.append(
            {
                "dataset": dataset,
                "clients": clients,
                "server": server,
                "tokens_per_second": statistics.median(run["tokens"] / run["wall"] for run in group),
                "latency_p50": percentile([r["latency"] for r in requests], 0.5),
                "latency_p95": percentile([r["latency"] for r in requests], 0.95),
                "ttft_p50": percentile([r["ttft"] for r in requests], 0.5),
                "ttft_p95": percentile([r["ttft"] for r in requests], 0.95),
                "identical": sum(run["identical"] for run in group),
                "runs": len(group),
            }
        )
    plain = {(row["dataset"], row["clients"]): row["tokens_per_second"] for row in rows if row["server"] == "plain"}
    for row in rows:
        row["speedup"] = row["tokens_per_second"] / plain[(row["dataset"], row["clients"])]
    return rows


def main(argv: list[str] | None = None) -> None:
    import openai
    from tqdm.auto import tqdm

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-prompts", type=int, default=4, help="tuning prompts per dataset")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--window", default="auto", help="lookahead_window saved in the served folder")
    parser.add_argument("--model", default=None, help="smollm2 (default) or qwen-coder (see utils/assets.py)")
    parser.add_argument("--output-dir", default="bench_out")
    args = parser.parse_args(argv)
    window = args.window if args.window == "auto" else int(args.window)
    prompts = {
        dataset: [chat_messages(text, dataset) for _, _, text in tuning_prompts(dataset)[: args.num_prompts]]
        for dataset in DATASETS
    }
    folders = {
        "plain": lookahead_folder(plain=True, model=args.model),
        "lookahead": lookahead_folder(window, memory=True, model=args.model),
    }
    runs = []
    with (
        ServeProcess(folders["plain"], trust_remote_code=False) as plain,
        ServeProcess(folders["lookahead"], trust_remote_code=True) as looked,
    ):
        servers = {"plain": plain, "lookahead": looked}
        clients = {
            name: openai.OpenAI(base_url=server.base_url, api_key="unused", timeout=3600, max_retries=0)
            for name, server in servers.items()
        }
        # Warm-up: first requests allocate, and the lookahead server reads or measures its cost table.
        for name in servers:
            _request(clients[name], str(folders[name]), prompts["humaneval"][0], 16)
        total = len(args.concurrency) * len(DATASETS) * args.repeats * 2
        progress = tqdm(total=total, desc="serve benchmark", unit="batch")
        for count in args.concurrency:
            for dataset in DATASETS:
                for repeat in range(args.repeats):
                    order = ["plain", "lookahead"] if repeat % 2 == 0 else ["lookahead", "plain"]
                    texts = {}
                    # Every batch starts with an empty suffix memory, as for prompts a server has not seen: the same
                    # prompts come back in every batch, and a shared memory would answer them from the last one.
                    namespace = f"{dataset}-{count}-{repeat}"
                    for name in order:
                        result = _replay(
                            clients[name],
                            str(folders[name]),
                            prompts[dataset],
                            count,
                            args.max_tokens,
                            namespace if name == "lookahead" else None,
                        )
                        texts[name] = [r["text"] for r in result["requests"]]
                        runs.append({"dataset": dataset, "clients": count, "server": name, "repeat": repeat, **result})
                        progress.update()
                    same = texts["plain"] == texts["lookahead"]
                    for run in runs[-2:]:
                        run["identical"] = same
        progress.close()
    rows = summarize(runs)
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    command = "python utils/serve_benchmark.py " + " ".join(argv if argv is not None else sys.argv[1:])
    (out / "serve.json").write_text(json.dumps({"command": command, "runs": runs, "summary": rows}, indent=1))
    print("\n".join(result_table("serve.json", {"summary": rows})))
    print(f"written: {out}/serve.json")


if __name__ == "__main__":
    main()
