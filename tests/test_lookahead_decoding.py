import unittest
from unittest import mock

import torch
from parameterized import parameterized
from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteria, StoppingCriteriaList
from transformers.generation.logits_process import LogitsProcessor
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria
from transformers.generation.streamers import BaseStreamer

from transformers_lookahead import LookaheadDecoderOnlyOutput, LookaheadState, enable_lookahead
from transformers_lookahead.adaptive_planner import compiled_buckets
from transformers_lookahead.adaptive_policy import AdaptiveStepPolicy, PolicyEstimates
from transformers_lookahead.auto_tuning import AUTO_TUNING
from transformers_lookahead.cost_model import COST_GRID, StepCostModel
from transformers_lookahead.lookahead_decoding import TokenStoppingCriteria
from utils.transformers_compatibility import compile_config, set_attention_implementation_unchecked

from .test_step_check import FailsOnSteps, IgnoresCustomMasks, IgnoresPositionIds, tiny
from .utils import (
    EAGER_ONLY,
    TINY_CONFIGS,
    HostReadCounter,
    checked,
    decoding_loop_default_device,
    flat_state,
    left_padded,
    random_prompt,
    tiny_model,
)

MEMORY = {"lookahead_window": "auto", "lookahead_memory": True}
# (W, N, G): the smallest step, lade's settings, a window without a pool, large values, and the adaptive policy
STEP_SHAPES = [(1, 2, 0), (4, 3, 4), (7, 5, 7), (3, 4, 0), (15, 5, 15), ("auto", 5, None)]
ARCHITECTURES = [
    (name, attn) for name in TINY_CONFIGS for attn in ("eager", "sdpa") if attn == "eager" or name not in EAGER_ONLY
]


def _lookahead(model, prompt, **kwargs):
    return model.generate(prompt, do_sample=False, return_dict_in_generate=True, **kwargs)


class LookaheadExactnessTest(unittest.TestCase):
    @parameterized.expand(ARCHITECTURES)
    def test_identical_to_greedy(self, name, attn):
        model = enable_lookahead(tiny_model(name, attn))
        prompt = random_prompt(24, seed=1)
        expected = model.generate(prompt, max_new_tokens=40, do_sample=False)
        for window, ngram, guess in STEP_SHAPES:
            with self.subTest(window=window, ngram=ngram, guess=guess):
                out = _lookahead(
                    model,
                    prompt,
                    max_new_tokens=40,
                    lookahead_window=window,
                    lookahead_ngram=ngram,
                    lookahead_guess=guess,
                )
                self.assertIsInstance(out, LookaheadDecoderOnlyOutput)
                self.assertTrue(torch.equal(out.sequences, expected))
                self.assertEqual(sum(out.accepted_per_step) + 1, 40)
                self.assertEqual(out.num_forward_passes, len(out.accepted_per_step) + 1)

    @parameterized.expand([("gather",), ("refeed",)])
    def test_cache_commit_strategies(self, strategy):
        model = enable_lookahead(tiny_model("qwen2_hybrid"))
        prompt = random_prompt(30, seed=2)
        expected = model.generate(prompt, max_new_tokens=60, do_sample=False)
        out = _lookahead(model, prompt, max_new_tokens=60, lookahead_window=4, lookahead_cache_commit=strategy)
        self.assertTrue(torch.equal(out.sequences, expected))
        self.assertLess(out.num_forward_passes, 60, "the test text must let lookahead accept something")

    @parameterized.expand([(1,), (2,), (3,)])
    def test_prompt_shorter_than_ngram(self, length):
        model = enable_lookahead(tiny_model("llama"))
        prompt = random_prompt(length, seed=4)
        expected = model.generate(prompt, max_new_tokens=30, do_sample=False)
        out = _lookahead(model, prompt, max_new_tokens=30, lookahead_window=5, lookahead_ngram=5)
        self.assertTrue(torch.equal(out.sequences, expected))

    def test_max_new_tokens_one(self):
        model = enable_lookahead(tiny_model("llama"))
        prompt = random_prompt(10)
        out = _lookahead(model, prompt, max_new_tokens=1, lookahead_window=4)
        self.assertTrue(torch.equal(out.sequences, model.generate(prompt, max_new_tokens=1, do_sample=False)))
        self.assertEqual(out.num_forward_passes, 1)

    def test_length_limits_ending_inside_an_accepted_chunk(self):
        model = enable_lookahead(tiny_model("qwen3"))
        prompt = random_prompt(24, seed=1)
        full = _lookahead(model, prompt, max_new_tokens=40, lookahead_window=4)
        # Find a step that accepted several tokens and stop in its middle.
        done, cut = 1, None
        for accepted in full.accepted_per_step:
            if accepted > 1:
                cut = done + 1
                break
            done += accepted
        self.assertIsNotNone(cut, "the test text must contain a multi-token step")
        expected = model.generate(prompt, max_new_tokens=cut, do_sample=False)
        out = _lookahead(model, prompt, max_new_tokens=cut, lookahead_window=4)
        self.assertTrue(torch.equal(out.sequences, expected))
        out = _lookahead(model, prompt, max_length=24 + cut, lookahead_window=4)
        self.assertTrue(torch.equal(out.sequences, expected))

    @parameterized.expand([(False,), (True,)])
    def test_eos_inside_an_accepted_chunk(self, as_list):
        model = enable_lookahead(tiny_model("qwen3"))
        prompt = random_prompt(24, seed=1)
        full = _lookahead(model, prompt, max_new_tokens=40, lookahead_window=4)
        generated = full.sequences[0, 24:].tolist()
        done = 1
        for accepted in full.accepted_per_step:
            if accepted > 1:
                break
            done += accepted
        # The first token of that chunk that has not appeared before is a stop the decoder meets mid-chunk.
        eos = next(t for t in generated[done : done + 2] if t not in generated[:done])
        eos_ids = [eos, 95] if as_list else eos
        expected = model.generate(prompt, max_new_tokens=40, do_sample=False, eos_token_id=eos_ids)
        out = _lookahead(model, prompt, max_new_tokens=40, lookahead_window=4, eos_token_id=eos_ids)
        self.assertTrue(torch.equal(out.sequences, expected))
        self.assertEqual(out.sequences[0, -1].item(), eos)

    def test_learned_positions_near_their_limit(self):
        model = enable_lookahead(tiny_model("gpt2"))
        model.config.n_positions = 48  # GPT-2 cannot embed positions past this: guesses must stay below it
        model.transformer.wpe.weight.data = model.transformer.wpe.weight.data[:48]
        prompt = random_prompt(20, seed=1)
        expected = model.generate(prompt, max_length=48, do_sample=False)
        out = _lookahead(model, prompt, max_length=48, lookahead_window=7)
        self.assertTrue(torch.equal(out.sequences, expected))


class ChainStepsTest(unittest.TestCase):
    """Models that compute consecutive tokens as plain decoding does but cannot take a full step (`StepCheck`)."""

    @parameterized.expand(
        [(model_class.__name__, model_class) for model_class in (IgnoresPositionIds, IgnoresCustomMasks, FailsOnSteps)]
    )
    def test_identical_to_greedy_one_prompt_and_padded(self, _, model_class):
        model = enable_lookahead(tiny(model_class), flat_state())
        prompts = [random_prompt(21, seed=0), random_prompt(9, seed=1)]
        # The second prompt is remembered after the batch: there, the first row's steps accept the remembered text
        # and the second row's accept one token, and the rows keep as many tokens each step (none has an unused slot).
        calls = [{"input_ids": prompts[0]}, {"input_ids": prompts[0]}, left_padded(prompts), {"input_ids": prompts[1]}]
        for settings in ({"lookahead_window": 4, "lookahead_ngram": 3, "lookahead_guess": 4}, MEMORY):
            accepted = []
            for inputs in calls:
                plain = model.generate(**inputs, max_new_tokens=24, do_sample=False, pad_token_id=0)
                out = model.generate(
                    **inputs,
                    max_new_tokens=24,
                    do_sample=False,
                    pad_token_id=0,
                    return_dict_in_generate=True,
                    **settings,
                )
                self.assertTrue(torch.equal(out.sequences, plain), f"{settings}, {inputs['input_ids'].shape}")
                accepted.append(out.accepted_per_step)
            batch = accepted[2]
            self.assertEqual(batch[0], batch[1], "the rows of a batch keep as many tokens every step")
        self.assertGreater(max(accepted[1]), 1, "chain steps accept candidates")

    def test_a_chain_step_holds_one_candidate_and_no_window(self):
        # Checked first: the first lookahead call checks the model with passes of its own, not counted here.
        model = checked(enable_lookahead(tiny(IgnoresPositionIds), flat_state()))
        lengths = []
        model.register_forward_pre_hook(
            lambda module, args, kwargs: lengths.append(kwargs["input_ids"].shape[1]), with_kwargs=True
        )
        prompt = random_prompt(6, seed=1).repeat(1, 4)
        out = _lookahead(model, prompt, max_new_tokens=24, lookahead_window=4, lookahead_ngram=3, lookahead_guess=4)
        # The prefill, then steps of the pending token and at most N - 1 = 2 candidate tokens.
        self.assertEqual(lengths[0], prompt.shape[1])
        self.assertLessEqual(max(lengths[1:]), 3)
        self.assertEqual(len(lengths), out.num_forward_passes)


class RecurrentChainStepsTest(unittest.TestCase):
    """Hybrid models (linear-attention and state-space layers beside attention) and indexed attention."""

    @parameterized.expand(
        [
            ("qwen3_next", "Qwen3NextForCausalLM", True),
            ("inkling_text", "InklingForCausalLM", True),
            ("zaya", "ZayaForCausalLM", True),
            ("deepseek_v32", "DeepseekV32ForCausalLM", False),
        ]
    )
    def test_identical_to_greedy_with_steps_kept_and_undone(self, model_type, class_name, recurrent):
        from .model_zoo import Architecture, build

        steps = []

        def observe(choice, row, verdict):
            steps.append((row.pending_length, len(choice.tree), len(verdict.nodes)))

        # Indexed attention takes multi-token steps within its top-k only (`ChainCommitter.room`): above the
        # contexts here, not the zoo's 4.
        overrides = {} if recurrent else {"index_topk": 64}
        model = enable_lookahead(
            build(Architecture(model_type, class_name, "causal_lm"), **overrides), flat_state(step_observer=observe)
        )
        prompts = [random_prompt(21, seed=0), random_prompt(9, seed=1)]
        # As in `ChainStepsTest`: remembered text makes steps accept several tokens, the batch's rows differently.
        calls = [{"input_ids": prompts[0]}, {"input_ids": prompts[0]}, left_padded(prompts), {"input_ids": prompts[1]}]
        for settings in ({"lookahead_window": 4, "lookahead_ngram": 3, "lookahead_guess": 4}, MEMORY):
            for inputs in calls:
                plain = model.generate(**inputs, max_new_tokens=24, do_sample=False, pad_token_id=0)
                out = model.generate(**inputs, max_new_tokens=24, do_sample=False, pad_token_id=0, **settings)
                self.assertTrue(torch.equal(out, plain), f"{settings}, {inputs['input_ids'].shape}")
        self.assertTrue(any(tree and matched == tree for _, tree, matched in steps), "a step kept all it verified")
        undone = [pending for pending, _, _ in steps if pending > 1]
        if recurrent:
            self.assertTrue(undone, "a step was undone and its tokens fed again")
        else:
            self.assertEqual(undone, [], "entries per token: rejected ones are cropped, nothing is fed again")


class ModelDeviceTest(unittest.TestCase):
    """Every tensor the decoding loop makes goes to the model's device or, on purpose, to the host."""

    @parameterized.expand([(4, "dynamic"), ("auto", "dynamic"), (4, "static"), ("auto", "static")])
    def test_greedy_with_another_default_device(self, window, cache):
        model = enable_lookahead(tiny_model("qwen3"), flat_state())
        # A left-padded batch where the cache takes one (a static cache takes one row per call).
        inputs = {"input_ids": random_prompt(24, seed=1)}
        if cache == "dynamic":
            inputs = left_padded([random_prompt(24, seed=1), random_prompt(17, seed=2)])
        kwargs = {"max_new_tokens": 30, "cache_implementation": cache}
        expected = model.generate(**inputs, do_sample=False, **kwargs)
        # "auto" plans with a flat table: on a tiny model what it verifies would depend on this machine's timings.
        with decoding_loop_default_device("meta"):
            out = _lookahead(model, None, **inputs, lookahead_window=window, **kwargs)
        self.assertTrue(torch.equal(out.sequences, expected))
        self.assertLess(out.num_forward_passes, 30, "the test text must let lookahead accept something")

    def test_cost_table_measured_with_another_default_device(self):
        # What a fresh state's first "auto" call measures, inside the decoding loop.
        model = tiny_model("qwen3")
        with decoding_loop_default_device("meta"), torch.device("meta"):
            table = LookaheadState(cost_dir=None).cost_model(model)
        self.assertEqual(table.lengths, list(COST_GRID), "every step length of the grid was timed")
        self.assertEqual(table(1), 1.0)
        self.assertGreaterEqual(table(64), 1.0)

    def test_suffix_memory_with_another_default_device(self):
        model = enable_lookahead(tiny_model("llama"))
        prompt = random_prompt(24, seed=5)
        expected = model.generate(prompt, max_new_tokens=30, do_sample=False)
        with decoding_loop_default_device("meta"):
            first, again = (
                _lookahead(model, prompt, max_new_tokens=30, lookahead_window="auto", lookahead_memory=True)
                for _ in range(2)
            )
        self.assertTrue(torch.equal(first.sequences, expected) and torch.equal(again.sequences, expected))
        self.assertLess(again.num_forward_passes, first.num_forward_passes, "the second call must use the memory")

    def test_sampling_with_another_default_device(self):
        model = enable_lookahead(tiny_model("llama"))
        prompt = random_prompt(24, seed=3)
        kwargs = {"max_new_tokens": 30, "do_sample": True, "lookahead_window": 4}
        torch.manual_seed(0)
        expected = model.generate(prompt, **kwargs)
        torch.manual_seed(0)
        with decoding_loop_default_device("meta"):
            out = model.generate(prompt, **kwargs)
        self.assertTrue(torch.equal(out, expected))


class RecordingStreamer(BaseStreamer):
    def __init__(self):
        self.chunks = []
        self.ended = False

    def put(self, value):
        self.chunks.append(value.reshape(-1).tolist())

    def end(self):
        self.ended = True


class LookaheadGenerateBehaviourTest(unittest.TestCase):
    def setUp(self):
        self.model = enable_lookahead(tiny_model("llama"))
        self.prompt = random_prompt(24, seed=1)

    def test_default_generate_is_untouched(self):
        out = self.model.generate(self.prompt, max_new_tokens=10, do_sample=False, return_dict_in_generate=True)
        self.assertNotIsInstance(out, LookaheadDecoderOnlyOutput)

    def test_generation_config_fields(self):
        expected = self.model.generate(self.prompt, max_new_tokens=30, do_sample=False)
        config = GenerationConfig(lookahead_window=4, max_new_tokens=30, return_dict_in_generate=True)
        out = self.model.generate(self.prompt, generation_config=config)
        self.assertIsInstance(out, LookaheadDecoderOnlyOutput)
        self.assertTrue(torch.equal(out.sequences, expected))
        self.model.generation_config.lookahead_window = 4
        try:
            out = self.model.generate(self.prompt, max_new_tokens=30, return_dict_in_generate=True)
        finally:
            del self.model.generation_config.lookahead_window
        self.assertIsInstance(out, LookaheadDecoderOnlyOutput)
        self.assertTrue(torch.equal(out.sequences, expected))

    def test_output_scores_and_logits(self):
        kwargs = {"max_new_tokens": 25, "do_sample": False, "return_dict_in_generate": True}
        kwargs.update(output_scores=True, output_logits=True, repetition_penalty=1.3)
        expected = self.model.generate(self.prompt, **kwargs)
        out = self.model.generate(self.prompt, lookahead_window=4, **kwargs)
        self.assertTrue(torch.equal(out.sequences, expected.sequences))
        self.assertEqual(len(out.scores), 25)
        self.assertEqual(len(out.logits), 25)
        for got, want in zip(out.scores, expected.scores):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        for got, want in zip(out.logits, expected.logits):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        self.assertEqual(out.cache.get_seq_length(), expected.cache.get_seq_length())

    @parameterized.expand(
        [
            ("repetition_penalty", {"repetition_penalty": 1.5}),
            ("no_repeat_ngram_size", {"no_repeat_ngram_size": 2}),
            ("bad_words_ids", {"bad_words_ids": [[5], [7, 8]]}),
            ("sequence_bias", {"sequence_bias": {(9,): 3.0, (10, 11): -2.0}}),
            ("suppress_tokens", {"suppress_tokens": [3, 4, 5]}),
            ("begin_suppress_tokens", {"begin_suppress_tokens": [6]}),
            ("min_new_tokens", {"min_new_tokens": 20, "eos_token_id": 9}),
            ("forced_eos", {"forced_eos_token_id": 9, "max_new_tokens": 17}),
            ("length_penalty_decay", {"exponential_decay_length_penalty": (5, 1.5), "eos_token_id": 9}),
        ]
    )
    def test_logits_processors(self, _, processor_kwargs):
        kwargs = {"max_new_tokens": 30, "do_sample": False, **processor_kwargs}
        expected = self.model.generate(self.prompt, **kwargs)
        out = self.model.generate(self.prompt, lookahead_window=4, lookahead_ngram=3, **kwargs)
        self.assertTrue(torch.equal(out, expected))

    def test_user_processor_and_prefix_allowed_tokens(self):
        class Ban(LogitsProcessor):
            def __call__(self, input_ids, scores):
                scores = scores.clone()
                scores[:, input_ids[0, -1] % 7 + 2] = -float("inf")
                return scores

        def allowed(batch_id, ids):
            return list(range(2, 60)) if len(ids) % 2 else list(range(30, 96))

        kwargs = {"max_new_tokens": 30, "do_sample": False}
        kwargs.update(logits_processor=LogitsProcessorList([Ban()]), prefix_allowed_tokens_fn=allowed)
        expected = self.model.generate(self.prompt, **kwargs)
        out = self.model.generate(self.prompt, lookahead_window=4, **kwargs)
        self.assertTrue(torch.equal(out, expected))

    def test_custom_stopping_criteria(self):
        class StopAfterToken(StoppingCriteria):
            def __call__(self, input_ids, scores, **kwargs):
                return torch.tensor([input_ids.shape[1] >= 24 + 13])

        kwargs = {
            "max_new_tokens": 30,
            "do_sample": False,
            "stopping_criteria": StoppingCriteriaList([StopAfterToken()]),
        }
        expected = self.model.generate(self.prompt, **kwargs)
        out = self.model.generate(self.prompt, lookahead_window=4, **kwargs)
        self.assertEqual(expected.shape[1], 24 + 13)
        self.assertTrue(torch.equal(out, expected))

    def test_max_time(self):
        # A clock that moves one second each time the criterion reads it (once per appended token): the budget runs
        # out at the same token for both, after lookahead steps have accepted several tokens at once.
        def ticking_clock():
            ticks = iter(range(10_000))
            return mock.patch("transformers.generation.stopping_criteria.time.time", side_effect=lambda: next(ticks))

        common = {"max_new_tokens": 60, "do_sample": False, "max_time": 30.5}
        with ticking_clock():
            expected = self.model.generate(self.prompt, **common)
        with ticking_clock():
            out = self.model.generate(self.prompt, lookahead_window=4, return_dict_in_generate=True, **common)
        self.assertEqual(expected.shape[1], self.prompt.shape[1] + 31)
        self.assertTrue(torch.equal(out.sequences, expected))
        self.assertGreater(max(out.accepted_per_step), 1, "the budget must stop a call that speculates")

    def test_streamer_receives_the_same_tokens(self):
        plain, lookahead = RecordingStreamer(), RecordingStreamer()
        self.model.generate(self.prompt, max_new_tokens=30, do_sample=False, streamer=plain)
        self.model.generate(self.prompt, max_new_tokens=30, do_sample=False, streamer=lookahead, lookahead_window=4)
        self.assertTrue(plain.ended and lookahead.ended)
        self.assertEqual(lookahead.chunks[0], plain.chunks[0], "the prompt comes first")
        self.assertEqual(sum(lookahead.chunks[1:], []), sum(plain.chunks[1:], []))

    @parameterized.expand(
        [
            ("num_beams", {"num_beams": 2}, "cannot be combined with `num_beams`"),
            ("prompt_lookup", {"prompt_lookup_num_tokens": 3}, "cannot be combined with `prompt_lookup_num_tokens`"),
            ("no_cache", {"use_cache": False}, "needs `use_cache=True`"),
            ("custom_generate", {"custom_generate": "some/repo"}, "cannot be combined with `custom_generate`"),
            (
                "quantized_cache",
                {"cache_implementation": "quantized"},
                "cache_implementation='quantized' cannot be used",
            ),
            ("attentions", {"output_attentions": True, "return_dict_in_generate": True}, "output_attentions"),
            (
                "window",
                {"lookahead_window": 0},
                '`lookahead_window` must be an integer >= 1 and <= 64, or "auto", or "off" to turn it off, got 0',
            ),
            ("ngram", {"lookahead_ngram": 1}, '`lookahead_ngram` must be an integer >= 2 and <= 16, or "auto", got 1'),
            (
                "guess",
                {"lookahead_guess": -2},
                '`lookahead_guess` must be an integer >= 0 and <= 64, or "auto", got -2',
            ),
            # Tried by a user: this window once tried to allocate 16 TB before failing.
            ("huge_window", {"lookahead_window": 1_000_000}, "`lookahead_window` must be an integer >= 1 and <= 64"),
            ("huge_step", {"lookahead_window": 64, "lookahead_ngram": 16}, "make a step of up to 1921 tokens"),
        ]
    )
    def test_refused_settings(self, _, kwargs, message):
        kwargs = {"lookahead_window": 4, "max_new_tokens": 5, **kwargs}
        passes = []
        hook = self.model.register_forward_hook(lambda *_: passes.append(1))
        self.addCleanup(hook.remove)
        with self.assertRaisesRegex(ValueError, message):
            self.model.generate(self.prompt, **kwargs)
        self.assertEqual(passes, [], "refused before any forward pass")

    def test_refused_inputs_embeds(self):
        passes = []
        hook = self.model.register_forward_hook(lambda *_: passes.append(1))
        self.addCleanup(hook.remove)
        embeds = self.model.get_input_embeddings()(self.prompt)
        with self.assertRaisesRegex(ValueError, "needs the prompt as `input_ids`.*got `inputs_embeds`"):
            self.model.generate(inputs_embeds=embeds, max_new_tokens=5, lookahead_window=4)
        self.assertEqual(passes, [], "refused before any forward pass")

    def test_refused_assistant(self):
        with self.assertRaisesRegex(ValueError, "cannot be combined with `assistant_model`"):
            self.model.generate(self.prompt, max_new_tokens=5, lookahead_window=4, assistant_model=tiny_model("llama"))

    def test_refused_attention_backend(self):
        model = enable_lookahead(tiny_model("llama"))
        set_attention_implementation_unchecked(model, "flash_attention_2")
        with self.assertRaisesRegex(ValueError, "attn_implementation='flash_attention_2'.*'eager', 'sdpa'"):
            model.generate(self.prompt, max_new_tokens=5, lookahead_window=4)

    def test_refused_encoder_decoder(self):
        from transformers import T5Config, T5ForConditionalGeneration

        config = T5Config(
            vocab_size=96, d_model=16, d_ff=32, num_layers=1, num_heads=2, d_kv=8, decoder_start_token_id=0
        )
        model = enable_lookahead(T5ForConditionalGeneration(config).eval())
        with self.assertRaisesRegex(ValueError, "encoder-decoder model"):
            model.generate(self.prompt, max_new_tokens=5, lookahead_window=4)


class RecallingState(LookaheadState):
    """A state that records what each call recalled for its policies (`None`: the call started from the priors)."""

    def __init__(self):
        super().__init__()
        self.recalled: list[PolicyEstimates | None] = []

    def recall(self, shape: tuple) -> PolicyEstimates | None:
        learnt = super().recall(shape)
        self.recalled.append(learnt)
        return learnt


class EstimateCarryOverTest(unittest.TestCase):
    """`"auto"` calls start from what the previous call of their kind (greedy or sampled) on the model learnt."""

    def test_greedy_calls_carry_their_estimates(self):
        state = RecallingState()
        model = enable_lookahead(tiny_model("llama"), state)
        prompt = random_prompt(24, seed=1)
        expected = model.generate(prompt, max_new_tokens=30, do_sample=False)
        first = model.generate(prompt, max_new_tokens=30, do_sample=False, lookahead_window="auto")
        self.assertEqual(state.recalled, [None], "the first call starts from the priors")
        second = model.generate(prompt, max_new_tokens=30, do_sample=False, lookahead_window="auto")
        self.assertTrue(torch.equal(first, expected))
        self.assertTrue(torch.equal(second, expected))
        self.assertEqual(len(state.recalled), 2)
        carried = state.recalled[1]
        self.assertIsNotNone(carried)
        self.assertNotEqual(carried.match_rate, AdaptiveStepPolicy(None, 1, 4, context_depth=8).estimates().match_rate)

    def test_sampled_calls_carry_their_own_and_stay_reproducible(self):
        state = RecallingState()
        model = enable_lookahead(tiny_model("llama"), state)
        prompt = random_prompt(24, seed=1)
        torch.manual_seed(3)
        sampled = model.generate(prompt, max_new_tokens=30, do_sample=True, lookahead_window="auto")
        model.generate(prompt, max_new_tokens=30, do_sample=False, lookahead_window="auto")
        self.assertEqual(state.recalled, [None, None], "greedy calls do not start from sampled estimates")
        torch.manual_seed(3)
        again = model.generate(prompt, max_new_tokens=30, do_sample=True, lookahead_window="auto")
        self.assertEqual(len(state.recalled), 3)
        self.assertIsNotNone(state.recalled[2], "the second sampled call starts from the first one's estimates")
        self.assertTrue(torch.equal(again, sampled), "a seed must reproduce a sampled call whatever came before")


# A flat table (every step costs one token's, as on an accelerator) and a curve like a CPU's with native bf16.
FLAT_COSTS = {1: 1.0, 2: 1.0}
RISING_COSTS = {1: 1.0, 2: 1.0, 4: 1.0, 8: 1.06, 16: 1.23, 32: 1.65}


class CompiledBucketsTest(unittest.TestCase):
    """A compiled step forward pass sees one shape per bucket and one for a single token, in every call."""

    @parameterized.expand(
        [
            ("flat: one wide bucket", FLAT_COSTS, 57, 1),
            ("rising: a few", RISING_COSTS, 57, 3),
            ("steep: one small", {1: 1.0, 2: 1.67, 8: 1.67, 16: 1.99}, 57, 1),
        ]
    )
    def test_buckets_follow_the_cost_curve(self, _, costs, longest, count):
        table = StepCostModel(costs)
        buckets = compiled_buckets(table, longest)
        self.assertEqual(len(buckets), count, buckets)
        self.assertEqual(list(buckets), sorted(buckets))
        self.assertLessEqual(buckets[-1], longest)
        self.assertLessEqual(table(buckets[-1]), AUTO_TUNING.compiled_step_cost)
        for shorter, longer in zip(buckets, buckets[1:]):
            self.assertGreaterEqual(table(longer), AUTO_TUNING.compiled_bucket_ratio * table(shorter))

    @parameterized.expand([("flat", FLAT_COSTS), ("rising", RISING_COSTS)])
    def test_no_recompilation_across_prompts_and_calls(self, _, costs):
        import torch._dynamo

        state = LookaheadState(cost_dir=None, step_costs=StepCostModel(costs), follow_durations=False)
        model = enable_lookahead(tiny_model("llama"), state=state)
        # fullgraph: a graph break inside the step forward fails the call. The eager backend traces and guards as
        # inductor does, without generating code.
        compiled = compile_config(backend="eager", mode="default", fullgraph=True)
        # One cache shape for every prompt: room for the longest prompt, the new tokens and the widest step.
        common = {"max_new_tokens": 40, "do_sample": False, "cache_implementation": "static", "max_cache_len": 512}
        prompts = [random_prompt(length, seed=length) for length in (12, 20, 31)]
        torch._dynamo.reset()
        expected = [model.generate(prompt, **common, compile_config=compiled) for prompt in prompts]
        torch._dynamo.utils.counters.clear()
        steps = set()
        for _ in range(2):
            for prompt, plain in zip(prompts, expected):
                out = model.generate(
                    prompt, **common, compile_config=compiled, lookahead_window="auto", return_dict_in_generate=True
                )
                self.assertTrue(torch.equal(out.sequences, plain))
                steps.update(out.accepted_per_step)
        self.assertGreater(max(steps), 1, "multi-token steps must have run")
        self.assertEqual(sum(torch._dynamo.utils.counters["recompiles"].values()), 0)
        # Lookahead's own one-token step (its arguments differ from plain greedy's) and one graph per bucket.
        buckets = compiled_buckets(StepCostModel(costs), 1024)
        self.assertLessEqual(torch._dynamo.utils.counters["stats"]["unique_graphs"], 1 + len(buckets))


class KeepingStreamer(BaseStreamer):
    """Keeps what it is given without reading it: the values a streamer reads are its own business."""

    def __init__(self):
        self.values = []

    def put(self, value):
        self.values.append(value)

    def end(self):
        pass


class HostTransfersTest(unittest.TestCase):
    """
    A greedy step reads the device once: the model's choices at the rows it kept, after its forward pass. Nothing
    else of the step (planning, layout, cache commit, the window, the cache's length, stopping) waits for the device.
    """

    FIXED = {"lookahead_window": 7, "lookahead_ngram": 5, "lookahead_guess": 7}

    @parameterized.expand(
        [
            ("one sequence", FIXED, 1),
            ("auto", {"lookahead_window": "auto"}, 1),
            ("batch", FIXED, 2),
            ("static cache", {**FIXED, "cache_implementation": "static"}, 1),
            ("eos and streamer", {**FIXED, "eos_token_id": 5, "streamer": "yes"}, 1),
        ]
    )
    def test_one_read_per_step(self, _, settings, batch):
        state = LookaheadState(cost_dir=None, step_costs=StepCostModel(FLAT_COSTS), follow_durations=False)
        # Checked first: the first lookahead call checks the model with passes of its own, not counted here.
        model = checked(enable_lookahead(tiny_model("llama"), state=state))
        prompts = [random_prompt(30 + 10 * row, seed=row) for row in range(batch)]
        inputs = left_padded(prompts) if batch > 1 else {"input_ids": prompts[0]}
        if settings.get("streamer"):
            settings = {**settings, "streamer": KeepingStreamer()}
        for method in ("greedy", "lookahead"):
            kwargs = settings if method == "lookahead" else {}
            with self.subTest(method), HostReadCounter(model) as counter:
                out = model.generate(
                    **inputs, max_new_tokens=40, do_sample=False, return_dict_in_generate=True, **kwargs
                )
            # Segment 1 follows the prefill (the first token, the prompt's ids, the static cache's length); the
            # last one also builds the outputs.
            steps = counter.segments[2:-1]
            if method == "lookahead":
                accepted = out.accepted_per_step
                self.assertGreater(max(sum(accepted, ()) if batch > 1 else accepted), 1, "multi-token steps must run")
            self.assertGreater(len(steps), 10)
            self.assertEqual([len(reads) for reads in steps if len(reads) != 1], [], [r for r in steps if len(r) != 1])
            self.assertLessEqual(len(counter.segments[-1]), 2, counter.segments[-1])


class TokenStoppingCriteriaTest(unittest.TestCase):
    def test_decides_as_the_default_criteria(self):
        criteria = StoppingCriteriaList([MaxLengthCriteria(6), EosTokenCriteria([2, 5])])
        stops = TokenStoppingCriteria.of(criteria)
        for tokens in ([1, 3, 4], [1, 3, 2], [1, 3, 5], [1, 3, 4, 4, 4, 4], [1, 3, 4, 4, 4, 2, 4]):
            with self.subTest(tokens=tokens):
                expected = bool(criteria(torch.tensor([tokens]), None).any())
                self.assertEqual(stops(len(tokens), tokens[-1]), expected)

    def test_other_criteria_are_left_to_themselves(self):
        class Never(StoppingCriteria):
            def __call__(self, input_ids, scores, **kwargs):
                return torch.zeros(input_ids.shape[0], dtype=torch.bool)

        self.assertIsNone(TokenStoppingCriteria.of(StoppingCriteriaList([MaxLengthCriteria(6), Never()])))
        # Past `max_position_embeddings`, `MaxLengthCriteria` warns: the criteria themselves are asked there.
        stops = TokenStoppingCriteria.of(StoppingCriteriaList([MaxLengthCriteria(9, max_position_embeddings=4)]))
        self.assertFalse(stops(4, 1))
        self.assertIsNone(stops(5, 1))
