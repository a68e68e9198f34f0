"""
Lookahead inside Transformers' continuous batching (`generate_batch`, `init_continuous_batching`): fp32 tokens
identical to plain continuous batching, fewer forward passes, requests joining and stopping mid-step, the sampled
distribution, each request's own sampling settings, the fallback to one-token steps under load, and the settings it
refuses.
"""

import statistics
import threading
import time
import unittest
from collections.abc import Callable
from functools import partial
from unittest import mock

import torch
from parameterized import parameterized
from torch._dynamo.utils import counters
from transformers import CompileConfig, GenerationConfig
from transformers.generation.configuration_utils import ContinuousBatchingConfig
from transformers.generation.continuous_batching.continuous_api import ContinuousBatchingManager

from transformers_lookahead import LookaheadState, enable_lookahead
from transformers_lookahead.auto_tuning import AUTO_TUNING
from transformers_lookahead.continuous_batching import LookaheadContinuousBatchingManager
from transformers_lookahead.cost_model import StepCostModel, padded_step_cost, padded_table
from transformers_lookahead.engine_compatibility import LookaheadGenerationOutput, request_processors
from utils.distribution_check import homogeneity_p_value
from utils.transformers_compatibility import set_attention_implementation_unchecked

from .test_verification import P_VALUE
from .utils import (
    SMALL_VOCABULARY,
    ForwardCounter,
    checked,
    flat_state,
    random_prompt,
    small_vocabulary_model,
    tiny_model,
)

LENGTHS = [3, 5, 9, 13, 20, 7]
SHAPES = [{"lookahead_window": 4, "lookahead_ngram": 3}, {"lookahead_window": "auto"}]
# A small engine: the default sizes its cache and its (tokens x cache) attention mask from the machine's memory,
# which takes seconds to allocate for every `generate_batch` call.
ENGINE = ContinuousBatchingConfig(num_blocks=128, max_batch_tokens=512)
# Past 8 tokens every token costs as much again: one request gets free room, 16 requests pay for every extra token.
STEEP_AFTER_8 = {1: 1.0, 8: 1.0, 16: 2.0, 32: 4.0, 64: 8.0, 128: 16.0, 256: 32.0}


def _prompts(count: int = len(LENGTHS)) -> list[list[int]]:
    return [random_prompt(LENGTHS[i % len(LENGTHS)], seed=i)[0].tolist() for i in range(count)]


def _config(max_new_tokens: int = 40, **settings) -> GenerationConfig:
    settings = {"do_sample": False, "eos_token_id": -1, "pad_token_id": 0, **settings}
    return GenerationConfig(max_new_tokens=max_new_tokens, **settings)


def _collect_results(test: unittest.TestCase, manager, results: dict, count: int) -> dict:
    """Adds the manager's finished requests to `results` until it holds `count`."""
    while len(results) < count:
        result = manager.get_result(timeout=30)
        test.assertIsNotNone(result, "the engine stopped")
        results[result.request_id] = result
    return results


class ContinuousBatchingExactnessTest(unittest.TestCase):
    @parameterized.expand([("llama",), ("qwen2",)])
    def test_identical_to_plain_generate_batch_in_fewer_passes(self, name):
        # Checked first: the first lookahead call checks the model with passes of its own, not counted here.
        model = checked(enable_lookahead(tiny_model(name, "sdpa"), flat_state()))
        counter = ForwardCounter(model)
        self.addCleanup(counter.handle.remove)
        prompts = _prompts()
        with counter:
            plain = model.generate_batch(prompts, _config(), continuous_batching_config=ENGINE, progress_bar=False)
        plain_passes = counter.count
        self.assertEqual(len(plain), len(prompts))
        expected = model.generate(torch.tensor([prompts[0]]), max_new_tokens=40, do_sample=False)
        self.assertEqual(plain["req_0"].generated_tokens, expected[0, len(prompts[0]) :].tolist())
        for settings in SHAPES:
            with self.subTest(**settings), counter:
                out = model.generate_batch(
                    prompts, _config(**settings), continuous_batching_config=ENGINE, progress_bar=False
                )
                self.assertEqual(list(out), list(plain))
                for request_id, result in out.items():
                    self.assertIsInstance(result, LookaheadGenerationOutput)
                    self.assertEqual(result.generated_tokens, plain[request_id].generated_tokens, request_id)
                    # The first token comes from the prefill; each later step accepted what it says.
                    self.assertEqual(sum(result.accepted_per_step), len(result.generated_tokens) - 1)
                self.assertLess(counter.count, plain_passes)
                self.assertGreater(max(max(result.accepted_per_step) for result in out.values()), 1)

    def test_bfloat16_logits_verified_as_their_float32_copies_would_be(self):
        # The engine verifies a bf16 step's logits in bf16 (rows converted as the walk reads them, the window's top
        # level argmaxed on its bit patterns): every choice must be what float32 copies of the same logits give. A
        # fixed shape keeps both runs' passes the same, so their logits are too.
        model = enable_lookahead(tiny_model("llama", "sdpa").to(torch.bfloat16))
        prompts = _prompts()
        config = _config(lookahead_window=4, lookahead_ngram=3)
        out = model.generate_batch(prompts, config, continuous_batching_config=ENGINE, progress_bar=False)

        def float32_copies(module, args, kwargs, output):
            output.logits = output.logits.float()
            return output

        # The same bf16 passes, their logits handed on as float32 copies: choices and verification read those.
        handle = model.register_forward_hook(float32_copies, with_kwargs=True)
        self.addCleanup(handle.remove)
        reference = model.generate_batch(prompts, config, continuous_batching_config=ENGINE, progress_bar=False)
        self.assertEqual(list(reference), list(out))
        for request_id, result in reference.items():
            self.assertEqual(out[request_id].generated_tokens, result.generated_tokens, request_id)
            self.assertEqual(out[request_id].accepted_per_step, result.accepted_per_step, request_id)
        self.assertGreater(max(max(result.accepted_per_step) for result in out.values()), 1)

    def test_requests_joining_at_different_times_with_their_own_limits(self):
        model = enable_lookahead(tiny_model("llama", "sdpa"), flat_state())
        prompts = _prompts(7)
        limits = [40, 17, 33, 5, 40, 26, 12]
        expected = [
            model.generate(torch.tensor([prompt]), max_new_tokens=limit, do_sample=False)[0, len(prompt) :].tolist()
            for prompt, limit in zip(prompts, limits)
        ]
        results = {}
        manager = model.init_continuous_batching(_config(lookahead_window="auto"), ENGINE)
        self.assertIsInstance(manager, LookaheadContinuousBatchingManager)
        manager.start()
        try:
            first = [manager.add_request(p, max_new_tokens=n) for p, n in zip(prompts[:3], limits[:3])]
            # The others join once the first requests are decoding.
            _collect_results(self, manager, results, 1)
            later = [manager.add_request(p, max_new_tokens=n) for p, n in zip(prompts[3:], limits[3:])]
            _collect_results(self, manager, results, len(prompts))
        finally:
            manager.stop(block=True, timeout=10)
        for request_id, tokens in zip(first + later, expected):
            self.assertIsNone(results[request_id].error)
            self.assertEqual(results[request_id].generated_tokens, tokens, request_id)

    def test_a_request_stopping_inside_a_multi_token_step(self):
        model = enable_lookahead(tiny_model("qwen2", "sdpa"), flat_state())
        prompts = _prompts()
        free = model.generate_batch(
            prompts,
            _config(lookahead_window=4, lookahead_ngram=3),
            continuous_batching_config=ENGINE,
            progress_bar=False,
        )
        # An EOS that falls inside a step that accepted several tokens, not at its last token, and not before.
        request_id, stop = None, None
        for candidate, result in free.items():
            position = 1
            for accepted in result.accepted_per_step:
                tokens = result.generated_tokens
                inside = [p for p in range(position, position + accepted - 1) if tokens[p] not in tokens[:p]]
                if accepted > 1 and inside:
                    request_id, stop = candidate, inside[0]
                    break
                position += accepted
            if request_id is not None:
                break
        self.assertIsNotNone(request_id, "no multi-token step to stop inside")
        eos = free[request_id].generated_tokens[stop]
        plain = model.generate_batch(
            prompts, _config(eos_token_id=eos), continuous_batching_config=ENGINE, progress_bar=False
        )
        out = model.generate_batch(
            prompts,
            _config(eos_token_id=eos, lookahead_window=4, lookahead_ngram=3),
            continuous_batching_config=ENGINE,
            progress_bar=False,
        )
        self.assertEqual(len(plain[request_id].generated_tokens), stop + 1, "plain decoding stops at the EOS")
        for candidate in plain:
            self.assertEqual(out[candidate].generated_tokens, plain[candidate].generated_tokens, candidate)

    def test_streaming_sends_each_accepted_chunk(self):
        # With eager attention, which the engine runs as paged eager.
        model = enable_lookahead(tiny_model("llama", "eager"), flat_state())
        prompt = _prompts(5)[4]
        expected = model.generate(torch.tensor([prompt]), max_new_tokens=40, do_sample=False)[0, len(prompt) :]
        manager = model.init_continuous_batching(_config(lookahead_window="auto"), ENGINE)
        manager.start()
        try:
            request_id = manager.add_request(prompt, max_new_tokens=40, streaming=True)
            sizes = []
            for output in manager.request_id_iter(request_id):
                sizes.append(len(output.generated_tokens))
        finally:
            manager.stop(block=True, timeout=10)
        self.assertEqual(sizes[-1], 40)
        steps = [later - earlier for earlier, later in zip([0] + sizes, sizes)]
        self.assertTrue(all(step >= 1 for step in steps))
        self.assertGreater(max(steps), 1, "some streamed update carries a multi-token step")
        self.assertEqual(output.generated_tokens, expected.tolist())


class _SlowPasses:
    """
    Makes every forward pass of a model take `fixed` seconds more, plus `per_token` seconds for each query token
    past `free_tokens`: an engine whose passes cost what the test says, whatever this machine's speed. Records each
    pass's query tokens.
    """

    def __init__(self, model, fixed: float = 0.0, per_token: float = 0.0, free_tokens: int = 0):
        self.fixed, self.per_token, self.free_tokens = fixed, per_token, free_tokens
        self.queries: list[int] = []
        self.handle = model.register_forward_pre_hook(self._wait, with_kwargs=True)

    def _wait(self, module, args, kwargs):
        queries = kwargs["input_ids"].shape[-1]
        self.queries.append(queries)
        time.sleep(self.fixed + self.per_token * max(0, queries - self.free_tokens))


class ContinuousBatchingLoadTest(unittest.TestCase):
    def test_a_full_batch_takes_one_token_steps(self):
        # The cost table and the engine's passes agree: past 8 query tokens, each token costs as much again.
        steep = LookaheadState(cost_dir=None, memory_dir=None, step_costs=StepCostModel(STEEP_AFTER_8))
        model = enable_lookahead(tiny_model("llama", "sdpa"), steep)
        slow = _SlowPasses(model, fixed=0.004, per_token=0.004, free_tokens=8)
        self.addCleanup(slow.handle.remove)
        prompts = [random_prompt(8, seed=100 + i)[0].tolist() for i in range(16)]
        alone = model.generate_batch(
            prompts[:1],
            _config(24, lookahead_window="auto"),
            continuous_batching_config=ENGINE,
            progress_bar=False,
        )
        full = model.generate_batch(
            prompts, _config(24, lookahead_window="auto"), continuous_batching_config=ENGINE, progress_bar=False
        )
        slow.handle.remove()
        plain = model.generate_batch(prompts, _config(24), continuous_batching_config=ENGINE, progress_bar=False)
        self.assertGreater(max(alone["req_0"].accepted_per_step), 1, "a lone request verifies several tokens")
        for request_id, result in full.items():
            self.assertEqual(result.generated_tokens, plain[request_id].generated_tokens)
            # All 16 prompts have one length and limit: they decode together, every step of a 16-request batch.
            self.assertEqual(set(result.accepted_per_step), {1}, request_id)

    @parameterized.expand(
        [
            # Every query token costs 5 ms: the engine learns that a long step costs what its tokens cost.
            ("tokens_cost", {"per_token": 0.005}, False),
            # 40 ms a pass whatever it holds: extra tokens are about free.
            ("passes_cost", {"fixed": 0.04}, True),
            # Passes as above, but verifying a request's candidates takes the host 160 ms: a step that verifies
            # costs 5 one-token steps, which a random model's candidates never pay for.
            ("verification_costs", {"fixed": 0.04}, False, 0.16),
        ]
    )
    def test_the_engine_prices_steps_by_its_own_steps(self, _, slowness, verifies_several, verification=0.0):
        def slow_verification(choice, row, verdict):
            # Observed as each request's verification ends, inside the step the engine times.
            if row.length > 1:
                time.sleep(verification)

        model = checked(
            enable_lookahead(tiny_model("llama", "sdpa"), flat_state(engine_fit=True, step_observer=slow_verification))
        )
        prompt = random_prompt(8, seed=7)[0].tolist()
        # The table says every step length costs one token: only the engine's own steps tell otherwise.
        slow = _SlowPasses(model, **slowness)
        self.addCleanup(slow.handle.remove)
        out = model.generate_batch(
            [prompt], _config(64, lookahead_window="auto"), continuous_batching_config=ENGINE, progress_bar=False
        )
        self.assertEqual(len(out["req_0"].generated_tokens), 64)
        # The engine fits every step, its prefill included: the steps after `engine_steps_needed` of them are
        # priced by the fit, the ones between the prefill and those by the table.
        needed = AUTO_TUNING.engine_steps_needed
        table_priced, learnt = slow.queries[1:needed], slow.queries[needed:]
        self.assertGreater(len(learnt), 4)
        self.assertGreater(min(table_priced), 16, "the flat table verifies whole windows and trees")
        if verifies_several:
            self.assertGreater(statistics.mean(learnt), 16)
        else:
            # Steps of a few tokens may still pay where acceptance is high (this machine's own pass time adds to
            # the 5 ms per token), but nothing like the table's: 1-2 tokens here, against 65-96 priced by the table.
            self.assertLessEqual(max(learnt), min(table_priced) / 8)
            self.assertLess(statistics.mean(learnt), 3)

    def test_a_new_engine_starts_from_the_last_engines_fit(self):
        model = checked(enable_lookahead(tiny_model("llama", "sdpa"), flat_state(engine_fit=True)))
        prompt = random_prompt(8, seed=7)[0].tolist()
        needed = AUTO_TUNING.engine_steps_needed
        queries = []
        # The flat table says every step length costs one token; each query token costs 5 ms.
        slow = _SlowPasses(model, per_token=0.005)
        self.addCleanup(slow.handle.remove)
        for _ in range(2):  # two `generate_batch` calls: two engines, one after the other
            slow.queries = []
            model.generate_batch(
                [prompt],
                _config(64, lookahead_window="auto"),
                continuous_batching_config=ENGINE,
                progress_bar=False,
            )
            queries.append(slow.queries)
        first, second = queries
        # The first engine prices its first steps by the table (whole windows and trees); the second prices them by
        # the steps the first one timed, from its first decoding step on.
        self.assertGreater(min(first[1:needed]), 16)
        self.assertLessEqual(max(second[1:needed]), min(first[1:needed]) / 8)


class _CountingBackend:
    """
    A dynamo backend that runs each graph as traced (no Inductor), and counts the runs of those traced from the
    engine's step function itself (the first graph of `LookaheadModelRunner.step_function`, which reads its `rows`).
    """

    def __init__(self):
        self.step_runs = 0

    def __call__(self, graph: torch.fx.GraphModule, example_inputs: list) -> Callable:
        inputs = [node.name for node in graph.graph.nodes if node.op == "placeholder"]
        if "l_self_rows" not in inputs:
            return graph.forward

        def run(*args):
            self.step_runs += 1
            return graph.forward(*args)

        return run

    def __deepcopy__(self, memo: dict) -> "_CountingBackend":
        # The engine copies its config: the copy must count here.
        return self


def _compiled_engine(backend: Callable | str = "eager") -> dict:
    """Engine settings that compile its steps with static shapes, padded to 64 query and 256 key tokens."""
    return dict(
        varlen_compile_config=CompileConfig(backend=backend, mode=None, fullgraph=False, dynamic=False),
        q_padding_interval_size=64,
        kv_padding_interval_size=256,
    )


def _record_length(lengths: list[int], choice, row, verdict) -> None:
    lengths.append(row.length)


class ContinuousBatchingCompiledTest(unittest.TestCase):
    """An engine that compiles its steps (and on an accelerator could capture them): padded to its intervals."""

    def test_steps_are_padded_and_compiled_once(self):
        # Graphs another test compiled with another backend would run here uncounted.
        torch._dynamo.reset()
        model = checked(enable_lookahead(tiny_model("llama", "sdpa"), flat_state()))
        backend = _CountingBackend()
        engine = ContinuousBatchingConfig(num_blocks=128, max_batch_tokens=512, **_compiled_engine(backend))
        queries = []
        # Run as it is (a graph break), so that recording a pass adds no guard to the compiled step.
        record = torch.compiler.disable(lambda module, args, kwargs: queries.append(kwargs["input_ids"].shape[-1]))
        handle = model.register_forward_pre_hook(record, with_kwargs=True)
        self.addCleanup(handle.remove)
        prompts = _prompts()
        plain = model.generate_batch(prompts, _config(), continuous_batching_config=ENGINE, progress_bar=False)
        seen = set()
        # The same requests in another order, then other prompt lengths and limits: no shape compiles twice.
        calls = [(prompts, 40), (prompts[3:] + prompts[:3], 40), (_prompts(9)[6:] + prompts[:3], 30)]
        for call, (call_prompts, limit) in enumerate(calls):
            counters.clear()
            queries.clear()
            backend.step_runs = 0
            out = model.generate_batch(
                call_prompts,
                _config(limit, lookahead_window=4, lookahead_ngram=3),
                continuous_batching_config=engine,
                progress_bar=False,
            )
            with self.subTest(call=call):
                self.assertEqual(len(out), len(call_prompts))
                if call == 0:
                    for request_id, result in out.items():
                        self.assertEqual(result.generated_tokens, plain[request_id].generated_tokens, request_id)
                        self.assertGreater(max(result.accepted_per_step), 1)
                self.assertTrue(queries and all(length % 64 == 0 for length in queries), queries)
                # Every pass, the engine's warm-up included, ran compiled.
                self.assertEqual(backend.step_runs, len(queries))
                if call > 0:
                    self.assertLessEqual(set(queries), seen)
                    self.assertEqual(counters["stats"]["unique_graphs"], 0)
                else:
                    self.assertGreater(counters["stats"]["unique_graphs"], 0)
            seen |= set(queries)

    def test_auto_takes_the_room_its_padding_gives(self):
        # Past 8 tokens each token costs as much again: unpadded, "auto" keeps to short steps; padded to 64 tokens,
        # any step up to 64 costs what 64 do.
        lengths = {"plain": [], "padded": []}
        for name, padding in (("plain", {}), ("padded", _compiled_engine())):
            state = LookaheadState(
                cost_dir=None,
                memory_dir=None,
                step_costs=StepCostModel(STEEP_AFTER_8),
                follow_durations=False,
                step_observer=partial(_record_length, lengths[name]),
            )
            model = enable_lookahead(tiny_model("llama", "sdpa"), state)
            engine = ContinuousBatchingConfig(num_blocks=128, max_batch_tokens=512, **padding)
            model.generate_batch(
                _prompts(1),
                _config(24, lookahead_window="auto"),
                continuous_batching_config=engine,
                progress_bar=False,
            )
        self.assertLessEqual(max(lengths["plain"]), 16)
        self.assertGreater(max(lengths["padded"]), 32)

    def test_a_padded_step_costs_as_its_padded_length(self):
        steep = StepCostModel(STEEP_AFTER_8)
        cost = padded_step_cost(steep, requests=3, interval=64)
        # 3 x 21 = 63 tokens pad to 64: as 21 per request do; 3 x 22 = 66 pad to 128: as 42 do.
        self.assertEqual(
            [cost(1), cost(21), cost(22), cost(42), cost(43)], [steep(21)] * 2 + [steep(42)] * 2 + [steep(64)]
        )
        table = padded_table(steep, requests=3, interval=64, longest=100)
        self.assertEqual(
            [table(length) for length in range(1, 101)], [cost(length) / cost(1) for length in range(1, 101)]
        )
        # More requests than the budget has tokens (one-token steps only): still a table.
        self.assertEqual(padded_table(steep, requests=600, interval=64, longest=0)(1), 1.0)


class ContinuousBatchingSamplingTest(unittest.TestCase):
    def test_distribution_equals_plain_continuous_batching_sampling(self):
        model = enable_lookahead(small_vocabulary_model(), flat_state())
        model.set_attn_implementation("sdpa")
        # A repetitive prompt: the pool and the context copy then propose candidates that often get accepted.
        prompt = [3, 4, 5, 3, 4, 5, 3, 4, 5, 3, 4]
        runs, new_tokens = 1200, 5
        counts = {}
        for label, settings in (("plain", {}), ("lookahead", {"lookahead_window": 2, "lookahead_ngram": 3})):
            config = GenerationConfig(
                max_new_tokens=new_tokens, do_sample=True, temperature=0.7, eos_token_id=-1, pad_token_id=0, **settings
            )
            torch.manual_seed(0)
            # 16 pages: about a dozen requests decode at once, so their blocks fit the token budget.
            out = model.generate_batch(
                [prompt] * runs,
                config,
                continuous_batching_config=ContinuousBatchingConfig(num_blocks=16, max_batch_tokens=512),
                progress_bar=False,
            )
            tokens = torch.tensor([result.generated_tokens for result in out.values()])
            counts[label] = torch.stack(
                [torch.bincount(tokens[:, t], minlength=SMALL_VOCABULARY) for t in range(new_tokens)]
            )
            if label == "lookahead":
                multi = sum(max(result.accepted_per_step) > 1 for result in out.values())
                self.assertGreater(multi, runs // 20, "the test must exercise multi-token acceptance")
        for position in range(new_tokens):
            with self.subTest(position=position):
                p_value = homogeneity_p_value(counts["plain"][position], counts["lookahead"][position])
                self.assertGreater(p_value, P_VALUE)


class PerRequestSettingsTest(unittest.TestCase):
    """`per_request_processors=True`, as `transformers serve --continuous-batching` runs the engine."""

    def test_a_request_is_verified_with_its_own_settings(self):
        # A sampling engine: a request with `top_k=1` (what the server sends for a greedy request) decodes plain
        # greedy's tokens, beside a request that samples with its own temperature.
        model = enable_lookahead(tiny_model("llama", "sdpa"), flat_state())
        prompts = _prompts(3)
        expected = [
            model.generate(torch.tensor([prompt]), max_new_tokens=40, do_sample=False)[0, len(prompt) :].tolist()
            for prompt in prompts[:2]
        ]
        engine = ContinuousBatchingConfig(num_blocks=128, max_batch_tokens=512, per_request_processors=True)
        config = _config(do_sample=True, temperature=0.7, top_k=50, lookahead_window=4, lookahead_ngram=3)
        manager = model.init_continuous_batching(config, engine)
        self.assertIsInstance(manager, LookaheadContinuousBatchingManager)
        manager.start()
        try:
            greedy = [manager.add_request(prompt, max_new_tokens=40, top_k=1) for prompt in prompts[:2]]
            manager.add_request(prompts[2], max_new_tokens=40, temperature=0.4)
            results = _collect_results(self, manager, {}, len(prompts))
        finally:
            manager.stop(block=True, timeout=10)
        for request_id, tokens in zip(greedy, expected):
            self.assertIsNone(results[request_id].error)
            self.assertEqual(results[request_id].generated_tokens, tokens, request_id)
        self.assertGreater(max(max(results[request_id].accepted_per_step) for request_id in greedy), 1)

    def test_a_requests_warpers_score_as_the_stock_per_request_ones(self):
        model = enable_lookahead(tiny_model("llama", "sdpa"))
        engine = ContinuousBatchingConfig(num_blocks=128, max_batch_tokens=512, per_request_processors=True)
        config = _config(do_sample=True, temperature=0.7, top_k=20, top_p=0.9, lookahead_window=4)
        per_request = model.init_continuous_batching(config, engine).logit_processor
        self.assertEqual(set(per_request.supported_keys), {"temperature", "top_k", "top_p"})
        scores = torch.randn(1, model.config.vocab_size, generator=torch.Generator().manual_seed(0))
        for settings in ({}, {"temperature": 0.3}, {"top_k": 3}, {"top_p": 0.5, "temperature": 1.5}):
            with self.subTest(**settings):
                state = mock.Mock(logit_processor_kwargs=settings)
                arguments = torch.zeros(per_request.tensors_required, 1, dtype=torch.int32)
                per_request.prepare_tensor_args([mock.Mock(state=state, has_new_token=True)], arguments)
                reference = per_request(None, scores.clone(), arguments)
                own = request_processors(per_request.logits_processor, settings)
                self.assertTrue(torch.equal(own(None, scores.clone()), reference))

    @parameterized.expand([("temperature", -1.0), ("top_k", 0), ("top_p", 1.5)])
    def test_refuses_a_bad_request_setting_before_it_runs(self, setting, value):
        model = checked(enable_lookahead(tiny_model("llama", "sdpa")))
        engine = ContinuousBatchingConfig(num_blocks=128, max_batch_tokens=512, per_request_processors=True)
        config = _config(do_sample=True, temperature=0.7, top_k=20, top_p=0.9, lookahead_window=4)
        counter = ForwardCounter(model)
        self.addCleanup(counter.handle.remove)
        with counter:
            manager = model.init_continuous_batching(config, engine)
            with self.assertRaises(ValueError) as raised:
                manager.add_request(_prompts(1)[0], max_new_tokens=8, **{setting: value})
        self.assertIn(setting, str(raised.exception))
        self.assertEqual(counter.count, 0)


class ContinuousBatchingSetupTest(unittest.TestCase):
    def test_the_cost_table_is_measured_off_the_callers_thread(self):
        # On a CPU the thread that runs forward passes keeps torch's OpenMP workers while it lives, beside the
        # engine's own: the measurement runs in a thread that ends.
        model = enable_lookahead(tiny_model("llama", "sdpa"), LookaheadState(cost_dir=None))
        threads = []
        hook = model.register_forward_pre_hook(lambda *_: threads.append(threading.current_thread()))
        self.addCleanup(hook.remove)
        manager = model.init_continuous_batching(_config(lookahead_window="auto"), ENGINE)
        self.assertIsInstance(manager, LookaheadContinuousBatchingManager)
        self.assertGreater(len(threads), 16, "the cost table was measured")
        self.assertNotIn(threading.current_thread(), threads)
        self.assertFalse(any(thread.is_alive() for thread in threads))

    def test_lookahead_off_is_the_stock_engine(self):
        model = enable_lookahead(tiny_model("llama", "sdpa"))
        for config in (_config(), _config(lookahead_window="off")):
            manager = model.init_continuous_batching(config)
            self.assertIs(type(manager), ContinuousBatchingManager)

    @parameterized.expand(
        [
            ("sliding_layers", "gemma3", {}, {}, "full-attention layers only"),
            ("scheduler", "llama", {"scheduler_type": "prefill_first"}, {}, "scheduler_type='fifo'"),
            ("async", "llama", {"use_async_batching": True}, {}, "use_async_batching=False"),
            (
                "return_sequences",
                "llama",
                {},
                {"num_return_sequences": 2, "do_sample": True},
                "num_return_sequences=1",
            ),
        ]
    )
    def test_refuses_what_it_cannot_serve_before_anything_runs(self, _, name, engine, generation, message):
        model = enable_lookahead(tiny_model(name, "sdpa"))
        counter = ForwardCounter(model)
        self.addCleanup(counter.handle.remove)
        with counter, self.assertRaises(ValueError) as raised:
            model.generate_batch(
                [[1, 2, 3]],
                _config(lookahead_window=4, **generation),
                continuous_batching_config=ContinuousBatchingConfig(**engine),
                progress_bar=False,
            )
        self.assertIn(message, str(raised.exception))
        self.assertIn('lookahead_window="off"', str(raised.exception))
        self.assertEqual(counter.count, 0)

    def test_refuses_a_backend_without_masks(self):
        model = enable_lookahead(tiny_model("llama", "sdpa"))
        set_attention_implementation_unchecked(model, "flash_attention_2")
        with self.assertRaises(ValueError) as raised:
            model.init_continuous_batching(_config(lookahead_window=4), ENGINE)
        self.assertIn("attn_implementation='sdpa'", str(raised.exception))

    def test_engine_time_is_not_spent_on_requests_that_left(self):
        # A cancelled request's lookahead is dropped at the next step.
        model = enable_lookahead(tiny_model("llama", "sdpa"), flat_state())
        manager = model.init_continuous_batching(_config(200, lookahead_window="auto"), ENGINE)
        manager.start()
        try:
            request_id = manager.add_request(_prompts(1)[0], max_new_tokens=200, streaming=True)
            for output in manager.request_id_iter(request_id):
                if len(output.generated_tokens) > 5:
                    break
            manager.cancel_request(request_id)
            kept = manager.add_request(_prompts(2)[1], max_new_tokens=10)
            while (result := manager.get_result(timeout=30)) is not None and result.request_id != kept:
                pass
            self.assertIsNotNone(result)
            deadline = time.time() + 10
            while request_id in manager.batch_processor.lookahead.requests and time.time() < deadline:
                time.sleep(0.05)
            self.assertNotIn(request_id, manager.batch_processor.lookahead.requests)
        finally:
            manager.stop(block=True, timeout=10)


class ProposedServingHookTest(unittest.TestCase):
    def test_a_model_folder_bound_as_the_upstream_proposal_binds_it(self):
        # Stock `from_pretrained` binds the folder's `generate`; the proposal also binds the same file's
        # `init_continuous_batching`, which is what `transformers serve --continuous-batching` calls.
        import functools
        import sys
        import tempfile

        from transformers import AutoModelForCausalLM

        from transformers_lookahead import save_lookahead_model

        with tempfile.TemporaryDirectory() as folder:
            save_lookahead_model(tiny_model("qwen2", "sdpa"), folder, lookahead_window=4, lookahead_ngram=3)
            model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, attn_implementation="sdpa")
        entry = sys.modules[model.generate.func.__module__]
        self.assertIs(type(model.init_continuous_batching(_config(), ENGINE)), ContinuousBatchingManager)
        model.init_continuous_batching = functools.partial(entry.init_continuous_batching, model=model)
        prompts = _prompts(4)
        plain = model.generate_batch(
            prompts, _config(lookahead_window="off"), continuous_batching_config=ENGINE, progress_bar=False
        )
        out = model.generate_batch(prompts, _config(), continuous_batching_config=ENGINE, progress_bar=False)
        for request_id, result in out.items():
            # The folder's own copy of the package's modules made it (a class of the same name, not this one).
            self.assertEqual(type(result).__name__, LookaheadGenerationOutput.__name__)
            self.assertIsNot(type(result), LookaheadGenerationOutput)
            self.assertEqual(result.generated_tokens, plain[request_id].generated_tokens)
        self.assertGreater(max(max(result.accepted_per_step) for result in out.values()), 1)
