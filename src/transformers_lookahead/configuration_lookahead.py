"""Lookahead decoding settings: the `GenerationConfig` fields, their defaults and their validation."""

from __future__ import annotations

import inspect
import numbers
import re
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

from .compatibility import attention_implementation

if TYPE_CHECKING:
    from transformers import GenerationConfig, PreTrainedModel


CACHE_COMMIT_STRATEGIES = ("gather", "refeed")

# Backends that apply an arbitrary 4D mask; the others (flash attention) rebuild a causal one, letting branches see
# each other.
SUPPORTED_ATTENTION_IMPLEMENTATIONS = ("eager", "sdpa", "flex_attention")
SUPPORTED_CACHE_IMPLEMENTATIONS = (None, "dynamic", "static")

DEFAULT_NGRAM = 5
AUTO = "auto"
# `lookahead_window="off"` turns lookahead off for a call even where the model's generation config turns it on.
OFF = "off"
# The suffix memory's tokens per namespace (0.4-0.75 KiB each).
DEFAULT_MEMORY_SIZE = 65536
DEFAULT_MEMORY_NAMESPACE = "default"
# Bounds checked before any compute, so no request asks for a step or memory the machine cannot hold (W=20,000, N=5
# would be a mask of ~25 GB); the paper's largest settings (W=15, N=5, G=15) fit well inside.
MAX_WINDOW = 64
MAX_NGRAM = 16
MAX_GUESS = 64
MAX_MEMORY_SIZE = 1 << 20
# The most tokens one sequence's step may feed: its mask and activations grow with it.
MAX_STEP_TOKENS = 1024
# What `"auto"` resolves to, and the bounds of its steps (`auto_tuning.AutoTuning` reads them): N and G, the widest
# window it runs, the longest continuation copied from the context, and the suffix memory's deepest continuation and
# most nodes per step.
AUTO_NGRAM = 5
AUTO_GUESS = 8
AUTO_MAX_WINDOW = 16
AUTO_CONTEXT_DEPTH = 8
MEMORY_DEPTH = 16
MEMORY_NODES = 32
# Namespaces name memory files: letters, digits, `.`, `_` and `-`, not starting with a dot.
NAMESPACE_PATTERN = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,63}")


@dataclass(frozen=True)
class LookaheadConfig:
    """
    The shape of one lookahead decoding step; the `lookahead_*` fields of `GenerationConfig` without the prefix.

    Args:
        window (`int` or `"auto"`): W >= 1, the Jacobi window's columns. `"auto"` picks W from the measured cost of a
            pass on this device and lets each step choose its window and candidates. (`"off"` in a call or a
            generation config turns lookahead off: no `LookaheadConfig` is built.)
        ngram (`int` or `"auto"`): N >= 2: the window's N - 1 levels and the candidates' length. `"auto"` is 5.
        guess (`int` or `"auto"`): G >= 0, the most candidates verified per step and kept per pool key (0: none).
            Defaults to W; `"auto"` is 8.
        pool_from_prompt (`bool`): seed the pool with the n-grams of the prompt and the accepted text, so text the
            model repeats from its context is verified from the first step.
        cache_commit (`str`): `"gather"` copies the accepted entries out of the step's; `"refeed"` feeds the accepted
            tokens again (`CacheCommitter`).
        memory (`bool`): also verify continuations from the suffix memory of earlier calls, and add this call's
            sequences to it. Off on every route (one model may answer many users); `"auto"` only.
        memory_size (`int`): the most tokens the namespace's memory keeps (0.4-0.75 KiB each); oldest evicted first.
        memory_namespace (`str`): which memory the call reads and feeds (1 to 64 letters, digits, `.`, `_`, `-`).
    """

    window: int | str
    ngram: int | str = DEFAULT_NGRAM
    guess: int | str | None = None
    pool_from_prompt: bool = True
    cache_commit: str = "gather"
    memory: bool = False
    memory_size: int = DEFAULT_MEMORY_SIZE
    memory_namespace: str = DEFAULT_MEMORY_NAMESPACE

    def __post_init__(self):
        if self.window != AUTO:
            _check_int("lookahead_window", self.window, 1, MAX_WINDOW, also=f'"{AUTO}", or "{OFF}" to turn it off')
        if self.ngram == AUTO:
            object.__setattr__(self, "ngram", AUTO_NGRAM)
        _check_int("lookahead_ngram", self.ngram, 2, MAX_NGRAM)
        if self.guess == AUTO or (self.guess is None and self.window == AUTO):
            object.__setattr__(self, "guess", AUTO_GUESS)
        elif self.guess is None:
            object.__setattr__(self, "guess", self.window)
        _check_int("lookahead_guess", self.guess, 0, MAX_GUESS)
        if not isinstance(self.pool_from_prompt, bool):
            raise ValueError(
                f"`lookahead_pool_from_prompt` must be a bool (True or False), got {self.pool_from_prompt!r}."
            )
        if self.cache_commit not in CACHE_COMMIT_STRATEGIES:
            raise ValueError(
                f"`lookahead_cache_commit` must be one of {CACHE_COMMIT_STRATEGIES}, got {self.cache_commit!r}."
            )
        if not isinstance(self.memory, bool):
            raise ValueError(f"`lookahead_memory` must be a bool (True or False), got {self.memory!r}.")
        if self.memory and self.window != AUTO:
            raise ValueError(
                f'`lookahead_memory=True` needs `lookahead_window="{AUTO}"`: a fixed window verifies every candidate '
                f"in a step of fixed shape, and the memory proposes a tree of any size; got lookahead_window="
                f'{self.window!r}. Use "{AUTO}" or set `lookahead_memory=False`.'
            )
        _check_int("lookahead_memory_size", self.memory_size, 1, MAX_MEMORY_SIZE, also=None)
        if not isinstance(self.memory_namespace, str) or not NAMESPACE_PATTERN.fullmatch(self.memory_namespace):
            raise ValueError(
                "`lookahead_memory_namespace` must be a string of 1 to 64 letters, digits, '.', '_' or '-', not "
                f"starting with '.', got {self.memory_namespace!r}."
            )
        step = self.max_step_length()
        if step > MAX_STEP_TOKENS:
            raise ValueError(
                f"lookahead_window={self.window!r}, lookahead_ngram={self.ngram} and lookahead_guess={self.guess} "
                f"make a step of up to {step} tokens per sequence (1 + (W + G) x (N - 1), plus the pending tokens); "
                f"at most {MAX_STEP_TOKENS} are allowed, since a step's mask and activations grow with it. Lower "
                "`lookahead_window`, `lookahead_guess` or `lookahead_ngram`."
            )

    @property
    def adaptive(self) -> bool:
        """Whether each step is chosen by the adaptive policy (`"auto"`)."""
        return self.window == AUTO

    @property
    def levels(self) -> int:
        """N - 1: the window's levels and each candidate's length after its key."""
        return self.ngram - 1

    def max_step_length(self, window: int | None = None) -> int:
        """The most tokens one sequence's step can feed with `window` (default: the config's, or `"auto"`'s widest)."""
        window = window if window is not None else (AUTO_MAX_WINDOW if self.adaptive else self.window)
        context = AUTO_CONTEXT_DEPTH if self.adaptive else 0
        memory = MEMORY_NODES if self.memory else 0
        deepest = max(context, MEMORY_DEPTH if memory else 0)
        pending = 1 if self.cache_commit == "gather" else self.levels + 1 + deepest
        return pending + window * self.levels + self.guess * self.levels + context + memory

    @classmethod
    def from_sources(cls, *sources: Any, default_window: int | str | None = None) -> LookaheadConfig | None:
        """
        The configuration from the first of `sources` (mappings or `GenerationConfig`s, highest priority first;
        `None` is unset) that sets each field, with `default_window` where none sets the window. `None` when
        lookahead is off: no window, or `"off"` from the highest-priority source that sets one.
        """
        values = {field: first_set(field, *sources) for field in LOOKAHEAD_FIELDS}
        values = {field: value for field, value in values.items() if value is not None}
        window = values.get("lookahead_window", default_window)
        if isinstance(window, str) and window == OFF:
            return None
        if window is None:
            unused = sorted(values)
            if unused:
                raise ValueError(
                    f"{', '.join(f'`{name}`' for name in unused)} set without `lookahead_window`: set "
                    '`lookahead_window` (an int >= 1, or "auto") to turn lookahead decoding on.'
                )
            return None
        values["lookahead_window"] = window
        return cls(**{field.removeprefix("lookahead_"): value for field, value in values.items()})


# The fields read from `GenerationConfig` and `generate(**kwargs)`.
LOOKAHEAD_FIELDS = tuple(f"lookahead_{field.name}" for field in fields(LookaheadConfig))


def first_set(name: str, *sources: Any) -> Any:
    """`name` in the first of `sources` (mappings or objects, highest priority first) that sets it to non-`None`."""
    for source in sources:
        value = source.get(name) if isinstance(source, Mapping) else getattr(source, name, None)
        if value is not None:
            return value
    return None


def _check_int(name: str, value: Any, minimum: int, maximum: int, also: str | None = f'"{AUTO}"') -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not minimum <= value <= maximum:
        alternative = f", or {also}" if also else ""
        raise ValueError(f"`{name}` must be an integer >= {minimum} and <= {maximum}{alternative}, got {value!r}.")


def check_cache_implementation(cache_implementation: str | None) -> None:
    """Refuses a `cache_implementation` whose cache cannot be rolled back after a step."""
    if cache_implementation in SUPPORTED_CACHE_IMPLEMENTATIONS:
        return
    if "offloaded" in str(cache_implementation):
        reason = "offloaded caches move layers between devices inside the forward pass, where a step's rollback "
        reason += "cannot reach them"
    elif cache_implementation == "quantized":
        reason = "quantized caches re-quantize what they hold, so dropping a step's entries is not exact"
    else:
        reason = "it is not a cache lookahead decoding knows how to roll back"
    supported = tuple(name for name in SUPPORTED_CACHE_IMPLEMENTATIONS if name)
    raise ValueError(
        f"Lookahead decoding rolls the cache back after every step; cache_implementation={cache_implementation!r} "
        f"cannot be used: {reason}. Use one of {supported} or leave it unset."
    )


def check_attention_implementation(model: PreTrainedModel) -> None:
    """Refuses attention backends that cannot apply a step's mask on the model's device."""
    attn = attention_implementation(model)
    if attn not in SUPPORTED_ATTENTION_IMPLEMENTATIONS:
        raise ValueError(
            f"Lookahead decoding needs an attention backend that applies custom 4D masks, but the model uses "
            f"attn_implementation={attn!r}. Load or switch the model to one of {SUPPORTED_ATTENTION_IMPLEMENTATIONS}, "
            "e.g. `model.set_attn_implementation('sdpa')`."
        )
    if attn == "flex_attention" and model.device.type == "cpu":
        raise ValueError(
            "Lookahead decoding with attn_implementation='flex_attention' is not available on the CPU: PyTorch's "
            "CPU flex attention kernels fail to compile for the mix of step shapes lookahead produces. Use 'sdpa' "
            "or 'eager' on the CPU (`model.set_attn_implementation('sdpa')`), or run the model on a GPU."
        )


def validate_lookahead_setup(
    model: PreTrainedModel,
    generation_config: GenerationConfig,
    model_kwargs: dict[str, Any],
    assistant_model: PreTrainedModel | None = None,
) -> None:
    """Refuses, before any forward pass, what lookahead cannot honour exactly, naming the setting and the way out."""
    if model.config.is_encoder_decoder and "decoder_position_ids" not in inspect.signature(model.forward).parameters:
        raise ValueError(
            f"{type(model).__name__} is an encoder-decoder model whose decoder takes no `decoder_position_ids`. "
            "A lookahead step places its guesses at chosen positions, and this decoder (like BART's and T5's) "
            "derives positions from the cache length. Lookahead decoding supports decoder-only models and "
            "encoder-decoder models whose decoders take position ids (Whisper); remove the `lookahead_*` settings "
            "to use the usual decoding."
        )
    check_attention_implementation(model)
    device_map = getattr(model, "hf_device_map", None) or {}
    if len({str(device) for device in device_map.values()}) > 1:
        raise ValueError(
            f"Lookahead decoding does not support a model split over devices by `device_map` (this one spans "
            f"{sorted({str(device) for device in device_map.values()})}): the layers run one after another, each "
            "step's mask and positions would cross devices inside the forward pass, and this split was never tested. "
            'Shard the model with tensor parallelism instead (`from_pretrained(path, tp_plan="auto")` under '
            "`torchrun`), or load it on one device."
        )
    if generation_config.guidance_scale is not None and generation_config.guidance_scale != 1:
        raise ValueError(
            f"Lookahead decoding cannot be combined with `guidance_scale` (got {generation_config.guidance_scale}): "
            "classifier-free guidance runs a second, unconditional forward pass with a cache of its own for every "
            "token, one row and one token at a time, which a step that verifies several positions of several rows "
            "cannot feed. Unset `guidance_scale` (or set it to 1), or remove the `lookahead_*` settings."
        )
    conflicts = {
        "num_beams": (generation_config.num_beams or 1) > 1,
        "prompt_lookup_num_tokens": generation_config.prompt_lookup_num_tokens is not None,
        "assistant_model": assistant_model is not None,
    }
    for name, conflicting in conflicts.items():
        if conflicting:
            hint = ""
            if name == "num_beams":
                hint = (
                    ' (the "automatic-speech-recognition" pipeline asks for 5 beams unless told otherwise: pass '
                    '`generate_kwargs={"num_beams": 1}`)'
                )
            raise ValueError(
                f"Lookahead decoding cannot be combined with `{name}`: both decide how tokens are proposed. "
                f"Use either lookahead (`lookahead_window`) or `{name}`, not both{hint}."
            )
    if not generation_config.use_cache:
        raise ValueError(
            "Lookahead decoding keeps the accepted tokens in the KV cache and needs `use_cache=True`; "
            "got `use_cache=False`."
        )
    if model_kwargs.get("cache") is None:
        raise ValueError(
            f"`{type(model).__name__}` keeps its decoding state outside Transformers' `Cache` classes (`generate` "
            "prepares no cache for it), so a lookahead step could not roll back the tokens it does not keep. "
            "Lookahead decoding is not available for this architecture yet: remove the `lookahead_*` settings to "
            "decode as usual."
        )
    check_cache_implementation(generation_config.cache_implementation)
    if generation_config.output_attentions or generation_config.output_hidden_states:
        raise ValueError(
            "Lookahead decoding cannot return `output_attentions` / `output_hidden_states`: one forward pass holds "
            "several speculative branches, so per-token attentions are not those of plain decoding. "
            "Set both to False."
        )
    if model_kwargs.get("inputs_embeds") is not None:
        raise ValueError(
            "Lookahead decoding needs the prompt as `input_ids`: its steps feed token ids (pending tokens, the "
            "window's guesses, candidates) and verify them against the text; got `inputs_embeds`. Pass the token ids "
            "instead, or remove the `lookahead_*` settings to generate from embeddings."
        )
