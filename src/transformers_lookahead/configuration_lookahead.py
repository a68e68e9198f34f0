"""Lookahead decoding settings: the `GenerationConfig` fields, their defaults and their validation."""

from __future__ import annotations

import inspect
import numbers
import re
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

from .auto_tuning import AUTO_TUNING
from .compatibility import attention_implementation

if TYPE_CHECKING:
    from transformers import GenerationConfig, PreTrainedModel


CACHE_COMMIT_STRATEGIES = ("gather", "refeed")

# Attention backends that apply an arbitrary 4D mask (flex attention as a `BlockMask`). Every other backend (flash
# attention in particular) rebuilds a causal mask from the sequence layout and would silently let the lookahead
# branches see each other.
SUPPORTED_ATTENTION_IMPLEMENTATIONS = ("eager", "sdpa", "flex_attention")
SUPPORTED_CACHE_IMPLEMENTATIONS = (None, "dynamic", "static")

DEFAULT_NGRAM = 5
AUTO = "auto"
# `lookahead_window="off"` turns lookahead off for a call even where the model's generation config turns it on.
OFF = "off"
# The suffix memory (see `SuffixMemory`): tokens kept per namespace (0.4-0.75 KiB each in Python objects).
DEFAULT_MEMORY_SIZE = 65536
DEFAULT_MEMORY_NAMESPACE = "default"
# Upper bounds, checked before any compute, so that no call (or server request) can ask for a step or a memory the
# machine cannot hold: a window of 20,000 with N=5 would be a step of ~80,000 tokens and a float mask of ~25 GB.
# The paper's largest settings (W=15, N=5, G=15 on an A100) fit well inside them.
MAX_WINDOW = 64
MAX_NGRAM = 16
MAX_GUESS = 64
# About 0.75 GiB of host memory per namespace at the measured 0.4-0.75 KiB per token.
MAX_MEMORY_SIZE = 1 << 20
# The most tokens one sequence's step may feed (`LookaheadConfig.max_step_length`): a step's attention mask and
# activations grow with it, and far wider steps than this only pay on no hardware we measured.
MAX_STEP_TOKENS = 1024
# Namespaces name memory files: letters, digits, `.`, `_` and `-`, not starting with a dot.
NAMESPACE_PATTERN = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,63}")


@dataclass(frozen=True)
class LookaheadConfig:
    """
    The shape of one lookahead decoding step.

    Args:
        window (`int` or `"auto"`):
            W, the number of Jacobi window columns: how many future positions are guessed in parallel. Must be >= 1.
            (`"off"` in a `generate` call or a generation config turns lookahead off: no `LookaheadConfig` is
            built.) `"auto"` picks W from the measured cost of a forward pass on this device and lets each step choose
            whether to run the window and which candidates to verify (see `AdaptiveStepPolicy`).
        ngram (`int` or `"auto"`):
            N, the n-gram size. The window has N - 1 levels and every candidate n-gram proposes N - 1 tokens.
            Must be >= 2. `"auto"` is 5.
        guess (`int` or `"auto"`):
            G, the most candidate n-grams verified per step (also the most n-grams kept per key in the pool).
            0 disables the verification branch. Must be >= 0. Defaults to W; `"auto"` is 8.
        pool_from_prompt (`bool`):
            Whether the n-gram pool is seeded with the n-grams of the prompt and of the accepted text. Text the
            model repeats from its context (code, names, quoted passages) is then verified from the first step,
            before the Jacobi window has produced anything useful.
        cache_commit (`str`):
            How the accepted tokens' KV entries are kept: `"gather"` copies them out of the step's entries,
            `"refeed"` drops them and feeds the accepted tokens again in the next step (see `CacheCommitter`).
        memory (`bool`, *optional*):
            Whether the step also verifies continuations from the suffix memory: the prompts and outputs of earlier
            calls on the model (see `SuffixMemory`), and whether this call's sequences are added to it when it ends.
            Off by default on every route (in this process, a model folder, the Hub, servers): one model may answer
            many users, and a shared memory would let one user's text shape another's candidates and timing. Only
            with `window="auto"`, whose policy verifies only what pays; a fixed window verifies every candidate and
            cannot take the memory's variable tree (True is refused there).
        memory_size (`int`):
            The most tokens the memory of `memory_namespace` keeps (>= 1); the oldest calls' sequences are evicted
            first. Each token costs 0.4-0.75 KiB of host memory (more for less repetitive text).
        memory_namespace (`str`):
            Which memory of the model the call reads and feeds: calls of different namespaces (users, tenants) never
            see each other's text. 1 to 64 letters, digits, `.`, `_` or `-`.
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
            object.__setattr__(self, "ngram", AUTO_TUNING.ngram)
        _check_int("lookahead_ngram", self.ngram, 2, MAX_NGRAM)
        if self.guess == AUTO or (self.guess is None and self.window == AUTO):
            object.__setattr__(self, "guess", AUTO_TUNING.guess)
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
        """Whether each step's content is chosen by the adaptive policy (`lookahead_window="auto"`)."""
        return self.window == AUTO

    @property
    def levels(self) -> int:
        """Number of window levels (N - 1), which is also the length of every candidate n-gram after its key."""
        return self.ngram - 1

    def max_step_length(self, window: int | None = None) -> int:
        """
        The most tokens one sequence's step can feed.

        Args:
            window (`int`, *optional*): the window width in use; by default `window`, or the widest `"auto"` picks.
        """
        window = window if window is not None else (AUTO_TUNING.max_window if self.adaptive else self.window)
        context = AUTO_TUNING.context_depth if self.adaptive else 0
        memory = AUTO_TUNING.memory_nodes if self.memory else 0
        deepest = max(context, AUTO_TUNING.memory_depth if memory else 0)
        pending = 1 if self.cache_commit == "gather" else self.levels + 1 + deepest
        return pending + window * self.levels + self.guess * self.levels + context + memory

    @classmethod
    def from_sources(cls, *sources: Any, default_window: int | str | None = None) -> LookaheadConfig | None:
        """
        Builds the configuration from the first source that sets each field.

        Args:
            sources:
                Mappings (`generate` keyword arguments) or objects with attributes (`GenerationConfig`), highest
                priority first. `None` values count as unset.
            default_window (`int` or `"auto"`, *optional*):
                The window when no source sets `lookahead_window` (what a `custom_generate` entry point uses).

        Returns:
            `LookaheadConfig` or `None`: `None` when lookahead is off: `lookahead_window` is unset (and there is no
            default), or set to `"off"` by the highest-priority source that sets it (what turns a saved setting off
            for one call or one request).
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


# The fields lookahead decoding reads from `GenerationConfig` (or from `generate(**kwargs)`): `LookaheadConfig`'s,
# prefixed.
LOOKAHEAD_FIELDS = tuple(f"lookahead_{field.name}" for field in fields(LookaheadConfig))


def first_set(name: str, *sources: Any) -> Any:
    """
    The value of `name` in the first of `sources` that sets it (`generate` keyword arguments as a mapping, generation
    configs as objects, highest priority first; `None` counts as unset and is skipped, as is a `None` source), or
    `None`.
    """
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
    """
    Refuses a `cache_implementation` whose cache cannot be rolled back after a step.

    Raises:
        `ValueError` naming the setting and the supported values.
    """
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
    """
    Refuses attention backends that cannot apply a lookahead step's mask on the model's device.

    Raises:
        `ValueError` naming the backend and the ones to use instead.
    """
    attn = attention_implementation(model)
    if attn not in SUPPORTED_ATTENTION_IMPLEMENTATIONS:
        raise ValueError(
            f"Lookahead decoding needs an attention backend that applies custom 4D masks, but the model uses "
            f"attn_implementation={attn!r}. Load or switch the model to one of {SUPPORTED_ATTENTION_IMPLEMENTATIONS}, "
            "e.g. `model.set_attn_implementation('sdpa')`."
        )
    if attn == "flex_attention" and model.device.type == "cpu":
        # Found with PyTorch 2.13: after a few lookahead steps (queries of 17-33 tokens over the cache), the next
        # prefill's flex kernel fails to compile for the CPU (`CppCompileError`), plain decoding included.
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
    """
    Refuses, before any forward pass, the settings lookahead decoding cannot honour exactly.

    Args:
        model (`PreTrainedModel`): the model `generate` was called on.
        generation_config (`GenerationConfig`): the fully resolved generation config of the call.
        model_kwargs (`dict`): the model keyword arguments `generate` prepared (cache, attention mask, ...).
        assistant_model (`PreTrainedModel`, *optional*): the assistant passed to `generate`, if any.

    Raises:
        `ValueError` naming the conflicting setting and what to use instead.
    """
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
        raise ValueError("Lookahead decoding needs `input_ids`; got `inputs_embeds`. Pass token ids instead.")
