"""
Lookahead on a loaded model or a model class, with every capability the package adds to the core: `enable_lookahead`,
`LookaheadGenerationMixin`, and `lookahead_decoder`, which builds a call's loop with `"auto"`'s planner, the model
check, chain steps and the ranks' sync under tensor parallelism.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from transformers import GenerationConfig, LogitsProcessorList, PreTrainedModel, StoppingCriteriaList

from .adaptive_planner import AdaptivePlanner
from .chain_steps import ChainCommitter, ChainLayout, committer_for, index_topk
from .compatibility import is_from_model_config, mark_as_user_config
from .configuration_lookahead import AUTO, LOOKAHEAD_FIELDS, LookaheadConfig
from .lookahead_decoding import LookaheadDecoder
from .lookahead_generation import generate as core_generate
from .lookahead_generation import generate_with_lookahead, step_forward
from .lookahead_state import LookaheadState
from .rank_sync import RankSync
from .sequence_lookahead import StepPlanner
from .step_forward import select_rows
from .step_layout import StepLayout


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
        return generate_with_lookahead(
            self, inputs, generation_config, build=lookahead_decoder, plain_generate=super().generate, **kwargs
        )

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

        model.generate = functools.partial(generate_with_lookahead, model, build=lookahead_decoder)
        # `generate_batch` and the continuous-batching context manager reach the engine through this method.
        model.init_continuous_batching = functools.partial(init_continuous_batching_with_lookahead, model)
    if state is not None or getattr(model, "lookahead_state", None) is None:
        model.lookahead_state = state or LookaheadState()
    return model


def is_lookahead_enabled(model: PreTrainedModel) -> bool:
    """Whether `enable_lookahead` bound the model's `generate`."""
    bound = vars(model).get("generate")
    return isinstance(bound, functools.partial) and bound.keywords.get("build") is lookahead_decoder


def lookahead_decoder(
    model: PreTrainedModel,
    config: LookaheadConfig,
    logits_processor: LogitsProcessorList,
    stopping_criteria: StoppingCriteriaList,
    generation_config: GenerationConfig,
    model_kwargs: dict[str, Any],
    batch_size: int,
    state: LookaheadState | None = None,
) -> LookaheadDecoder:
    """
    The decoding loop of one call (a `DecoderBuilder`), with what it is built from decided here: how the cache keeps
    a step, whether the model takes chain steps (`StepCheck`, at its first lookahead call), the planner (the paper's
    fixed shape, or `"auto"`'s priced by the model's cost table), and the ranks' sync under tensor parallelism.

    Args:
        model_kwargs (`dict`): what `generate` prepared: the cache, the padding mask, an encoder's outputs.
        batch_size (`int`): rows of the batch (after `num_return_sequences`).
        state (`LookaheadState`, *optional*): what earlier calls learnt; `model.lookahead_state`, else a new one.
    """
    state = state or getattr(model, "lookahead_state", None) or LookaheadState()
    forward = step_forward(model, model_kwargs)
    committer = committer_for(forward.decoder_cache, config.cache_commit, type(model).__name__, index_topk(model))
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


# The loop as a `custom_generate` callable with everything the package adds (`"auto"` where no window is set):
# `model.generate(..., custom_generate=transformers_lookahead.generate)`.
generate = functools.partial(core_generate, lookahead_build=lookahead_decoder, lookahead_default_window=AUTO)
