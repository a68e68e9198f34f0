"""The lookahead decoding loop, usable as `model.generate(..., custom_generate=transformers_lookahead.generate)`."""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from transformers import LogitsProcessorList, StoppingCriteriaList
from transformers.generation.utils import GenerateDecoderOnlyOutput

from .cache_commit import CacheCommitter, attention_groups, layer_types
from .configuration_lookahead import AUTO_CONTEXT_DEPTH, AUTO_MAX_WINDOW, LookaheadConfig, validate_lookahead_setup
from .cost_model import StepCostModel, cache_argument
from .lookahead_window import LookaheadWindow
from .ngram_pool import ContextIndex, NGramPool
from .step_layout import StepLayout
from .step_policy import AdaptiveStepPolicy, StaticStepPolicy, choose_window
from .verification import GreedyVerifier, SamplingVerifier

if TYPE_CHECKING:
    from transformers import GenerationConfig, PreTrainedModel
    from transformers.generation.streamers import BaseStreamer

# Used when lookahead is requested through `custom_generate` without any `lookahead_window`.
DEFAULT_WINDOW = "auto"


@dataclass
class LookaheadDecoderOnlyOutput(GenerateDecoderOnlyOutput):
    """
    `GenerateDecoderOnlyOutput` plus what lookahead decoding did.

    Args:
        num_forward_passes (`int`): forward passes of the model, the prefill included.
        accepted_per_step (`tuple[int]`): tokens added to the sequence by each decoding step after the prefill.
    """

    num_forward_passes: int | None = None
    accepted_per_step: tuple[int, ...] | None = None


def generate(
    model: PreTrainedModel,
    input_ids: torch.LongTensor,
    logits_processor: LogitsProcessorList,
    stopping_criteria: StoppingCriteriaList,
    generation_config: GenerationConfig,
    synced_gpus: bool = False,
    lookahead_window: int | None = None,
    lookahead_ngram: int | None = None,
    lookahead_guess: int | None = None,
    lookahead_pool_from_prompt: bool | None = None,
    lookahead_cache_commit: str | None = None,
    lookahead_streamer: BaseStreamer | None = None,
    lookahead_assistant_model: PreTrainedModel | None = None,
    **model_kwargs: Any,
) -> LookaheadDecoderOnlyOutput | torch.LongTensor:
    r"""
    Generates with lookahead decoding: each step runs one forward pass that both advances a Jacobi window of guesses
    and verifies candidate n-grams from a pool, then accepts every verified token plus one. Greedy output is the
    output of plain greedy decoding and sampled output follows the distribution of plain sampling, with the same
    logits processors, warpers and stopping criteria.

    `generate` calls this after preparing the inputs, either as a `custom_generate` callable or through
    `LookaheadGenerationMixin`. Settings come from the `lookahead_*` arguments, else from the `generation_config`
    fields of the same names.

    Args:
        model (`PreTrainedModel`): a decoder-only model whose attention applies custom 4D masks.
        input_ids (`torch.LongTensor` of shape `(1, prompt_length)`): the prompt.
        logits_processor (`LogitsProcessorList`): processors applied to every accepted position.
        stopping_criteria (`StoppingCriteriaList`): checked after every accepted token.
        generation_config (`GenerationConfig`): the resolved generation config.
        synced_gpus (`bool`): unsupported, must be False.
        lookahead_window (`int`, *optional*): W, window columns.
        lookahead_ngram (`int`, *optional*): N, n-gram size (window levels + 1).
        lookahead_guess (`int`, *optional*): G, the most candidates verified per step.
        lookahead_pool_from_prompt (`bool`, *optional*): seed the pool from the prompt and the accepted text.
        lookahead_cache_commit (`str`, *optional*): `"gather"` or `"refeed"`.
        lookahead_streamer (`BaseStreamer`, *optional*): receives the prompt, then every accepted chunk.
        lookahead_assistant_model (`PreTrainedModel`, *optional*): only checked, to refuse assisted decoding.
        model_kwargs: the model keyword arguments `generate` prepared, the cache among them.

    Returns:
        `torch.LongTensor` of shape `(1, length)`, or `LookaheadDecoderOnlyOutput` if
        `generation_config.return_dict_in_generate=True`.
    """
    overrides = {
        "lookahead_window": lookahead_window,
        "lookahead_ngram": lookahead_ngram,
        "lookahead_guess": lookahead_guess,
        "lookahead_pool_from_prompt": lookahead_pool_from_prompt,
        "lookahead_cache_commit": lookahead_cache_commit,
    }
    config = LookaheadConfig.from_sources(overrides, generation_config)
    if config is None:
        config = LookaheadConfig(window=DEFAULT_WINDOW)
    validate_lookahead_setup(model, generation_config, input_ids.shape[0], model_kwargs, lookahead_assistant_model)
    if synced_gpus:
        raise ValueError("Lookahead decoding does not support `synced_gpus=True`.")
    cache = model_kwargs.get("cache")
    committer = CacheCommitter(cache, config.cache_commit)
    return LookaheadDecoder(model, config, logits_processor, stopping_criteria, generation_config, committer).run(
        input_ids, model_kwargs, lookahead_streamer
    )


class LookaheadDecoder:
    """
    The decoding loop of one `generate` call.

    Args:
        model (`PreTrainedModel`): the model.
        config (`LookaheadConfig`): the step shape.
        logits_processor (`LogitsProcessorList`): applied to every accepted position.
        stopping_criteria (`StoppingCriteriaList`): checked after every accepted token.
        generation_config (`GenerationConfig`): the resolved generation config.
        committer (`CacheCommitter`): keeps the accepted tokens in the cache.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        config: LookaheadConfig,
        logits_processor: LogitsProcessorList,
        stopping_criteria: StoppingCriteriaList,
        generation_config: GenerationConfig,
        committer: CacheCommitter,
    ):
        self.model = model
        self.config = config
        self.logits_processor = logits_processor
        self.stopping_criteria = stopping_criteria
        self.generation_config = generation_config
        self.committer = committer
        if config.adaptive:
            cost = StepCostModel.for_model(model)
            self.window_size = choose_window(cost, config.levels, AUTO_MAX_WINDOW)
            self.policy = AdaptiveStepPolicy(
                cost, self.window_size * config.levels, config.levels, context_depth=AUTO_CONTEXT_DEPTH
            )
            # The adaptive policy also verifies the continuation of the longest repeated suffix of the text.
            self.context = ContextIndex() if config.pool_from_prompt else None
        else:
            self.window_size = config.window
            self.policy = StaticStepPolicy()
            self.context = None
        forward_parameters = inspect.signature(model.forward).parameters
        self.cache_argument = cache_argument(model)
        self.slices_logits = "logits_to_keep" in forward_parameters
        # Models with learned absolute positions cannot embed positions past this; guesses stop short of it.
        self.max_positions = getattr(model.config.get_text_config(decoder=True), "max_position_embeddings", None)
        return_dict = generation_config.return_dict_in_generate
        self.scores = () if return_dict and generation_config.output_scores else None
        self.raw_logits = () if return_dict and generation_config.output_logits else None

    def run(
        self, input_ids: torch.LongTensor, model_kwargs: dict[str, Any], streamer: BaseStreamer | None
    ) -> LookaheadDecoderOnlyOutput | torch.LongTensor:
        model, config, cache = self.model, self.config, self.committer.cache
        max_length = self.generation_config.max_length
        if streamer is not None:
            streamer.put(input_ids.cpu())

        outputs = model._prefill(input_ids, self.generation_config, model_kwargs)
        forward_passes, accepted_per_step = 1, []
        first = outputs.logits[:, -1].to(dtype=torch.float32, copy=True)
        first_scores = self.logits_processor(input_ids, first)
        del outputs
        if self.generation_config.do_sample:
            first_token = int(torch.multinomial(torch.softmax(first_scores[0], dim=-1), 1))
        else:
            first_token = int(first_scores.argmax(-1))
        input_ids, kept, done = self._append(input_ids, [first_token], [first], [first_scores])
        self._stream(streamer, input_ids, kept)

        self.committer.start()
        tokens = input_ids[0].tolist()
        pool = NGramPool(config.levels, config.guess)
        if config.pool_from_prompt:
            pool.add_sequence(tokens)
        window = LookaheadWindow(self.window_size, config.levels, input_ids[0])
        layout = StepLayout(
            self.window_size,
            config.levels,
            attention_groups(cache, layer_types(model)),
            model.dtype,
            input_ids.device,
        )
        verifier_class = SamplingVerifier if self.generation_config.do_sample else GreedyVerifier
        verifier = verifier_class(self.logits_processor)
        pending = input_ids[0, -1:]

        while not done:
            length = input_ids.shape[1]
            position = length - 1
            position_room = (self.max_positions - 1 - position) if self.max_positions else max_length
            depth = min(config.levels, max_length - length - 1, position_room)
            window_allowed = position_room >= config.levels + self.window_size - 1
            tree = pool.tree(tokens[-1], depth)
            if self.context is not None:
                self.context.update(tokens)
                room = min(AUTO_CONTEXT_DEPTH, max_length - length - 1, position_room)
                tree.add_path(self.context.continuation(tokens, room))
            use_window, tree = self.policy.plan(tree, window_allowed, pending.shape[0])
            step = layout.build(cache, pending, position, window.flat() if use_window else None, tree)

            started = time.perf_counter()
            logits = self._forward(step)
            forward_passes += 1
            tree_row = 1 + (self.window_size if use_window else 0)
            verdict = verifier.verify(logits, tree, tree_row, input_ids, max_length - length)
            # `verify` reads the choices on the host, so on accelerators too the step has finished here.
            self.policy.observe_duration(step.length, time.perf_counter() - started)
            input_ids, kept, done = self._append(input_ids, verdict.tokens, verdict.logits, verdict.scores)
            accepted_per_step.append(kept)
            self._stream(streamer, input_ids, kept)

            new_tokens = verdict.tokens[:kept]
            node_start = pending.shape[0] + (len(window) if use_window else 0)
            self.committer.commit(step.length, pending.shape[0], [node_start + n for n in verdict.nodes[: kept - 1]])
            pending = input_ids[0, -kept:] if config.cache_commit == "refeed" else input_ids[0, -1:]

            self.policy.observe(tree, verdict, use_window, pool, tokens[-1])
            if use_window:
                for ngram in window.update(logits[1:tree_row].argmax(-1)):
                    pool.add(ngram[0], ngram[1:], from_window=True)
            tokens.extend(new_tokens)
            if config.pool_from_prompt:
                pool.add_sequence(tokens, first_key=len(tokens) - kept - config.levels)

        if streamer is not None:
            streamer.end()
        if not self.generation_config.return_dict_in_generate:
            return input_ids
        return LookaheadDecoderOnlyOutput(
            sequences=input_ids,
            scores=self.scores,
            logits=self.raw_logits,
            cache=cache,
            num_forward_passes=forward_passes,
            accepted_per_step=tuple(accepted_per_step),
        )

    def _forward(self, step) -> torch.Tensor:
        """Runs the step's forward pass; returns the logits of `step.logits_rows`, shape `(rows, vocab)`."""
        kwargs = {self.cache_argument: self.committer.cache}
        if self.slices_logits:
            kwargs["logits_to_keep"] = step.logits_rows
        outputs = self.model(
            input_ids=step.input_ids,
            position_ids=step.position_ids,
            attention_mask=step.attention_mask,
            use_cache=True,
            return_dict=True,
            **kwargs,
        )
        logits = outputs.logits[0]
        return logits if self.slices_logits else logits[step.logits_rows]

    def _append(
        self,
        input_ids: torch.LongTensor,
        tokens: list[int],
        logits: list[torch.Tensor],
        scores: list[torch.Tensor],
    ) -> tuple[torch.LongTensor, int, bool]:
        """Appends tokens one at a time, as plain decoding would, until a stopping criterion fires."""
        for kept, (token, raw, processed) in enumerate(zip(tokens, logits, scores), start=1):
            input_ids = torch.cat([input_ids, input_ids.new_tensor([[token]])], dim=-1)
            if self.scores is not None:
                self.scores += (processed,)
            if self.raw_logits is not None:
                self.raw_logits += (raw,)
            if self.stopping_criteria(input_ids, self.scores).any():
                return input_ids, kept, True
        return input_ids, len(tokens), False

    @staticmethod
    def _stream(streamer: BaseStreamer | None, input_ids: torch.LongTensor, kept: int) -> None:
        if streamer is not None:
            streamer.put(input_ids[0, -kept:].cpu())
