"""
Test helpers: the tiny models of `utils/tiny_models.py`, a small-vocabulary model, pools, cost tables and reading a
server's stream.
"""

from __future__ import annotations

import logging
import threading
import time
import traceback
from contextlib import contextmanager
from unittest import mock

import torch
import transformers

from transformers_lookahead import LookaheadState, enable_lookahead
from transformers_lookahead.auto_tuning import AUTO_TUNING, AutoTuning
from transformers_lookahead.cost_model import StepCostModel
from transformers_lookahead.ngram_pool import NGramPool
from transformers_lookahead.token_tree import TokenTree
from utils.tiny_models import EAGER_ONLY, INIT_RANGE, TINY_CONFIGS, VOCAB, left_padded, random_prompt, tiny_model

__all__ = ["EAGER_ONLY", "INIT_RANGE", "TINY_CONFIGS", "VOCAB", "left_padded", "random_prompt", "tiny_model"]

SMALL_VOCABULARY = 12


def small_vocabulary_model(key_value_heads: int = 1):
    """
    A one-layer random Llama over 12 tokens: small enough to compare sampled distributions token by token. With
    `key_value_heads=2` its 2 heads and 2 KV heads split over 2 tensor-parallel ranks.
    """
    config = transformers.LlamaConfig(
        vocab_size=SMALL_VOCABULARY,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=key_value_heads,
        initializer_range=INIT_RANGE,
        pad_token_id=0,
        eos_token_id=None,
        bos_token_id=None,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def pool_tree(key: int, continuations: list[list[int]], depth: int) -> TokenTree:
    """The token tree a pool holding `continuations` of `key` offers, cut at `depth`."""
    pool = NGramPool(continuation_length=depth, max_per_key=max(len(continuations), 1))
    for continuation in continuations:
        pool.add(key, continuation)
    return pool.tree(key, depth)


def flat_state(
    engine_fit: bool = False, memory_dir: str | None = None, step_observer=None, tuning: AutoTuning = AUTO_TUNING
) -> LookaheadState:
    """
    A state (`enable_lookahead(model, flat_state())`) whose `"auto"` plans with a flat cost table (every step length
    costs one token, as on an accelerator) instead of this machine's measured one, and learns nothing from step
    durations, so that its steps do not depend on the timings of a shared CPU. Cost tables stay in memory.

    Args:
        engine_fit (`bool`): whether a continuous-batching engine still prices its steps by the ones it timed
            (`EngineStepCost`) once it has timed enough of them (and `generate` learns from step durations). Off,
            it keeps to the flat table: on a tiny model the host's work outweighs the forward pass, and on a starved
            CPU the fit then priced every step of several tokens out.
        memory_dir (`str`, *optional*): where the suffix memory is kept (in memory only by default).
        step_observer (`Callable`, *optional*): called after every sequence's step (see `LookaheadState`).
        tuning (`AutoTuning`, *optional*): the constants `"auto"` decides with.
    """
    return LookaheadState(
        cost_dir=None,
        memory_dir=memory_dir,
        step_costs=StepCostModel({1: 1.0, 64: 1.0}),
        follow_durations=engine_fit,
        tuning=tuning,
        step_observer=step_observer,
    )


def stream_chat(client, model: str, prompt: str, max_tokens: int, body: dict | None = None) -> tuple[str, list[float]]:
    """One greedy chat turn streamed from an OpenAI-compatible server (`client`, the `openai` client): `read_stream`."""
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        extra_body=body,
    )
    return read_stream(stream)


def stream_chats_at_once(
    client, model: str, bodies: dict[str, dict | None], max_tokens: int, timeout: float = 600
) -> tuple[dict[str, tuple[str, list[float]]], list[tuple[str, str]]]:
    """
    `stream_chat` for every prompt of `bodies` (with its request body), all sent at once from threads of their own.

    Returns:
        `tuple`: each prompt's text and chunk arrivals, and the errors raised, as `(prompt, repr(error))`.
    """
    results, errors = {}, []

    def ask(prompt: str) -> None:
        try:
            results[prompt] = stream_chat(client, model, prompt, max_tokens, bodies[prompt])
        except Exception as error:  # returned with the prompt
            errors.append((prompt, repr(error)))

    clients = [threading.Thread(target=ask, args=(prompt,)) for prompt in bodies]
    for thread in clients:
        thread.start()
    for thread in clients:
        thread.join(timeout=timeout)
    return results, errors


def read_stream(stream) -> tuple[str, list[float]]:
    """The text of a streamed `openai` chat completion, and when each chunk with text arrived (`perf_counter`)."""
    parts, arrivals = [], []
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            parts.append(chunk.choices[0].delta.content)
            arrivals.append(time.perf_counter())
    return "".join(parts), arrivals


def stream_writes(arrivals: list[float], gap: float = 0.005) -> int:
    """
    How many writes a server made to a stream: chunks arriving less than `gap` seconds after the previous one belong
    to the same write. A decoding step's tokens are one write whether the server sends them as one event (Transformers
    5.25) or as one event per token (5.24); a forward pass on the CPU takes tens of milliseconds.
    """
    return sum(1 for index, arrival in enumerate(arrivals) if index == 0 or arrival - arrivals[index - 1] >= gap)


@contextmanager
def decoding_loop_default_device(device: str):
    """
    Runs lookahead's decoding loop with torch's default device set to `device` (use `"meta"`), while the model's own
    code and the caches Transformers builds keep the CPU.

    On an accelerator the default device (the CPU) is not the model's, so a tensor the loop makes without saying
    where it goes lands off the model's device. On a CPU-only machine everything is on the CPU and such a tensor
    goes unnoticed; a meta tensor mixes with no real tensor, so here it fails as it would on a GPU.
    """
    import transformers_lookahead.generation_mixin as mixin

    decoding, module_call = mixin.generate, torch.nn.Module.__call__

    def decoding_on_device(*args, **kwargs):
        with torch.device(device):
            return decoding(*args, **kwargs)

    def on_cpu(function):
        def wrapped(*args, **kwargs):
            with torch.device("cpu"):
                return function(*args, **kwargs)

        return wrapped

    with (
        mock.patch.object(mixin, "generate", decoding_on_device),
        mock.patch.object(torch.nn.Module, "__call__", on_cpu(module_call)),
        mock.patch.object(transformers.DynamicCache, "__init__", on_cpu(transformers.DynamicCache.__init__)),
        mock.patch.object(transformers.StaticCache, "__init__", on_cpu(transformers.StaticCache.__init__)),
    ):
        yield


# Tensor methods that hand a tensor's values to Python (on an accelerator each waits for the device and copies), and
# functions whose output size depends on values (on an accelerator they wait for the device too).
HOST_READS = {
    torch.Tensor.tolist,
    torch.Tensor.item,
    torch.Tensor.numpy,
    torch.Tensor.__bool__,
    torch.Tensor.__int__,
    torch.Tensor.__float__,
    torch.Tensor.__index__,
    torch.Tensor.nonzero,
    torch.Tensor.unique,
    torch.Tensor.masked_select,
    torch.nonzero,
    torch.unique,
    torch.masked_select,
    torch.equal,
}
# Factories that read a tensor argument as a Python number.
NUMBER_ARGUMENTS = {torch.arange, torch.full, torch.zeros, torch.ones, torch.empty, torch.tensor}


class ForwardCounter:
    """Counts a model's forward passes (a forward hook); `with counter:` starts the count again."""

    def __init__(self, model):
        self.count = 0
        self.handle = model.register_forward_hook(self._count)

    def _count(self, *_):
        self.count += 1

    def __enter__(self):
        self.count = 0
        return self

    def __exit__(self, *_):
        return False


class HostReadCounter(torch.overrides.TorchFunctionMode):
    """
    Counts the reads of tensor values into Python made outside `model`'s forward passes, between passes:
    `segments[i]` lists the reads after pass `i` (segment 0: before the first pass), each as the name of the call
    and the place in the package's code that made it.

    On the CPU nothing is transferred, but every such read is where an accelerator would wait for the device and
    copy to the host; the counter sees them on any device.
    """

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.segments: list[list[str]] = [[]]
        self._inside = 0
        self._hooks = (
            model.register_forward_pre_hook(lambda *_: self._enter()),
            model.register_forward_hook(lambda *_: self._leave()),
        )

    def _enter(self) -> None:
        self._inside += 1

    def _leave(self) -> None:
        self._inside -= 1
        if not self._inside:
            self.segments.append([])

    def __exit__(self, *exc):
        for hook in self._hooks:
            hook.remove()
        return super().__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        reads = func in HOST_READS or (
            func in NUMBER_ARGUMENTS and any(isinstance(value, torch.Tensor) for value in (*args, *kwargs.values()))
        )
        if reads and not self._inside:
            caller = next(
                (
                    f"{frame.filename.rsplit('/', 1)[-1]}:{frame.lineno}"
                    for frame in reversed(traceback.extract_stack())
                    if "transformers_lookahead" in frame.filename
                ),
                "outside the package",
            )
            self.segments[-1].append(f"{getattr(func, '__name__', func)} at {caller}")
        return func(*args, **kwargs)


class MeasurementCounter(logging.Handler):
    """Counts the cost-table measurements a block makes, by the warning each one logs (see `cost_measurement`)."""

    LOGGER = "transformers_lookahead.cost_measurement"

    def __init__(self):
        super().__init__(logging.WARNING)
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        self.count += "measuring the cost of forward passes" in record.getMessage()

    def __enter__(self) -> MeasurementCounter:
        logging.getLogger(self.LOGGER).addHandler(self)
        return self

    def __exit__(self, *exc_info) -> None:
        logging.getLogger(self.LOGGER).removeHandler(self)


def checked(model):
    """
    `model` with lookahead enabled and already checked (`StepCheck`), as after its first lookahead call: a test that
    counts a call's forward passes or times its steps then sees that call's own passes only.
    """
    model = enable_lookahead(model) if getattr(model, "lookahead_state", None) is None else model
    if not model.config.is_encoder_decoder:  # encoder-decoder models are not checked
        model.lookahead_state.step_check.check(model)
    return model
