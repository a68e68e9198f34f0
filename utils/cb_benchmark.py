"""
`utils/benchmark.py --continuous-batching`: Transformers' continuous batching with and without lookahead, and
lookahead `generate` serving one request at a time, at several numbers of concurrent requests.

Each level replays the same prompts as a closed loop of `concurrency` clients: every client sends its next prompt as
soon as its previous answer is complete. The three engines run interleaved per level and repeat. Reported per level
and engine: generated tokens per second over the level's wall time and while every client had a request in flight
(`full_load_rate`), generated tokens per forward pass a request took part in (the prefill's included; plain
continuous batching's is 1), per-request latency (p50, p95) and time to the first token (p50, p95), the time of each
forward pass of the level (the engine's step, all its requests) and the part of it inside the model's forward, and
whether every greedy answer equals plain continuous batching's.

`generate_one_at_a_time` serves the same closed loop with one `model.generate` call at a time: a request waits for
the ones before it, so its latency and time to first token include that wait.

Lookahead runs without its suffix memory (`lookahead_memory=False`): the levels and repeats replay the same
prompts, and a memory would answer each from the one before (`--memory` measures the memory on its own).

Both engines get the same size (`ENGINE_BLOCKS` pages of 256 tokens, `ENGINE_BATCH_TOKENS` tokens per forward pass):
by default each sizes its cache from the machine's free memory. Each run starts its engine fresh and stops it after,
as `generate_batch` does, and all of a run's torch work happens in threads that end with it (`_in_own_thread`): on a
2-core CPU an idle engine left running beside the measured one (its thread had served the warm-up) slowed it by a
third, and a thread that had run forward passes earlier and was still alive by close to half (see `_in_own_thread`).
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from transformers import GenerationConfig
from transformers.generation.configuration_utils import ContinuousBatchingConfig

from utils.timing import ForwardTimer

ENGINES = ("plain_cb", "lookahead_cb", "generate_one_at_a_time")
# 16 requests of up to ~1000 tokens each, and room for prefill chunks beside 16 decoding requests' blocks.
ENGINE_BLOCKS = 80
ENGINE_BATCH_TOKENS = 1024


def _p95(values: list[float]) -> float:
    """The nearest-rank 95th percentile."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, -(-95 * len(ordered) // 100) - 1)]


def engine_config(tokenizer, max_new_tokens: int, lookahead: bool) -> GenerationConfig:
    """Greedy, the tokenizer's EOS; `lookahead_window="auto"` without the suffix memory, or lookahead off."""
    # No suffix memory: every level and repeat replays the same prompts, which a memory would answer from the last.
    settings = {"lookahead_window": "auto", "lookahead_memory": False} if lookahead else {"lookahead_window": "off"}
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return GenerationConfig(
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=pad_id,
        **settings,
    )


def _serve_closed_loop(manager, prompts: list[list[int]], concurrency: int, max_new_tokens: int) -> dict:
    """Replays `prompts` through a running manager with `concurrency` requests in flight."""
    waiting = deque(enumerate(prompts))
    in_flight, answers, latency, first_token, forwards, token_times = {}, {}, {}, {}, {}, {}
    start = time.perf_counter()
    full_until = None

    def submit() -> None:
        index, prompt = waiting.popleft()
        request_id = manager.add_request(prompt, max_new_tokens=max_new_tokens, record_timestamps=True)
        in_flight[request_id] = (index, time.perf_counter())

    while waiting and len(in_flight) < concurrency:
        submit()
    while in_flight:
        result = manager.get_result(timeout=600)
        if result is None:
            raise RuntimeError("the continuous-batching engine stopped")
        if not result.is_finished() or result.request_id not in in_flight:
            continue
        if result.error is not None:
            raise RuntimeError(f"request {result.request_id} failed: {result.error}")
        index, sent = in_flight.pop(result.request_id)
        done = time.perf_counter()
        answers[index] = list(result.generated_tokens)
        # The prefill's pass gives the first token; plain continuous batching then takes one pass per token.
        steps = getattr(result, "accepted_per_step", None)
        forwards[index] = 1 + len(steps) if steps is not None else len(answers[index])
        latency[index] = done - sent
        stamps = result.timestamps or [done]
        first_token[index] = stamps[0] - sent
        # To 0.1 ms, as `full_until` is (so the order between them holds): the report keeps every token's time.
        token_times[index] = [round(stamp - start, 4) for stamp in result.timestamps or []]
        if waiting:
            submit()
        elif full_until is None:
            full_until = round(done - start, 4)
    return {
        "seconds": time.perf_counter() - start,
        "answers": [answers[i] for i in range(len(prompts))],
        "latency": [latency[i] for i in range(len(prompts))],
        "first_token": [first_token[i] for i in range(len(prompts))],
        "forwards": [forwards[i] for i in range(len(prompts))],
        "token_times": [token_times[i] for i in range(len(prompts))],
        "full_until": full_until,
    }


class _TokenTimes:
    """A streamer that notes when `generate` produced each new token, and counts the chunks they came in."""

    def __init__(self):
        self.calls, self.times = 0, []

    @property
    def chunks(self) -> int:
        """The new-token chunks `generate` sent: one per forward pass (the first call carries the prompt)."""
        return self.calls - 1

    def put(self, value) -> None:
        self.calls += 1
        if self.calls > 1:
            self.times.extend([time.perf_counter()] * value.numel())

    def end(self) -> None:
        pass


def _generate_closed_loop(model, prompts: list[list[int]], concurrency: int, config: GenerationConfig) -> dict:
    """The same closed loop served by one `generate` call at a time (the clients' requests queue up)."""
    waiting = deque(enumerate(prompts))
    queue = deque()
    clock = time.perf_counter()
    start = clock
    answers, latency, first_token, forwards, token_times = {}, {}, {}, {}, {}
    full_until = None
    for _ in range(min(concurrency, len(prompts))):
        queue.append((*waiting.popleft(), clock))
    while queue:
        index, prompt, sent = queue.popleft()
        streamer = _TokenTimes()
        ids = torch.tensor([prompt], device=model.device)
        out = model.generate(ids, generation_config=config, streamer=streamer)
        done = time.perf_counter()
        answers[index] = out[0, len(prompt) :].tolist()
        if config.eos_token_id is not None and config.eos_token_id in answers[index]:
            answers[index] = answers[index][: answers[index].index(config.eos_token_id) + 1]
        latency[index] = done - sent
        first_token[index] = (streamer.times[0] if streamer.times else done) - sent
        forwards[index] = streamer.chunks
        token_times[index] = [round(stamp - start, 4) for stamp in streamer.times[: len(answers[index])]]
        if waiting:
            queue.append((*waiting.popleft(), done))
        elif full_until is None:
            full_until = round(done - start, 4)
    return {
        "seconds": time.perf_counter() - start,
        "answers": [answers[i] for i in range(len(prompts))],
        "latency": [latency[i] for i in range(len(prompts))],
        "first_token": [first_token[i] for i in range(len(prompts))],
        "forwards": [forwards[i] for i in range(len(prompts))],
        "token_times": [token_times[i] for i in range(len(prompts))],
        "full_until": full_until,
    }


def run_continuous_batching(args, model, tokenizer, prompts) -> dict:
    """
    Every level of `args.concurrency`, `args.repeats` times, the three engines interleaved.

    Args:
        args: the benchmark's arguments (`concurrency`, `repeats`, `max_new_tokens`).
        model: the model, with lookahead enabled (`enable_lookahead`).
        tokenizer: its tokenizer.
        prompts: `(prompt_id, category, input_ids, length)` per prompt, as `benchmark._prompts` gives them.
    """
    from tqdm.auto import tqdm

    ids = [item[2][0].tolist() for item in prompts]
    plain_config = engine_config(tokenizer, args.max_new_tokens, lookahead=False)
    lookahead_config = engine_config(tokenizer, args.max_new_tokens, lookahead=True)
    configs = {"plain_cb": plain_config, "lookahead_cb": lookahead_config}
    timer = ForwardTimer(model)
    # Warm-up: the lookahead engine measures its cost table on its first request (kept by the model's state).
    for config in configs.values():
        _in_own_thread(_serve_fresh_engine, model, config, ids[:2], 2, 8)
    _in_own_thread(_generate_closed_loop, model, ids[:1], 1, engine_config(tokenizer, 8, lookahead=True))
    runs = []
    progress = tqdm(total=len(args.concurrency) * args.repeats * len(ENGINES), desc="continuous batching")
    for concurrency in args.concurrency:
        for repeat in range(args.repeats):
            for engine in ENGINES:
                if engine == "generate_one_at_a_time":
                    timer.reset()
                    run = _in_own_thread(_generate_closed_loop, model, ids, concurrency, lookahead_config)
                else:
                    config = configs[engine]
                    run = _in_own_thread(
                        _serve_fresh_engine, model, config, ids, concurrency, args.max_new_tokens, timer
                    )
                run.update(forward_passes=timer.calls, forward_seconds=timer.seconds)
                runs.append({"engine": engine, "concurrency": concurrency, "repeat": repeat, **run})
                progress.update()
    progress.close()
    return {"runs": runs, "prompt_ids": [item[0] for item in prompts]}


def _in_own_thread(function, *args):
    """
    `function(*args)`, run in a thread that ends when it returns. On a CPU, torch's OpenMP workers belong to the thread
    that ran the parallel work, and stay while it lives: after one `generate` call on the main thread, an engine's own
    thread ran SmolLM2 bf16 at 19.4 tokens/s against 34.7 without that call (one client, 2 cores); the same call on a
    thread that had ended left it at 34.6.
    """
    with ThreadPoolExecutor(max_workers=1) as executor:
        return executor.submit(function, *args).result()


def _serve_fresh_engine(
    model, config: GenerationConfig, prompts: list[list[int]], concurrency: int, max_new_tokens: int, timer=None
) -> dict:
    """Starts an engine for `config`, replays `prompts` through it (`_serve_closed_loop`), and stops it."""
    manager = model.init_continuous_batching(
        config, ContinuousBatchingConfig(num_blocks=ENGINE_BLOCKS, max_batch_tokens=ENGINE_BATCH_TOKENS)
    )
    manager.start()
    try:
        if timer is not None:
            timer.reset()  # the engine's start-up is not one of its passes
        return _serve_closed_loop(manager, prompts, concurrency, max_new_tokens)
    finally:
        manager.stop(block=True, timeout=30)


def full_load_rate(run: dict) -> float:
    """
    Tokens per second while every client had a request in flight: from the level's start to the first answer that
    no prompt was left to replace. After it the load drains, and how long that takes depends on how unevenly the last
    requests end, not on the load the level names: plain continuous batching's answers of equal length end in one
    step, while lookahead's, which accept different numbers of tokens per step, end one by one.
    """
    until = run["full_until"]
    return sum(stamp <= until for times in run["token_times"] for stamp in times) / until


def summarize_continuous_batching(result: dict) -> list[dict]:
    """Per level and engine: medians over repeats of tokens/s, and percentiles over all requests of all repeats."""
    rows = []
    for concurrency in sorted({run["concurrency"] for run in result["runs"]}):
        level = [run for run in result["runs"] if run["concurrency"] == concurrency]
        reference = next(run["answers"] for run in level if run["engine"] == "plain_cb")
        plain_rate = None
        for engine in ENGINES:
            runs = [run for run in level if run["engine"] == engine]
            tokens = sum(len(answer) for answer in runs[0]["answers"])
            rate = statistics.median(sum(len(a) for a in run["answers"]) / run["seconds"] for run in runs)
            full_rate = statistics.median(full_load_rate(run) for run in runs)
            if engine == "plain_cb":
                plain_rate, plain_full_rate = rate, full_rate
            latency = [value for run in runs for value in run["latency"]]
            first = [value for run in runs for value in run["first_token"]]
            identical = sum(answer == expected for run in runs for answer, expected in zip(run["answers"], reference))
            rows.append(
                {
                    "concurrency": concurrency,
                    "engine": engine,
                    "tokens": tokens,
                    "tokens_per_s": rate,
                    "tokens_per_forward": tokens / sum(runs[0]["forwards"]),
                    "pass_ms": statistics.median(1000 * run["seconds"] / run["forward_passes"] for run in runs),
                    "forward_ms": statistics.median(
                        1000 * run["forward_seconds"] / run["forward_passes"] for run in runs
                    ),
                    "speedup_vs_plain_cb": rate / plain_rate,
                    "full_load_tokens_per_s": full_rate,
                    "full_load_speedup_vs_plain_cb": full_rate / plain_full_rate,
                    "latency_p50": statistics.median(latency),
                    "latency_p95": _p95(latency),
                    "first_token_p50": statistics.median(first),
                    "first_token_p95": _p95(first),
                    "identical": identical,
                    "answers": sum(len(run["answers"]) for run in runs),
                }
            )
    return rows


def format_continuous_batching_table(rows: list[dict], result: dict | None = None) -> str:
    header = (
        f"{'clients':>7} {'engine':<24} {'tok/s':>7} {'vs plain CB':>11} {'full load tok/s':>15} {'vs plain CB':>11} "
        f"{'tok/forward':>11} {'pass / fwd ms':>14} {'latency p50/p95 (s)':>20} "
        f"{'first token p50/p95 (s)':>24} {'same as plain CB':>16}"
    )
    lines = [header, "-" * len(header)]
    for row in rows:
        lines.append(
            f"{row['concurrency']:>7} {row['engine']:<24} {row['tokens_per_s']:>7.1f} "
            f"{row['speedup_vs_plain_cb']:>10.2f}x {row['full_load_tokens_per_s']:>15.1f} "
            f"{row['full_load_speedup_vs_plain_cb']:>10.2f}x {row['tokens_per_forward']:>11.2f} "
            f"{row['pass_ms']:>6.1f} / {row['forward_ms']:<5.1f} {row['latency_p50']:>9.2f} / {row['latency_p95']:<8.2f} "
            f"{row['first_token_p50']:>11.2f} / {row['first_token_p95']:<10.2f} "
            f"{row['identical']:>8}/{row['answers']}"
        )
    return "\n".join(lines)


def plot_continuous_batching(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(6, 4))
    for engine in ENGINES:
        mine = [row for row in rows if row["engine"] == engine]
        axis.plot(
            [row["concurrency"] for row in mine], [row["tokens_per_s"] for row in mine], marker="o", label=engine
        )
    levels = sorted({row["concurrency"] for row in rows})
    axis.set_xscale("log", base=2)
    axis.set_xticks(levels, [str(level) for level in levels])
    axis.set_xlabel("concurrent requests")
    axis.set_ylabel("generated tokens / s")
    axis.set_title("Continuous batching throughput")
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)
