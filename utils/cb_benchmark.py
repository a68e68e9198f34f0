"""
`python -m utils.bench continuous-batching`: Transformers' continuous batching with and without lookahead, and
lookahead `generate` serving one request at a time, at several loads.

Each level replays the same prompts as a closed loop of `concurrency` clients: every client sends its next prompt as
soon as its previous answer is complete. With `--arrival-rate` the levels are open loops instead: the prompts arrive
at Poisson times of that many requests per second (`arrival_times`, the same schedule for every engine and repeat),
however many are in flight, as they reach a server; a request's latency counts from its arrival, and latency is what
such a level is judged by. The engines run interleaved per level and repeat; `--padded-engines` adds both
engines again with padded steps (`PADDED_ENGINES`). Reported per level
and engine: generated tokens per second over the level's wall time and while every client had a request in flight
(`full_load_rate`, closed loops only), generated tokens per forward pass a request took part in (the prefill's
included; plain continuous batching's is 1), per-request latency (p50, p95; and how many times shorter the median is
than plain continuous batching's) and time to the first token (p50, p95), the time of each
forward pass of the level (the engine's step, all its requests) and the part of it inside the model's forward, and
whether every greedy answer equals plain continuous batching's.

`generate_one_at_a_time` serves the same loop with one `model.generate` call at a time: a request waits for the ones
before it, so its latency and time to first token include that wait.

Lookahead runs without its suffix memory (`lookahead_memory=False`): the levels and repeats replay the same
prompts, and a memory would answer each from the one before (`--memory` measures the memory on its own).

Both engines get the same size (`ENGINE_BLOCKS` pages of 256 tokens, `ENGINE_BATCH_TOKENS` tokens per forward pass):
by default each sizes its cache from the machine's free memory. Each run starts its engine fresh and stops it after,
as `generate_batch` does, and all of a run's torch work happens in threads that end with it (`_in_own_thread`): on a
2-core CPU an idle engine left running beside the measured one (its thread had served the warm-up) slowed it by a
third, and a thread that had run forward passes earlier and was still alive by close to half (see `_in_own_thread`).
"""

from __future__ import annotations

import random
import statistics
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import torch
from transformers import CompileConfig, GenerationConfig
from transformers.generation.configuration_utils import ContinuousBatchingConfig

from utils.timing import ForwardTimer, percentile

ENGINES = ("plain_cb", "lookahead_cb", "generate_one_at_a_time")
# With `--padded-engines`: both engines again, every step padded to 64 query and 256 key tokens and captured as a
# CUDA graph (`use_cuda_graph=True`) on a GPU, compiled by Inductor with static shapes elsewhere. Compiled, the
# graph breaks at each layer's paged attention and dynamo compiles each layer's attention apart for each shape; its
# settings are per thread and the engines run on their own, so its default limit of 8 applies: past it, a layer's
# attention runs uncompiled, in both engines alike.
PADDED_ENGINES = ("plain_cb_padded", "lookahead_cb_padded")
PADDING = {"q_padding_interval_size": 64, "kv_padding_interval_size": 256}
# 16 requests of up to ~1000 tokens each, and room for prefill chunks beside 16 decoding requests' blocks.
ENGINE_BLOCKS = 80
ENGINE_BATCH_TOKENS = 1024
# Seconds without any output after which a loop gives up on its engine.
RESULT_TIMEOUT = 600.0


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


class _Requests:
    """What a loop records of each request it served, by the prompt's index; times are taken from the loop's start."""

    def __init__(self, count: int):
        self.count = count
        self.start = time.perf_counter()
        self.answers, self.latency, self.first_token, self.forwards, self.token_times = {}, {}, {}, {}, {}

    def finish(self, index: int, sent: float, answer: list[int], forwards: int, stamps: list[float]) -> float:
        """
        Records a request sent at `sent` whose answer is complete now; its tokens were produced at `stamps` (none
        recorded: all now). Returns now.
        """
        done = time.perf_counter()
        self.answers[index] = answer
        self.forwards[index] = forwards
        self.latency[index] = done - sent
        self.first_token[index] = (stamps[0] if stamps else done) - sent
        # To 0.1 ms, as `full_until` is (so the order between them holds): the report keeps every token's time.
        self.token_times[index] = [round(stamp - self.start, 4) for stamp in stamps]
        return done

    def since_start(self, moment: float) -> float:
        return round(moment - self.start, 4)

    def run(self, full_until: float | None) -> dict:
        """The run's report: per prompt, in order, and `full_until` (`None` for an open loop)."""
        order = range(self.count)
        return {
            "seconds": time.perf_counter() - self.start,
            "answers": [self.answers[i] for i in order],
            "latency": [self.latency[i] for i in order],
            "first_token": [self.first_token[i] for i in order],
            "forwards": [self.forwards[i] for i in order],
            "token_times": [self.token_times[i] for i in order],
            "full_until": full_until,
        }


def _finish_engine_request(requests: _Requests, index: int, sent: float, result) -> float:
    """Records a finished result of a continuous-batching manager (see `_Requests.finish`)."""
    if result.error is not None:
        raise RuntimeError(f"request {result.request_id} failed: {result.error}")
    answer = list(result.generated_tokens)
    # The prefill's pass gives the first token; plain continuous batching then takes one pass per token.
    steps = getattr(result, "accepted_per_step", None)
    forwards = 1 + len(steps) if steps is not None else len(answer)
    return requests.finish(index, sent, answer, forwards, list(result.timestamps or []))


def _next_result(manager, timeout: float = RESULT_TIMEOUT):
    """
    The manager's next output within `timeout` seconds (`None` if none came); raises if its engine stopped, or gave
    nothing for `RESULT_TIMEOUT` seconds.
    """
    result = manager.get_result(timeout=timeout)
    if result is None and (timeout >= RESULT_TIMEOUT or not manager.is_running()):
        raise RuntimeError(f"the continuous-batching engine stopped, or gave no result in {timeout:g} s")
    return result


def _serve_closed_loop(manager, prompts: list[list[int]], concurrency: int, max_new_tokens: int) -> dict:
    """Replays `prompts` through a running manager with `concurrency` requests in flight."""
    waiting = deque(enumerate(prompts))
    requests, in_flight = _Requests(len(prompts)), {}
    full_until = None

    def submit() -> None:
        index, prompt = waiting.popleft()
        request_id = manager.add_request(prompt, max_new_tokens=max_new_tokens, record_timestamps=True)
        in_flight[request_id] = (index, time.perf_counter())

    while waiting and len(in_flight) < concurrency:
        submit()
    while in_flight:
        result = _next_result(manager)
        if result is None or not result.is_finished() or result.request_id not in in_flight:
            continue
        done = _finish_engine_request(requests, *in_flight.pop(result.request_id), result)
        if waiting:
            submit()
        elif full_until is None:
            full_until = requests.since_start(done)
    return requests.run(full_until)


def arrival_times(count: int, rate: float, seed: int = 0) -> list[float]:
    """
    When each of `count` requests arrives, in seconds from the first: a Poisson process of `rate` requests per second
    (exponential gaps), drawn from `seed` so that every engine and repeat is sent the same schedule.
    """
    if rate <= 0:
        raise ValueError(f"An arrival rate must be positive, got {rate}.")
    draw, times = random.Random(seed), [0.0]
    while len(times) < count:
        times.append(times[-1] + draw.expovariate(rate))
    return times[:count]


def _serve_open_loop(manager, prompts: list[list[int]], arrivals: list[float], max_new_tokens: int) -> dict:
    """
    Sends each prompt through a running manager at its arrival time (`arrival_times`), however many requests are in
    flight: how requests reach a server. A request's latency counts from its arrival.
    """
    waiting = deque(enumerate(prompts))
    requests, in_flight = _Requests(len(prompts)), {}
    while waiting or in_flight:
        now = time.perf_counter()
        while waiting and requests.start + arrivals[waiting[0][0]] <= now:
            index, prompt = waiting.popleft()
            request_id = manager.add_request(prompt, max_new_tokens=max_new_tokens, record_timestamps=True)
            in_flight[request_id] = (index, requests.start + arrivals[index])
        until_next = requests.start + arrivals[waiting[0][0]] - now if waiting else RESULT_TIMEOUT
        if not in_flight:
            time.sleep(until_next)
            continue
        result = _next_result(manager, timeout=min(max(until_next, 0.001), RESULT_TIMEOUT))
        if result is not None and result.is_finished() and result.request_id in in_flight:
            _finish_engine_request(requests, *in_flight.pop(result.request_id), result)
    return requests.run(None)


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


def _generate_one(model, requests: _Requests, index: int, prompt: list[int], sent: float, config) -> float:
    """Serves one request with `model.generate` and records it (see `_Requests.finish`)."""
    streamer = _TokenTimes()
    out = model.generate(torch.tensor([prompt], device=model.device), generation_config=config, streamer=streamer)
    answer = out[0, len(prompt) :].tolist()
    if config.eos_token_id is not None and config.eos_token_id in answer:
        answer = answer[: answer.index(config.eos_token_id) + 1]
    return requests.finish(index, sent, answer, streamer.chunks, streamer.times[: len(answer)])


def _generate_closed_loop(model, prompts: list[list[int]], concurrency: int, config: GenerationConfig) -> dict:
    """The same closed loop served by one `generate` call at a time (the clients' requests queue up)."""
    waiting = deque(enumerate(prompts))
    requests, queue = _Requests(len(prompts)), deque()
    full_until = None
    for _ in range(min(concurrency, len(prompts))):
        queue.append((*waiting.popleft(), requests.start))
    while queue:
        done = _generate_one(model, requests, *queue.popleft(), config)
        if waiting:
            queue.append((*waiting.popleft(), done))
        elif full_until is None:
            full_until = requests.since_start(done)
    return requests.run(full_until)


def _generate_open_loop(model, prompts: list[list[int]], arrivals: list[float], config: GenerationConfig) -> dict:
    """The same arrivals served by one `generate` call at a time: a request arriving meanwhile waits its turn."""
    requests = _Requests(len(prompts))
    for index, prompt in enumerate(prompts):
        sent = requests.start + arrivals[index]
        time.sleep(max(0.0, sent - time.perf_counter()))
        _generate_one(model, requests, index, prompt, sent, config)
    return requests.run(None)


def run_continuous_batching(args, model, tokenizer, prompts) -> dict:
    """
    Every level, `args.repeats` times, the engines interleaved. The levels are `args.arrival_rate` (requests per
    second of an open loop, `_serve_open_loop`) where given, else `args.concurrency` (clients of a closed loop).

    Args:
        args: the benchmark's arguments (`concurrency`, `arrival_rate`, `repeats`, `max_new_tokens`,
            `padded_engines`, `padded_backend`).
        model: the model, with lookahead enabled (`enable_lookahead`).
        tokenizer: its tokenizer.
        prompts: `(prompt_id, category, input_ids, length)` per prompt, as `Workload.prompts` gives them.
    """
    plain_config = engine_config(tokenizer, args.max_new_tokens, lookahead=False)
    lookahead_config = engine_config(tokenizer, args.max_new_tokens, lookahead=True)
    engines = {"plain_cb": (plain_config, {}), "lookahead_cb": (lookahead_config, {})}
    if getattr(args, "padded_engines", False):
        padded = padded_engine_settings(model.device, getattr(args, "padded_backend", "inductor"))
        engines.update(plain_cb_padded=(plain_config, padded), lookahead_cb_padded=(lookahead_config, padded))
    ids = [item[2][0].tolist() for item in prompts]
    runs = _run_levels(args, model, ids, engines, lookahead_config, engine_config(tokenizer, 8, lookahead=True))
    return {"runs": runs, "prompt_ids": [item[0] for item in prompts]}


def _run_levels(
    args, model, ids: list[list[int]], engines: dict, lookahead_config: GenerationConfig, warm_up: GenerationConfig
) -> list[dict]:
    """
    The runs of `run_continuous_batching`: the warm-ups (`generate`'s with `warm_up`), then every level and repeat,
    the engines (name: generation config and engine settings) and `generate_one_at_a_time` (with `lookahead_config`)
    interleaved.
    """
    from tqdm.auto import tqdm

    timer = ForwardTimer(model)
    # Warm-up: the lookahead engine measures its cost table on its first request (kept by the model's state); a
    # padded engine compiles its first shapes.
    for config, settings in engines.values():
        serve = partial(_serve_closed_loop, prompts=ids[:2], concurrency=2, max_new_tokens=8)
        _in_own_thread(_serve_fresh_engine, model, config, serve, None, settings)
    _in_own_thread(_generate_closed_loop, model, ids[:1], 1, warm_up)
    rates = getattr(args, "arrival_rate", None)
    levels = [(None, rate) for rate in rates] if rates else [(concurrency, None) for concurrency in args.concurrency]
    tokens = args.max_new_tokens
    names = [*ENGINES, *(name for name in PADDED_ENGINES if name in engines)]
    runs = []
    progress = tqdm(total=len(levels) * args.repeats * len(names), desc="continuous batching")
    for concurrency, rate in levels:
        if rate is None:
            serve = partial(_serve_closed_loop, prompts=ids, concurrency=concurrency, max_new_tokens=tokens)
            one_at_a_time = partial(_generate_closed_loop, model, ids, concurrency)
        else:
            arrivals = arrival_times(len(ids), rate)
            serve = partial(_serve_open_loop, prompts=ids, arrivals=arrivals, max_new_tokens=tokens)
            one_at_a_time = partial(_generate_open_loop, model, ids, arrivals)
        for repeat in range(args.repeats):
            for name in names:
                if name == "generate_one_at_a_time":
                    timer.reset()
                    run = _in_own_thread(one_at_a_time, lookahead_config)
                else:
                    config, settings = engines[name]
                    run = _in_own_thread(_serve_fresh_engine, model, config, serve, timer, settings)
                run.update(forward_passes=timer.calls, forward_seconds=timer.seconds)
                level = {"engine": name, "concurrency": concurrency, "arrival_rate": rate, "repeat": repeat}
                runs.append({**level, **run})
                progress.update()
    progress.close()
    return runs


def _in_own_thread(function, *args):
    """
    `function(*args)`, run in a thread that ends when it returns. On a CPU, torch's OpenMP workers belong to the thread
    that ran the parallel work, and stay while it lives: after one `generate` call on the main thread, an engine's own
    thread ran SmolLM2 bf16 at 19.4 tokens/s against 34.7 without that call (one client, 2 cores); the same call on a
    thread that had ended left it at 34.6.
    """
    with ThreadPoolExecutor(max_workers=1) as executor:
        return executor.submit(function, *args).result()


def padded_engine_settings(device: torch.device, backend: str = "inductor") -> dict:
    """The engine settings of `PADDED_ENGINES` on `device`, compiled with `backend` off a GPU."""
    if device.type == "cuda":
        return {**PADDING, "use_cuda_graph": True}
    compiled = CompileConfig(backend=backend, mode=None, fullgraph=False, dynamic=False)
    return {**PADDING, "varlen_compile_config": compiled}


def _serve_fresh_engine(model, config: GenerationConfig, serve, timer=None, settings: dict | None = None) -> dict:
    """
    Starts an engine for `config` (with the engine `settings` given), serves a workload through it
    (`serve(manager)`), and stops it.
    """
    engine = ContinuousBatchingConfig(
        num_blocks=ENGINE_BLOCKS, max_batch_tokens=ENGINE_BATCH_TOKENS, **(settings or {})
    )
    manager = model.init_continuous_batching(config, engine)
    manager.start()
    try:
        if timer is not None:
            timer.reset()  # the engine's start-up is not one of its passes
        return serve(manager)
    finally:
        manager.stop(block=True, timeout=30)


def full_load_rate(run: dict) -> float | None:
    """
    Tokens per second while every client had a request in flight: from the level's start to the first answer that
    no prompt was left to replace. After it the load drains, and how long that takes depends on how unevenly the last
    requests end, not on the load the level names: plain continuous batching's answers of equal length end in one
    step, while lookahead's, which accept different numbers of tokens per step, end one by one. `None` for an open
    loop, whose load is set by its arrivals.
    """
    until = run["full_until"]
    if until is None:
        return None
    return sum(stamp <= until for times in run["token_times"] for stamp in times) / until


def _engines(result: dict) -> list[str]:
    """The engines a result's runs ran, in `ENGINES` then `PADDED_ENGINES` order."""
    ran = {run["engine"] for run in result["runs"]}
    return [engine for engine in ENGINES + PADDED_ENGINES if engine in ran]


def _level(run: dict) -> tuple:
    """A run's level: `(clients, None)` for a closed loop, `(None, requests per second)` for an open one."""
    return run["concurrency"], run.get("arrival_rate")


def _ratio(value: float | None, reference: float | None) -> float | None:
    return None if value is None or reference is None else value / reference


def summarize_continuous_batching(result: dict) -> list[dict]:
    """Per level and engine: medians over repeats of tokens/s, and percentiles over all requests of all repeats."""
    rows = []
    for concurrency, rate in sorted({_level(run) for run in result["runs"]}, key=lambda level: level[0] or level[1]):
        level = [run for run in result["runs"] if _level(run) == (concurrency, rate)]
        reference = next(run["answers"] for run in level if run["engine"] == "plain_cb")
        for engine in _engines(result):
            runs = [run for run in level if run["engine"] == engine]
            tokens = sum(len(answer) for answer in runs[0]["answers"])
            rate_of_tokens = statistics.median(sum(len(a) for a in run["answers"]) / run["seconds"] for run in runs)
            full_rates = [full_load_rate(run) for run in runs]
            full_rate = None if None in full_rates else statistics.median(full_rates)
            latency = [value for run in runs for value in run["latency"]]
            first = [value for run in runs for value in run["first_token"]]
            if engine == "plain_cb":
                plain = (rate_of_tokens, full_rate, statistics.median(latency))
            identical = sum(answer == expected for run in runs for answer, expected in zip(run["answers"], reference))
            rows.append(
                {
                    "concurrency": concurrency,
                    "arrival_rate": rate,
                    "engine": engine,
                    "tokens": tokens,
                    "tokens_per_s": rate_of_tokens,
                    "tokens_per_forward": tokens / sum(runs[0]["forwards"]),
                    "pass_ms": statistics.median(1000 * run["seconds"] / run["forward_passes"] for run in runs),
                    "forward_ms": statistics.median(
                        1000 * run["forward_seconds"] / run["forward_passes"] for run in runs
                    ),
                    "speedup_vs_plain_cb": rate_of_tokens / plain[0],
                    "full_load_tokens_per_s": full_rate,
                    "full_load_speedup_vs_plain_cb": _ratio(full_rate, plain[1]),
                    "latency_p50": statistics.median(latency),
                    "latency_p95": percentile(latency, 0.95),
                    # How many times shorter than plain continuous batching's: what an open loop's load is judged by.
                    "latency_p50_speedup_vs_plain_cb": plain[2] / statistics.median(latency),
                    "first_token_p50": statistics.median(first),
                    "first_token_p95": percentile(first, 0.95),
                    "identical": identical,
                    "answers": sum(len(run["answers"]) for run in runs),
                }
            )
    return rows
