"""The private Transformers APIs behind `compatibility.py` are where the package expects them."""

import inspect
import unittest
from collections.abc import Callable
from types import SimpleNamespace
from unittest import mock

import torch
import transformers
from transformers import (
    CompileConfig,
    EncoderNoRepeatNGramLogitsProcessor,
    EncoderRepetitionPenaltyLogitsProcessor,
    GenerationConfig,
    GenerationMixin,
    PrefixConstrainedLogitsProcessor,
    PreTrainedModel,
    RepetitionPenaltyLogitsProcessor,
    SynthIDTextWatermarkLogitsProcessor,
)
from transformers.cache_utils import DynamicLayer, StaticSlidingWindowLayer
from transformers.generation.continuous_batching import cb_logits_processors
from transformers.generation.continuous_batching.continuous_api import (
    ContinuousBatchingManager,
    ContinuousBatchProcessor,
)
from transformers.generation.continuous_batching.requests import RequestState
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria

from transformers_lookahead.compatibility import (
    PER_REQUEST_WARPERS,
    ROLLBACK_LAYERS,
    BatchProcessorHooks,
    become,
    pad_token_id,
)


def check_private_apis() -> list[str]:
    """
    What of the private APIs `compatibility.py` reaches no longer behaves as it expects in the installed Transformers:
    one sentence per API that moved, empty when all are in place.
    """
    problems = []

    def expect(condition: bool, message: str) -> None:
        if not condition:
            problems.append(message)

    def parameters(function: Callable | None) -> list[str]:
        return list(inspect.signature(function).parameters) if function is not None else []

    expect(
        parameters(getattr(GenerationMixin, "_prefill", None))[:4]
        == ["self", "input_ids", "generation_config", "model_kwargs"],
        "`GenerationMixin._prefill(self, input_ids, generation_config, model_kwargs)` (used by `prefill`)",
    )
    expect(
        parameters(getattr(GenerationMixin, "_valid_auto_compile_criteria", None))
        == ["self", "model_kwargs", "generation_config"],
        "`GenerationMixin._valid_auto_compile_criteria(self, model_kwargs, generation_config)` "
        "(used by `can_auto_compile`)",
    )
    # What `generate` resolves for a call, read back as `pad_token_id` does.
    special_tokens = GenerationConfig(pad_token_id=3, eos_token_id=2)
    decoder_only = SimpleNamespace(device=torch.device("cpu"), config=SimpleNamespace(is_encoder_decoder=False))
    try:
        GenerationMixin._prepare_special_tokens(decoder_only, special_tokens, True, torch.device("cpu"))
        resolved = pad_token_id(special_tokens)
    except (AttributeError, TypeError) as error:
        resolved = error
    expect(
        resolved == 3,
        "`GenerationConfig._pad_token_tensor`, set by `GenerationMixin._prepare_special_tokens(generation_config, "
        f"kwargs_has_attention_mask, device)` (used by `pad_token_id`; got {resolved!r})",
    )
    expect(
        hasattr(GenerationConfig(), "_from_model_config"),
        "`GenerationConfig._from_model_config` (used by `mark_as_user_config`)",
    )
    processor = PrefixConstrainedLogitsProcessor(lambda batch_id, ids: [0], num_beams=1)
    expect(
        callable(getattr(processor, "_prefix_allowed_tokens_fn", None)),
        "`PrefixConstrainedLogitsProcessor._prefix_allowed_tokens_fn` (used by `processors_for_row`)",
    )
    encoder_ids = torch.tensor([[3, 4, 5], [6, 7, 8]])
    expect(
        hasattr(RepetitionPenaltyLogitsProcessor(1.5), "prompt_ignore_length")
        and torch.equal(
            getattr(EncoderRepetitionPenaltyLogitsProcessor(1.5, encoder_ids), "encoder_input_ids", None), encoder_ids
        ),
        "`RepetitionPenaltyLogitsProcessor.prompt_ignore_length`, `EncoderRepetitionPenaltyLogitsProcessor."
        "encoder_input_ids` (used by `processors_for_row`)",
    )
    ngrams = EncoderNoRepeatNGramLogitsProcessor(2, encoder_ids)
    expect(
        getattr(ngrams, "batch_size", None) == 2 and len(getattr(ngrams, "generated_ngrams", ())) == 2,
        "`EncoderNoRepeatNGramLogitsProcessor.batch_size` and `generated_ngrams`, one per input row (used by "
        "`processors_for_row`)",
    )
    length_criterion, eos_criterion = MaxLengthCriteria(5, max_position_embeddings=7), EosTokenCriteria([2, 3])
    expect(
        (length_criterion.max_length, length_criterion.max_position_embeddings) == (5, 7)
        and torch.as_tensor(eos_criterion.eos_token_id).tolist() == [2, 3],
        "`MaxLengthCriteria.max_length` / `.max_position_embeddings` and `EosTokenCriteria.eos_token_id` (used by "
        "`TokenStoppingCriteria`)",
    )
    watermark = SynthIDTextWatermarkLogitsProcessor(
        ngram_len=2, keys=[1, 2], sampling_table_size=16, sampling_table_seed=0, context_history_size=4, device="cpu"
    )
    expect(
        "state" in vars(watermark) and watermark.state is None,
        "`SynthIDTextWatermarkLogitsProcessor.state`, created at the first call (used by `processors_for_row`)",
    )
    from transformers import LlamaConfig

    expect(
        hasattr(LlamaConfig(), "_attn_implementation"),
        "`PretrainedConfig._attn_implementation` (used by `attention_implementation`)",
    )
    for layer in ROLLBACK_LAYERS:
        expect(
            callable(getattr(layer, "crop", None)) and "is_sliding" in dir(layer),
            f"`transformers.cache_utils.{layer.__name__}` with `crop` and `is_sliding` (see `ROLLBACK_LAYERS`)",
        )
    expect(
        hasattr(StaticSlidingWindowLayer, "is_croppable"),
        "`StaticSlidingWindowLayer.is_croppable` (used by `can_roll_back`)",
    )
    layer = DynamicLayer()
    layer.update(torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3, 4))
    expect(
        getattr(getattr(layer, "keys", None), "shape", None) == (1, 2, 3, 4)
        and getattr(getattr(layer, "values", None), "shape", None) == (1, 2, 3, 4),
        "cache layers' `keys` / `values` tensors of shape (batch, heads, positions, head_dim) (written in place by "
        "`cache_commit.EntryMoves`)",
    )
    expect(
        hasattr(CompileConfig(), "_compile_all_devices"),
        "`CompileConfig._compile_all_devices` (used by `compile_config`)",
    )
    expect(
        callable(getattr(PreTrainedModel, "_from_config", None)),
        "`PreTrainedModel._from_config` (used by `model_from_config`)",
    )
    expect(
        "_device_mesh" in dir(PreTrainedModel) and "tp_size" in dir(PreTrainedModel),
        "`PreTrainedModel._device_mesh` and `tp_size` (used by `tensor_parallel_group`)",
    )
    from transformers.generation.continuous_batching.cache_allocators.cache_allocator import CacheAllocator
    from transformers.generation.continuous_batching.cache_allocators.full_attention import (
        FullAttentionCacheAllocator,
    )
    from transformers.generation.continuous_batching.input_outputs import ContinuousBatchingIOs
    from transformers.generation.continuous_batching.scheduler import Scheduler

    for name in ("prepare_next_batch", "_generation_step", "update_batch", "reset"):
        expect(callable(getattr(ContinuousBatchProcessor, name, None)), f"`ContinuousBatchProcessor.{name}`")
    expect(
        parameters(ContinuousBatchProcessor._generation_step) == ["self", "model"],
        "`ContinuousBatchProcessor._generation_step(self, model)` (reached by `BatchProcessorHooks`)",
    )
    expect(
        parameters(ContinuousBatchingManager._create_batch_processor) == ["self"],
        "`ContinuousBatchingManager._create_batch_processor(self)` (reached by `ManagerHooks`)",
    )
    expect(
        "_requests_to_fork" in inspect.getsource(ContinuousBatchProcessor.update_batch),
        "`ContinuousBatchProcessor.update_batch` handles forks and nothing else besides tokens (replaced whole)",
    )
    prepare = inspect.getsource(ContinuousBatchingIOs.prepare_batch_tensors)
    expect(
        "range(past_length, past_length + query_length)" in prepare and "build_attention_mask" in prepare,
        "`ContinuousBatchingIOs.prepare_batch_tensors` lays a request's query tokens at consecutive positions under "
        "a causal mask (what `LookaheadBatching.lay_out` rewrites)",
    )
    for name in (
        "position_ids",
        "cumulative_seqlens_q",
        "cumulative_seqlens_k",
        "attention_mask",
        "requests_in_batch",
    ):
        expect(name in inspect.getsource(ContinuousBatchingIOs), f"`ContinuousBatchingIOs.{name}`")
    expect(
        parameters(FullAttentionCacheAllocator.get_write_indices)
        == ["self", "request_id", "past_length", "query_length"]
        and "_kv_token_views" in inspect.getsource(FullAttentionCacheAllocator.update),
        "`FullAttentionCacheAllocator.get_write_indices` and `_kv_token_views` (used by `move_accepted_entries`)",
    )
    expect(
        "block_table" in inspect.getsource(CacheAllocator.free_blocks)
        and "ledger.release" in inspect.getsource(CacheAllocator.free_blocks),
        "`CacheAllocator.block_table` and `ledger.release` (used by `release_pages_past`)",
    )
    for name, setting in PER_REQUEST_WARPERS.items():
        warper = getattr(cb_logits_processors, name, None)
        expect(
            warper is not None and warper.supported_kwargs == {setting: int if setting == "top_k" else float},
            f"`{name}` reads the request's `{setting}` (rebuilt per request by `request_processors`)",
        )
    state = RequestState(request_id="check", initial_tokens=[1, 2], max_new_tokens=2)
    expect(
        isinstance(getattr(state, "logit_processor_kwargs", None), dict),
        "`RequestState.logit_processor_kwargs` (a request's own sampling settings)",
    )
    expect(
        all(hasattr(state, name) for name in ("tokens_to_process", "position_offset", "generated_tokens")),
        "`RequestState.tokens_to_process`, `position_offset` and `generated_tokens` (read and set per step)",
    )
    expect(
        "state.tokens_to_process" in inspect.getsource(Scheduler._infer_request_tokens),
        "`Scheduler._infer_request_tokens` schedules a decoding request's `tokens_to_process` (how a block reaches "
        "the batch)",
    )
    return problems


class PrivateApiTest(unittest.TestCase):
    def test_private_apis_are_in_place(self):
        problems = check_private_apis()
        self.assertEqual(
            problems,
            [],
            f"Transformers {transformers.__version__} changed private APIs lookahead decoding relies on; adapt "
            "src/transformers_lookahead/compatibility.py: " + "; ".join(problems),
        )

    def test_a_moved_api_is_named(self):
        with mock.patch.object(GenerationMixin, "_valid_auto_compile_criteria", None):
            problems = check_private_apis()
        self.assertEqual(len(problems), 1)
        self.assertIn("_valid_auto_compile_criteria", problems[0])

    def test_a_changed_signature_is_named(self):
        def _prefill(self, input_ids, model_kwargs):
            raise AssertionError("not called")

        with mock.patch.object(GenerationMixin, "_prefill", _prefill):
            problems = check_private_apis()
        self.assertEqual(len(problems), 1)
        self.assertIn("_prefill", problems[0])

    def test_a_moved_continuous_batching_hook_is_named(self):
        def _generation_step(self, model, batch):
            raise AssertionError("not called")

        with mock.patch.object(ContinuousBatchProcessor, "_generation_step", _generation_step):
            problems = check_private_apis()
        self.assertEqual(len(problems), 1)
        self.assertIn("ContinuousBatchProcessor._generation_step", problems[0])

    def test_a_pad_token_no_longer_resolved_is_named(self):
        original = GenerationMixin._prepare_special_tokens

        def _prepare_special_tokens(self, generation_config, *args, **kwargs):
            original(self, generation_config, *args, **kwargs)
            del generation_config._pad_token_tensor

        with mock.patch.object(GenerationMixin, "_prepare_special_tokens", _prepare_special_tokens):
            problems = check_private_apis()
        self.assertEqual(len(problems), 1)
        self.assertIn("_pad_token_tensor", problems[0])


class BecomeTest(unittest.TestCase):
    def test_takes_over_an_instance_of_the_transformers_class_only(self):
        class Hooks(BatchProcessorHooks):
            pass

        stock = object.__new__(ContinuousBatchProcessor)
        self.assertIs(become(stock, Hooks), stock)
        self.assertIsInstance(stock, Hooks)
        with self.assertRaisesRegex(TypeError, "extends ContinuousBatchProcessor"):
            become(object.__new__(ContinuousBatchingManager), Hooks)
