"""The private Transformers APIs behind `compatibility.py` are where the package expects them."""

import inspect
import unittest
from collections.abc import Callable
from functools import partial
from types import SimpleNamespace
from unittest import mock

import torch
import transformers
from parameterized import parameterized
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
from transformers.generation.configuration_utils import ContinuousBatchingConfig
from transformers.generation.continuous_batching import cb_logits_processors
from transformers.generation.continuous_batching.cache_allocators.cache_pool import CachePool
from transformers.generation.continuous_batching.cache_allocators.full_attention import FullAttentionCacheAllocator
from transformers.generation.continuous_batching.continuous_api import (
    ContinuousBatchingManager,
    ContinuousBatchProcessor,
)
from transformers.generation.continuous_batching.input_outputs import ContinuousBatchingIOs
from transformers.generation.continuous_batching.model_runner import ModelRunner
from transformers.generation.continuous_batching.requests import RequestState, RequestStatus
from transformers.generation.continuous_batching.scheduler import Scheduler
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria

from transformers_lookahead.compatibility import ROLLBACK_LAYERS, pad_token_id
from transformers_lookahead.configuration_lookahead import LookaheadConfig
from transformers_lookahead.continuous_batching import LookaheadBatching
from transformers_lookahead.engine_compatibility import (
    PER_REQUEST_WARPERS,
    BatchProcessorHooks,
    LookaheadBatchProcessor,
    ModelRunnerHooks,
    move_accepted_entries,
    release_pages_past,
    taken_over,
)
from transformers_lookahead.lookahead_state import LookaheadState
from utils.tiny_models import tiny_model


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
    problems.extend(check_continuous_batching())
    return problems


# A small engine driven step by step on the caller's thread: pages of 4 tokens, so that a step spans pages.
PROBE_ENGINE = dict(num_blocks=16, page_size=4, max_batch_tokens=64, use_cuda_graph=False, use_async_batching=False)
PROBE_SETTINGS = dict(do_sample=False, eos_token_id=-1, pad_token_id=0)


def _probe_engine(
    max_new_tokens: int = 4, **engine
) -> tuple[PreTrainedModel, ContinuousBatchingManager, ContinuousBatchProcessor]:
    """A tiny model, its stock continuous-batching manager, and the processor its thread would run (not started)."""
    model = tiny_model("llama")
    generation_config = GenerationConfig(max_new_tokens=max_new_tokens, **PROBE_SETTINGS)
    manager = model.init_continuous_batching(
        generation_config=generation_config,
        continuous_batching_config=ContinuousBatchingConfig(**{**PROBE_ENGINE, **engine}),
    )
    return model, manager, manager._create_batch_processor()


def _run_step(model: PreTrainedModel, processor: ContinuousBatchProcessor) -> bool:
    """One engine step as the manager's loop runs it; whether there was a batch."""
    if not processor.prepare_next_batch():
        return False
    processor._generation_step(model)
    processor.update_batch()
    return True


def _engine_state(manager: ContinuousBatchingManager, processor: ContinuousBatchProcessor) -> tuple:
    """What a step leaves behind: the requests, the outputs delivered, each allocator's pages and shared blocks."""
    requests = {
        request_id: {name: value for name, value in vars(state).items() if "time" not in name and name != "lifespan"}
        for request_id, state in processor.scheduler.active_requests.items()
    }
    outputs = []
    while not manager.output_router.output_queue.empty():
        output = vars(manager.output_router.output_queue.get())
        outputs.append({name: output[name] for name in ("request_id", "generated_tokens", "status", "error")})
    pages = {
        name: (
            processor.cache.pool.count_free_blocks(allocator.index),
            {request_id: list(table) for request_id, table in allocator.block_table.items()},
            vars(allocator.ledger),
        )
        for name, allocator in processor.cache.cache_allocators.items()
    }
    return requests, outputs, pages, sorted(processor.scheduler.waiting_requests)


def check_continuous_batching() -> list[str]:
    """
    What of Transformers' continuous-batching engine no longer behaves as `continuous_batching.py` and the
    accessors in `compatibility.py` expect, found by driving stock engines of a tiny model step by step.
    """
    return _check_block() + _check_update_batch() + _check_step_function()


def _check_block() -> list[str]:
    """
    A decoding request whose `tokens_to_process` holds a block of 3 tokens: scheduled whole, laid out causally at
    consecutive positions, its entries moved and its pages released as the lookahead engine does. Stops at the first
    problem: the later checks run on what the earlier ones established.
    """
    try:
        model, manager, processor = _probe_engine()
        request_id = manager.add_request([5, 6, 7, 8, 9, 10])
        _run_step(model, processor)
        state = processor.scheduler.active_requests[request_id]
        past, block = state.position_offset, [*state.tokens_to_process, 11, 12]
        state.tokens_to_process = list(block)
        processor.prepare_next_batch()
    except Exception as error:  # noqa: BLE001 - a moved API can fail in any way; the check says where
        return [f"a stock continuous-batching engine driven step by step ({type(error).__name__}: {error})"]
    io = processor.inputs_and_outputs
    scheduled = io.input_ids[: io.requests_in_batch[0].query_length].tolist()
    if scheduled != block:
        return [
            "`Scheduler._infer_request_tokens` schedules a decoding request's whole `tokens_to_process` (how a "
            f"lookahead block reaches the batch; scheduled {scheduled} of {block})"
        ]
    positions = io.position_ids[: len(block)].tolist()
    causal = torch.ones(len(block), past + len(block), dtype=torch.bool).tril(past)
    masks = [mask[0, 0, : len(block), : past + len(block)] == 0 for mask in (io.attention_mask or {}).values()]
    if (
        positions != list(range(past, past + len(block)))
        or not masks
        or not all(torch.equal(m, causal) for m in masks)
    ):
        return [
            "`ContinuousBatchingIOs.prepare_batch_tensors` lays a request's query tokens at consecutive `position_ids` "
            f"under a causal `attention_mask` (what `LookaheadBatching.lay_out` rewrites; positions {positions})"
        ]
    try:
        processor._generation_step(model)
    except Exception as error:  # noqa: BLE001
        return [f"a continuous-batching step of a {len(block)}-token block ({type(error).__name__}: {error})"]
    return _check_entry_moves(processor, request_id, past, len(block)) or _check_page_release(
        processor, request_id, past
    )


def _check_entry_moves(processor: ContinuousBatchProcessor, request_id: str, past: int, length: int) -> list[str]:
    """`move_accepted_entries` changes what attention reads: an accepted entry is then read at its new position."""
    message = (
        "`FullAttentionCacheAllocator.get_write_indices` and `_kv_token_views`: an entry moved by "
        "`move_accepted_entries` is what attention then reads at its new position"
    )
    allocator = processor.cache.cache_allocators["full_attention"]
    slots = torch.tensor(allocator.get_write_indices(request_id, past, length))
    nothing = torch.empty(0, allocator.num_key_value_heads, allocator.head_dim, dtype=allocator.cache_dtype)
    no_slots = torch.empty(0, dtype=torch.long)

    def read() -> list[tuple[torch.Tensor, torch.Tensor]]:
        # What attention reads at these positions: `update` with nothing to write, as a layer's forward reads.
        return [allocator.update(nothing, nothing, layer, slots, no_slots) for layer in allocator.layer_indices]

    before = read()
    try:
        move_accepted_entries(processor.cache, [(request_id, past, length, 0, [length - 1])])
    except AttributeError as error:
        return [f"{message} ({error})"]
    after = read()
    moved = all(
        torch.equal(new[1], old[-1]) and torch.equal(new[0], old[0]) and not torch.equal(old[1], old[-1])
        for old_pair, new_pair in zip(before, after)
        for old, new in zip(old_pair, new_pair)
    )
    return [] if moved else [message]


def _check_page_release(processor: ContinuousBatchProcessor, request_id: str, past: int) -> list[str]:
    """`release_pages_past` gives the pages past a length back to the pool and out of the request's block table."""
    allocator = processor.cache.cache_allocators["full_attention"]
    free, table = processor.cache.pool.count_free_blocks(allocator.index), len(allocator.block_table[request_id])
    keep = -(-(past + 1) // allocator.tokens_per_page)
    release_pages_past(processor.cache, request_id, past + 1)
    freed = processor.cache.pool.count_free_blocks(allocator.index) - free
    if table > keep and len(allocator.block_table[request_id]) == keep and freed == table - keep:
        return []
    return [
        "`CacheAllocator.block_table`, `ledger.release` and `CachePool.free_blocks` (used by `release_pages_past`: "
        f"{table} pages, {keep} kept, {freed} freed)"
    ]


def _check_update_batch() -> list[str]:
    """
    `LookaheadBatchProcessor.update_batch` replaces the stock one whole: on one-token steps (a lookahead whose blocks
    never fit) the two must leave the requests, the outputs and the pages alike, finished requests included.
    """
    stock_model, stock_manager, stock = _probe_engine(max_new_tokens=3)
    model, manager, processor = _probe_engine(max_new_tokens=3)
    lookahead = LookaheadBatching(
        model,
        LookaheadConfig(window=2, ngram=2),
        manager.generation_config,
        manager.logit_processor.logits_processor,
        LookaheadState(),
        None,
        max_batch_tokens=1,
    )
    processor = LookaheadBatchProcessor.adopt(processor, model, lookahead)
    for engine in (stock_manager, manager):
        engine.add_request([5, 6, 7, 8, 9], request_id="first")
        engine.add_request([9, 8, 7, 6, 5, 4, 3], request_id="second", max_new_tokens=2)
    for step in range(4):
        try:
            with torch.no_grad():
                ran = (_run_step(stock_model, stock), _run_step(model, processor))
        except Exception as error:  # noqa: BLE001
            return [f"one-token continuous-batching steps, at step {step} ({type(error).__name__}: {error})"]
        if ran[0] != ran[1] or _engine_state(stock_manager, stock) != _engine_state(manager, processor):
            return [
                "`ContinuousBatchProcessor.update_batch` changes what `LookaheadBatchProcessor.update_batch` "
                f"(which replaces it) does not, or the reverse (at step {step})"
            ]
    return []


class _RecordingRunner(ModelRunnerHooks):
    """Records the query length of every step its `step_function` ran, and runs Transformers' own."""

    def step_function(self, model: torch.nn.Module, batch_data: dict) -> None:
        self.lengths.append(batch_data["input_ids"].shape[1])
        super().step_function(model, batch_data)


def _check_step_function() -> list[str]:
    """
    An engine compiling its steps (`varlen_compile_config`) pads each step's query tokens to its interval, and runs a
    `ModelRunnerHooks`' `step_function` compiled in their place.
    """
    compiled = CompileConfig(backend="eager", mode="default", fullgraph=False, dynamic=False)
    model, manager, processor = _probe_engine(varlen_compile_config=compiled, q_padding_interval_size=16)
    runner = processor.model_runner = taken_over(processor.model_runner, _RecordingRunner)
    runner.lengths = []
    runner.compile_step_function()
    request_id = manager.add_request([5, 6, 7])
    try:
        with torch.no_grad():
            _run_step(model, processor)
    except Exception as error:  # noqa: BLE001
        return [f"a compiled continuous-batching step ({type(error).__name__}: {error})"]
    if runner.lengths != [16]:
        return [
            "`ModelRunner.compute_batch` running `_forward_process_and_sample` compiled as `_compiled_varlen` "
            f"(used by `ModelRunnerHooks`) on a query padded to `q_padding_interval_size`: it ran {runner.lengths}"
        ]
    if processor.scheduler.active_requests[request_id].generated_len() != 1:
        return ["`ModelRunnerHooks.step_function` running Transformers' `_forward_process_and_sample`"]
    return []


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
        # Named first; the engine probe, which runs that step, reports its failure after it.
        self.assertIn("ContinuousBatchProcessor._generation_step(self, model)", problems[0])

    def test_a_pad_token_no_longer_resolved_is_named(self):
        original = GenerationMixin._prepare_special_tokens

        def _prepare_special_tokens(self, generation_config, *args, **kwargs):
            original(self, generation_config, *args, **kwargs)
            del generation_config._pad_token_tensor

        with mock.patch.object(GenerationMixin, "_prepare_special_tokens", _prepare_special_tokens):
            problems = check_private_apis()
        self.assertEqual(len(problems), 1)
        self.assertIn("_pad_token_tensor", problems[0])


def _schedules_one_token(original):
    def _infer_request_tokens(self, state, *args):
        if state.status == RequestStatus.DECODING:
            state.tokens_to_process = state.tokens_to_process[:1]
        return original(self, state, *args)

    return _infer_request_tokens


def _positions_from_zero(original):
    def prepare_batch_tensors(self, *args, **kwargs):
        original(self, *args, **kwargs)
        self.position_ids[: self.num_q_tokens] = torch.arange(self.num_q_tokens)

    return prepare_batch_tensors


def _pages_kept(original):
    def free_blocks(self, index, block_ids):
        return original(self, index, [])

    return free_blocks


def _token_views_renamed(original):
    def register_cache_tensor(self, *args):
        original(self, *args)
        self.token_views = self._kv_token_views
        del self._kv_token_views

    return register_cache_tensor


def _reads_renamed_views(original):
    def update(self, *args):
        self._kv_token_views = self.token_views
        try:
            return original(self, *args)
        finally:
            del self._kv_token_views

    return update


def _stock_step_function(original):
    def _get_forward_fn(self, use_block_table):
        return partial(ModelRunner._forward_process_and_sample, self), original(self, use_block_table)[1]

    return _get_forward_fn


def _requests_noted(original):
    def update_batch(self):
        original(self)
        for state in self.scheduler.active_requests.values():
            state.noted = True

    return update_batch


class ContinuousBatchingCheckTest(unittest.TestCase):
    """Each behaviour the engine probe relies on, changed in a way Transformers could change it, is named."""

    @parameterized.expand(
        [
            ("scheduling", Scheduler, "_infer_request_tokens", _schedules_one_token, "_infer_request_tokens"),
            ("layout", ContinuousBatchingIOs, "prepare_batch_tensors", _positions_from_zero, "prepare_batch_tensors"),
            ("pages", CachePool, "free_blocks", _pages_kept, "release_pages_past"),
            ("update", ContinuousBatchProcessor, "update_batch", _requests_noted, "update_batch"),
            ("step function", ModelRunner, "_get_forward_fn", _stock_step_function, "_compiled_varlen"),
        ]
    )
    def test_a_changed_behaviour_is_named(self, _, owner, name, change, named):
        with mock.patch.object(owner, name, change(getattr(owner, name))):
            problems = check_continuous_batching()
        self.assertEqual(len(problems), 1, problems)
        self.assertIn(named, problems[0])

    def test_moved_token_views_are_named(self):
        allocator = FullAttentionCacheAllocator
        with (
            mock.patch.object(
                allocator, "register_cache_tensor", _token_views_renamed(allocator.register_cache_tensor)
            ),
            mock.patch.object(allocator, "update", _reads_renamed_views(allocator.update)),
        ):
            problems = check_continuous_batching()
        self.assertEqual(len(problems), 1, problems)
        self.assertIn("_kv_token_views", problems[0])


class TakenOverTest(unittest.TestCase):
    def test_takes_over_the_state_of_an_instance_of_the_transformers_class_only(self):
        class Hooks(BatchProcessorHooks):
            pass

        stock = object.__new__(ContinuousBatchProcessor)
        stock.scheduler = "the scheduler"
        adopted = taken_over(stock, Hooks)
        self.assertIsInstance(adopted, Hooks)
        self.assertIs(type(stock), ContinuousBatchProcessor, "the stock object keeps its class")
        self.assertEqual(adopted.scheduler, "the scheduler")
        with self.assertRaisesRegex(TypeError, "extends ContinuousBatchProcessor"):
            taken_over(object.__new__(ContinuousBatchingManager), Hooks)
