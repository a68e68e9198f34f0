"""
How a model's `generate` reaches the lookahead loop: `enable_lookahead` and `LookaheadGenerationMixin`, and
`generate`, the loop as a `custom_generate` callable, which decides what the loop is built with (`lookahead_decoder`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch
from transformers import GenerationConfig, LogitsProcessorList, PreTrainedModel, StoppingCriteriaList
from transformers.generation.stopping_criteria import StopStringCriteria

from .adaptive_planner import AdaptivePlanner
from .chain_steps import ChainCommitter, ChainLayout, committer_for
from .compatibility import is_from_model_config, mark_as_user_config
from .configuration_lookahead import (
    LOOKAHEAD_FIELDS,
    LookaheadConfig,
    check_cache_implementation,
    first_set,
    validate_lookahead_setup,
)
from .lookahead_decoding import LookaheadDecoder, LookaheadDecoderOnlyOutput, LookaheadEncoderDecoderOutput
from .lookahead_state import LookaheadState
from .rank_sync import RankSync
from .sequence_lookahead import StepPlanner
from .step_forward import StepForward, select_rows
from .step_layout import StepLayout

if TYPE_CHECKING:
    from transformers.generation.streamers import BaseStreamer

# Used when lookahead is requested through `custom_generate` without any `lookahead_window`.
DEFAULT_WINDOW = "auto"


class LookaheadGenerationMixin:
    """
    Adds lookahead decoding to the `generate` of a model class: `class MyModel(LookaheadGenerationMixin,
    LlamaForCausalLM)`, as `GenerationMixin` adds `generate` to Transformers' models.

    With `lookahead_window` set (as a `generate` argument, in the `generation_config` passed to it, or in the model's
    own `generation_config`), `generate` prepares its inputs as usual and then decodes with
    `transformers_lookahead.generate`, and continuous batching (`init_continuous_batching`, `generate_batch`) runs
    lookahead steps (see `continuous_batching.py`). Without it, both are untouched. `save_pretrained` keeps the
    `lookahead_*` fields of the model's generation config.

    For a model that is already loaded, `enable_lookahead(model)` gives its `generate` the same behaviour.
    """

    lookahead_state: LookaheadState

    def generate(
        self, inputs: torch.Tensor | None = None, generation_config: GenerationConfig | None = None, **kwargs: Any
    ):
        return generate_with_lookahead(self, inputs, generation_config, **kwargs)

    def init_continuous_batching(self, generation_config: GenerationConfig | None = None, *args: Any, **kwargs: Any):
        from .continuous_batching import init_continuous_batching_with_lookahead

        return init_continuous_batching_with_lookahead(self, generation_config, *args, **kwargs)

    def save_pretrained(self, *args: Any, **kwargs: Any):
        # `GenerationConfig.from_pretrained` drops custom fields from configs flagged as derived from the model
        # config (what a model built from a config carries); once lookahead fields are set the config is the user's.
        config = self.generation_config
        if is_from_model_config(config) and any(
            getattr(config, field, None) is not None for field in LOOKAHEAD_FIELDS
        ):
            mark_as_user_config(config)
        return super().save_pretrained(*args, **kwargs)


def generate_with_lookahead(
    model: PreTrainedModel,
    inputs: torch.Tensor | None = None,
    generation_config: GenerationConfig | None = None,
    defaults: Mapping[str, Any] | None = None,
    **kwargs: Any,
):
    """
    The model's `generate`, decoding with lookahead when a `lookahead_window` is set.

    Args:
        model (`PreTrainedModel`): a decoder-only model, or an encoder-decoder model whose decoder takes position ids.
        inputs (`torch.Tensor`, *optional*): as for `generate`.
        generation_config (`GenerationConfig`, *optional*): as for `generate`; may hold `lookahead_*` fields.
        defaults (`Mapping`, *optional*): `lookahead_*` values for the fields neither the call nor a generation config
            sets (the Hub entry point's `HUB_DEFAULTS`). Without a `lookahead_window` there, calls that set none are
            left to plain `generate`; a `lookahead_window="off"` always is.
        kwargs: the other `generate` arguments, `lookahead_*` ones included.
    """
    overrides = {field: kwargs.pop(field) for field in LOOKAHEAD_FIELDS if field in kwargs}
    config = LookaheadConfig.from_sources(
        overrides,
        generation_config or {},
        getattr(model, "generation_config", None) or {},
        defaults or {},
    )
    # Inputs travel positionally only when given: pipelines pass them by the model's own name (`input_features`).
    inputs_argument = () if inputs is None else (inputs,)
    if config is None:
        return _class_generate(model)(*inputs_argument, generation_config=generation_config, **kwargs)
    if kwargs.get("custom_generate") is not None:
        raise ValueError(
            "Lookahead decoding cannot be combined with `custom_generate`: both replace the decoding loop. "
            "Remove `custom_generate`, or the `lookahead_*` settings."
        )
    # The call's settings as `generate` resolves them: its own arguments, its generation config, the model's.
    sources = (kwargs, generation_config, getattr(model, "generation_config", None))
    # `generate` builds the cache before handing over, and fails on some caches (e.g. quantized ones without their
    # backend installed) with errors unrelated to lookahead: check the setting first.
    check_cache_implementation(first_set("cache_implementation", *sources))
    # A `use_cache=False` that came from the model's own config (MPT's default), not from the user, is turned on, as
    # `generate` would for a user who asked for the cache: lookahead keeps its accepted tokens there.
    model_config = getattr(model, "generation_config", None)
    if first_set("use_cache", kwargs, generation_config) is None and is_from_model_config(model_config):
        if model_config.use_cache is False:
            kwargs["use_cache"] = True
    _reserve_static_cache_room(model, inputs, sources, kwargs, config.max_step_length())
    _bind_stop_strings(first_set("stop_strings", *sources), kwargs)
    # `generate` hands a `custom_generate` callable only the arguments its own decoding loops do not take, so the
    # streamer and the assistant travel bound to the callable.
    decoding = functools.partial(
        generate,
        lookahead_config=config,
        lookahead_state=getattr(model, "lookahead_state", None),
        lookahead_streamer=kwargs.pop("streamer", None),
        lookahead_assistant_model=kwargs.pop("assistant_model", None),
    )
    return _class_generate(model)(
        *inputs_argument, generation_config=generation_config, custom_generate=decoding, **kwargs
    )


def _class_generate(model: PreTrainedModel) -> Callable[..., Any]:
    """
    The `generate` of the model's own class, bound to it: Whisper's, for instance, prepares its prompt tokens and
    logits processors before calling `GenerationMixin.generate`, which then hands over to the lookahead loop.

    Read from the class, not the object: a model loaded with `trust_remote_code=True` from a folder with a
    `custom_generate/` has its `generate` replaced on the object by that folder's function, which calls this.
    """
    cls = type(model)
    if issubclass(cls, LookaheadGenerationMixin):
        return super(LookaheadGenerationMixin, model).generate
    return cls.generate.__get__(model, cls)


def _reserve_static_cache_room(
    model: PreTrainedModel, inputs: torch.Tensor | None, sources: tuple, kwargs: dict, room: int
) -> None:
    """
    Asks a static cache that `generate` builds for `room` more entries than plain decoding needs (`max_length - 1`):
    a lookahead step writes a whole step past the accepted tokens before rolling back. `max_cache_len` is a floor
    `generate` honours. Where the decoder's prompt length is not known before `generate` (encoder-decoder models),
    nothing is asked, and steps near the end of the cache are shrunk to what fits.

    Args:
        sources (`tuple`): the call's keyword arguments and generation configs, highest priority first.
    """
    if first_set("cache_implementation", *sources) != "static" or model.config.is_encoder_decoder:
        return
    max_new_tokens = first_set("max_new_tokens", *sources)
    if max_new_tokens is not None:
        input_ids = inputs if inputs is not None else kwargs.get("input_ids")
        if input_ids is None or input_ids.dim() != 2:
            return
        max_length = input_ids.shape[-1] + max_new_tokens
    else:
        max_length = first_set("max_length", *sources) or GenerationConfig().max_length
    kwargs["max_cache_len"] = max(first_set("max_cache_len", *sources) or 0, max_length - 1 + room)


def _bind_stop_strings(stop_strings: str | list[str] | None, kwargs: dict) -> None:
    """
    Turns the call's `stop_strings` + `tokenizer` into a `StopStringCriteria` in `kwargs["stopping_criteria"]`.

    `generate` drops the `tokenizer` argument before building the stopping criteria of a `custom_generate`
    callable, and then refuses stop strings for lack of a tokenizer; the criterion built here is the one it would
    have built.
    """
    tokenizer = kwargs.pop("tokenizer", None)
    if not stop_strings or tokenizer is None:
        if tokenizer is not None:
            kwargs["tokenizer"] = tokenizer
        return
    criteria = StoppingCriteriaList(kwargs.get("stopping_criteria") or [])
    criteria.append(StopStringCriteria(stop_strings=stop_strings, tokenizer=tokenizer))
    kwargs["stopping_criteria"] = criteria
    kwargs["stop_strings"] = None


def enable_lookahead(model: PreTrainedModel, state: LookaheadState | None = None) -> PreTrainedModel:
    """
    Gives a loaded model lookahead decoding: its `generate` decodes with lookahead whenever a `lookahead_window` is
    set (in the call, the call's generation config or the model's), as `LookaheadGenerationMixin` does for a class.
    It is bound the way Transformers binds the `generate` of a model folder's `custom_generate/`
    (`model.generate = functools.partial(...)`): the model's class, and what `save_pretrained` writes, stay as they
    were. Its `init_continuous_batching` (which `generate_batch` calls) is bound the same way, so that continuous
    batching runs lookahead steps too. The model also gets a `lookahead_state` where `"auto"` keeps what it learns
    across calls. Nothing runs the model here: its first lookahead call checks that it computes lookahead steps as
    plain decoding does (`StepCheck`: a few short passes, remembered in the state) and refuses it if not.

    Calling it again keeps the model's state unless `state` is given.

    Args:
        model (`PreTrainedModel`): a loaded generative model.
        state (`LookaheadState`, *optional*): the state to use, e.g. one with another cost-table directory
            (`LookaheadState(cost_dir=None)` keeps cost tables in memory only). A new `LookaheadState()` if unset.

    Returns:
        The same `model`, for chaining.
    """
    if not isinstance(model, PreTrainedModel) or not model.can_generate():
        raise TypeError(f"enable_lookahead expects a generative `PreTrainedModel`, got {type(model).__name__}.")
    if state is not None and not isinstance(state, LookaheadState):
        raise TypeError(f"`state` must be a `LookaheadState`, got {type(state).__name__}.")
    if not is_lookahead_enabled(model) and not isinstance(model, LookaheadGenerationMixin):
        from .continuous_batching import init_continuous_batching_with_lookahead

        model.generate = functools.partial(generate_with_lookahead, model)
        # `generate_batch` and the continuous-batching context manager reach the engine through this method.
        model.init_continuous_batching = functools.partial(init_continuous_batching_with_lookahead, model)
    if state is not None or getattr(model, "lookahead_state", None) is None:
        model.lookahead_state = state or LookaheadState()
    return model


def is_lookahead_enabled(model: PreTrainedModel) -> bool:
    """Whether `enable_lookahead` bound the model's `generate`."""
    bound = vars(model).get("generate")
    return isinstance(bound, functools.partial) and bound.func is generate_with_lookahead


def generate(
    model: PreTrainedModel,
    input_ids: torch.LongTensor,
    logits_processor: LogitsProcessorList,
    stopping_criteria: StoppingCriteriaList,
    generation_config: GenerationConfig,
    synced_gpus: bool = False,
    lookahead_window: int | str | None = None,
    lookahead_ngram: int | str | None = None,
    lookahead_guess: int | str | None = None,
    lookahead_pool_from_prompt: bool | None = None,
    lookahead_cache_commit: str | None = None,
    lookahead_memory: bool | None = None,
    lookahead_memory_size: int | None = None,
    lookahead_memory_namespace: str | None = None,
    lookahead_config: LookaheadConfig | None = None,
    lookahead_state: LookaheadState | None = None,
    lookahead_streamer: BaseStreamer | None = None,
    lookahead_assistant_model: PreTrainedModel | None = None,
    **model_kwargs: Any,
) -> LookaheadDecoderOnlyOutput | LookaheadEncoderDecoderOutput | torch.LongTensor:
    r"""
    Generates with lookahead decoding: each step runs one forward pass that both advances a Jacobi window of guesses
    and verifies candidate n-grams from a pool, then accepts every verified token plus one. Greedy output is the
    output of plain greedy decoding and sampled output follows the distribution of plain sampling, with the same
    logits processors, warpers and stopping criteria.

    `generate` calls this after preparing the inputs, either as a `custom_generate` callable
    (`model.generate(..., custom_generate=transformers_lookahead.generate, lookahead_window=7)`) or through
    `LookaheadGenerationMixin`. Settings come from `lookahead_config`, else from the `lookahead_*` arguments, else
    from the `generation_config` fields of the same names.

    Args:
        model (`PreTrainedModel`): a decoder-only model whose attention applies custom 4D masks, or an
            encoder-decoder model whose decoder also takes position ids (Whisper).
        input_ids (`torch.LongTensor` of shape `(batch_size, prompt_length)`): the prompts (for encoder-decoder
            models, the decoder's), left-padded as `generate` expects (the padding is read from
            `model_kwargs["attention_mask"]`, for encoder-decoder models `model_kwargs["decoder_attention_mask"]`).
        logits_processor (`LogitsProcessorList`): processors applied to every accepted position.
        stopping_criteria (`StoppingCriteriaList`): checked after every accepted token.
        generation_config (`GenerationConfig`): the resolved generation config.
        synced_gpus (`bool`, *optional*, defaults to `False`): unsupported, must be False.
        lookahead_window, lookahead_ngram, lookahead_guess, lookahead_pool_from_prompt, lookahead_cache_commit,
        lookahead_memory, lookahead_memory_size, lookahead_memory_namespace (*optional*): the `LookaheadConfig`
            fields of the same names (`window`, `ngram`, ...). Named here because Transformers passes a
            `custom_generate` callable only the keyword arguments its signature names.
        lookahead_config (`LookaheadConfig`, *optional*): the settings, already resolved (what
            `LookaheadGenerationMixin` passes); the `lookahead_*` arguments above are then ignored.
        lookahead_state (`LookaheadState`, *optional*): what earlier calls on this model learnt; defaults to
            `model.lookahead_state` (set by `enable_lookahead`), else a new state for this call only.
        lookahead_streamer (`BaseStreamer`, *optional*): receives the prompt, then every accepted chunk.
        lookahead_assistant_model (`PreTrainedModel`, *optional*): only checked, to refuse assisted decoding.
        model_kwargs: the model keyword arguments `generate` prepared, the cache among them.

    Returns:
        `torch.LongTensor` of shape `(batch_size, length)` (finished rows padded with `pad_token_id`, as plain
        `generate` pads them), or `LookaheadDecoderOnlyOutput` (`LookaheadEncoderDecoderOutput` for encoder-decoder
        models) if `generation_config.return_dict_in_generate=True`.
    """
    config = lookahead_config
    if config is None:
        settings = (lookahead_window, lookahead_ngram, lookahead_guess, lookahead_pool_from_prompt)
        settings += (lookahead_cache_commit, lookahead_memory, lookahead_memory_size, lookahead_memory_namespace)
        arguments = dict(zip(LOOKAHEAD_FIELDS, settings, strict=True))
        config = LookaheadConfig.from_sources(arguments, generation_config, default_window=DEFAULT_WINDOW)
        if config is None:
            raise ValueError(
                '`lookahead_window="off"` turns lookahead decoding off, but `custom_generate=transformers_lookahead.'
                "generate` is the lookahead decoding loop: remove `custom_generate` to decode without lookahead."
            )
    validate_lookahead_setup(model, generation_config, model_kwargs, lookahead_assistant_model)
    if synced_gpus:
        raise ValueError("Lookahead decoding does not support `synced_gpus=True`.")
    if lookahead_streamer is not None and input_ids.shape[0] > 1:
        raise ValueError(
            f"Streaming supports one sequence; got a batch of {input_ids.shape[0]} rows (input rows x "
            "`num_return_sequences`). With lookahead the rows advance by different numbers of tokens per step, so "
            "there is no per-step token column to stream: generate the rows one at a time to stream them."
        )
    state = lookahead_state or getattr(model, "lookahead_state", None) or LookaheadState()
    decoder = lookahead_decoder(
        model, config, state, logits_processor, stopping_criteria, generation_config, model_kwargs, len(input_ids)
    )
    return decoder.run(input_ids, model_kwargs, lookahead_streamer)


def lookahead_decoder(
    model: PreTrainedModel,
    config: LookaheadConfig,
    state: LookaheadState,
    logits_processor: LogitsProcessorList,
    stopping_criteria: StoppingCriteriaList,
    generation_config: GenerationConfig,
    model_kwargs: dict[str, Any],
    batch_size: int,
) -> LookaheadDecoder:
    """
    The decoding loop of one call, with what it is built from decided here: how the model takes a step and the cache
    keeps one, whether the model takes chain steps (`StepCheck`, at its first lookahead call), the planner (the
    paper's fixed shape, or `"auto"`'s priced by the model's cost table), and the ranks' sync under tensor
    parallelism.

    Args:
        model_kwargs (`dict`): what `generate` prepared: the cache, the padding mask, an encoder's outputs.
        batch_size (`int`): rows of the batch (after `num_return_sequences`).
    """
    cache, encoder = model_kwargs.get("cache"), model_kwargs.get("encoder_outputs")
    encoder_mask = model_kwargs.get("attention_mask") if encoder is not None else None
    forward = StepForward(model, cache, encoder, encoder_mask)
    committer = committer_for(forward.decoder_cache, config.cache_commit, type(model).__name__)
    # Checked before anything runs the model for this call (the prefill, or measuring "auto"'s cost table).
    padding = model_kwargs.get("attention_mask")
    padded = padding is not None and not bool(padding.all())
    chain = not forward.is_encoder_decoder and (
        state.step_check.refuse_if_failing(model, padded, chain_steps=True) or isinstance(committer, ChainCommitter)
    )
    # Tensor-parallel ranks must take identical steps (see `RankSync`); `None` on one device.
    sync = RankSync.for_model(model)
    refeed = committer.strategy == "refeed"
    do_sample = bool(generation_config.do_sample)
    if config.adaptive:
        # The cost table is per model, not per batch: an encoder-decoder model is timed over one input.
        first_input = None
        if forward.is_encoder_decoder:
            first_input = select_rows(forward.encoder_outputs, torch.tensor([0], device=model.device))
        cost = state.cost_model(model, encoder_outputs=first_input, chain=chain)
        if sync is not None:
            cost = sync.agree(cost)
        # `"auto"` learns from step durations, but not where the state says so, nor on tensor-parallel ranks.
        timed = sync is None and state.follow_durations
        planner = AdaptivePlanner(
            model, config, state, do_sample, cost, batch_size=batch_size, timed=timed, sync=sync, refeed=refeed
        )
    else:
        planner = StepPlanner(model, config, do_sample, refeed=refeed, observer=state.step_observer)
    return LookaheadDecoder(
        model,
        config,
        planner,
        forward,
        committer,
        logits_processor,
        stopping_criteria,
        generation_config,
        layout=ChainLayout if chain else StepLayout,
        sync=sync,
    )
