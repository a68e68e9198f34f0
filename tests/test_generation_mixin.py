import tempfile
import threading
import unittest

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from parameterized import parameterized
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoModelForCausalLM, GenerationConfig, LlamaForCausalLM, PreTrainedTokenizerFast, pipeline

import transformers_lookahead
from transformers_lookahead import LookaheadDecoderOnlyOutput, LookaheadGenerationMixin, enable_lookahead
from transformers_lookahead.compatibility import attention_implementation
from transformers_lookahead.generation_mixin import is_lookahead_enabled

from .utils import VOCAB, random_prompt, tiny_model


def tiny_tokenizer():
    """A word-level tokenizer over the tiny vocabulary: token i is the word `w{i}`."""
    vocab = {"<pad>": 0, "<s>": 1, **{f"w{i}": i for i in range(2, VOCAB)}}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", bos_token="<s>")


PROMPT_TEXT = " ".join(f"w{i}" for i in [5, 9, 33, 12, 5, 9, 33, 40, 41, 7, 5, 9])


class EnableLookaheadTest(unittest.TestCase):
    def test_enable_binds_generate_and_keeps_the_class(self):
        model, other = tiny_model("llama"), tiny_model("llama")
        original = type(model)
        self.assertIs(enable_lookahead(model), model)
        self.assertIs(type(model), original, "the class stays as it was")
        self.assertTrue(is_lookahead_enabled(model))
        self.assertFalse(is_lookahead_enabled(other))
        bound, state = model.generate, model.lookahead_state
        enable_lookahead(model)
        self.assertIs(model.generate, bound, "idempotent")
        self.assertIs(model.lookahead_state, state, "the state is kept")
        prompt = random_prompt(20, seed=2)
        expected = other.generate(prompt, max_new_tokens=20, do_sample=False)
        self.assertTrue(torch.equal(model.generate(prompt, max_new_tokens=20, do_sample=False), expected))
        out = model.generate(
            prompt, max_new_tokens=20, do_sample=False, lookahead_window=4, return_dict_in_generate=True
        )
        self.assertIsInstance(out, LookaheadDecoderOnlyOutput)
        self.assertTrue(torch.equal(out.sequences, expected))

    def test_an_enabled_model_saves_as_stock_and_a_mixin_class_keeps_its_fields(self):
        model = enable_lookahead(tiny_model("llama"))
        with tempfile.TemporaryDirectory() as tmp:
            model.save_pretrained(tmp)
            reloaded = AutoModelForCausalLM.from_pretrained(tmp)
        self.assertEqual(reloaded.config.architectures, ["LlamaForCausalLM"])
        self.assertFalse(is_lookahead_enabled(reloaded))

        class LookaheadLlama(LookaheadGenerationMixin, LlamaForCausalLM):
            pass

        mixed = LookaheadLlama(model.config)
        mixed.load_state_dict(model.state_dict())
        mixed.generation_config.lookahead_window = 6
        mixed.generation_config.lookahead_ngram = 3
        with tempfile.TemporaryDirectory() as tmp:
            mixed.save_pretrained(tmp)
            config = GenerationConfig.from_pretrained(tmp)
        self.assertEqual((config.lookahead_window, config.lookahead_ngram), (6, 3))
        prompt = random_prompt(20, seed=2)
        expected = model.generate(prompt, max_new_tokens=20, do_sample=False)
        out = mixed.generate(prompt, max_new_tokens=20, do_sample=False, return_dict_in_generate=True)
        self.assertIsInstance(out, LookaheadDecoderOnlyOutput, "the class's lookahead fields are picked up")
        self.assertTrue(torch.equal(out.sequences, expected))

    def test_enable_runs_no_forward_pass_and_the_first_call_checks_the_model(self):
        model = tiny_model("llama")
        passes = []
        model.register_forward_hook(lambda *args: passes.append(1))
        enable_lookahead(model)
        self.assertEqual(passes, [], "enabling runs nothing")
        self.assertIsNone(model.lookahead_state.step_check.chain_reason(model))
        prompt = random_prompt(12, seed=4)
        model.generate(prompt, max_new_tokens=4, do_sample=False)
        self.assertEqual(len(passes), 4, "a call without lookahead runs plain decoding only")
        passes.clear()
        model.generate(prompt, max_new_tokens=4, do_sample=False, lookahead_window=3)
        self.assertGreater(len(passes), 4, "the first lookahead call runs the step check's passes too")
        passes.clear()
        out = model.generate(
            prompt, max_new_tokens=4, do_sample=False, lookahead_window=3, return_dict_in_generate=True
        )
        self.assertEqual(len(passes), out.num_forward_passes, "the verdict is remembered")

    def test_a_plain_and_a_lookahead_thread_on_one_model_are_both_exact(self):
        # Grouped key/value heads (4 heads, 2 KV heads): the attention a step runs is the model's own, and nothing
        # of the model is written around a pass, so a plain call running meanwhile computes what it computes alone.
        model = enable_lookahead(tiny_model("llama"))
        prompts = [random_prompt(16 + 4 * seed, seed=seed) for seed in range(4)]
        expected = [model.generate(prompt, max_new_tokens=24, do_sample=False) for prompt in prompts]
        model.generate(prompts[0], max_new_tokens=4, do_sample=False, lookahead_window=4)
        config_before = dict(vars(model.config))
        # What every pass of either thread runs under, as the model's attention layers read it.
        seen = set()
        model.register_forward_pre_hook(lambda module, args: seen.add(attention_implementation(module)))
        results: dict[str, list[torch.Tensor]] = {"plain": [], "lookahead": []}

        def decode(name: str, settings: dict) -> None:
            for _ in range(3):
                for prompt in prompts:
                    results[name].append(model.generate(prompt, max_new_tokens=24, do_sample=False, **settings))

        threads = [
            threading.Thread(target=decode, args=("plain", {})),
            threading.Thread(target=decode, args=("lookahead", {"lookahead_window": 4})),
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=300)
        for name, outputs in results.items():
            self.assertEqual(len(outputs), 3 * len(prompts), name)
            for index, output in enumerate(outputs):
                self.assertTrue(torch.equal(output, expected[index % len(prompts)]), f"{name}, call {index}")
        self.assertEqual(seen, {"sdpa"}, "no pass runs under another attention name")
        self.assertEqual(dict(vars(model.config)), config_before, "the model's config is as it was")

    def test_rejects_non_generative_objects(self):
        with self.assertRaisesRegex(TypeError, "generative `PreTrainedModel`"):
            enable_lookahead(torch.nn.Linear(2, 2))


class CustomGenerateTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory()
        cls.folder = transformers_lookahead.write_custom_generate(cls.tmp.name).parent

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    @parameterized.expand(
        [
            ("callable", {"custom_generate": transformers_lookahead.generate, "lookahead_window": 4}),
            ("callable_default_window", {"custom_generate": transformers_lookahead.generate}),
            (
                "hub_folder",
                {
                    "custom_generate": "FOLDER",
                    "trust_remote_code": True,
                    "lookahead_window": 4,
                },
            ),
            (
                "hub_folder_default_window",
                {"custom_generate": "FOLDER", "trust_remote_code": True},
            ),
        ]
    )
    def test_on_a_model_that_was_not_enabled(self, _, kwargs):
        if kwargs["custom_generate"] == "FOLDER":
            kwargs = {**kwargs, "custom_generate": str(self.folder)}
        model = tiny_model("qwen2")
        prompt = random_prompt(24, seed=1)
        expected = model.generate(prompt, max_new_tokens=30, do_sample=False)
        out = model.generate(prompt, max_new_tokens=30, do_sample=False, return_dict_in_generate=True, **kwargs)
        # A folder's modules are loaded as their own copies: the output is the folder's `LookaheadDecoderOnlyOutput`.
        self.assertEqual(type(out).__name__, LookaheadDecoderOnlyOutput.__name__)
        self.assertTrue(torch.equal(out.sequences, expected))
        if kwargs.get("lookahead_window") == 4:  # "auto" takes one-token steps where this CPU prices them so
            self.assertLess(out.num_forward_passes, 30)


class PipelineTest(unittest.TestCase):
    def setUp(self):
        self.model = enable_lookahead(tiny_model("llama"))
        self.tokenizer = tiny_tokenizer()

    def test_pipeline_with_lookahead_argument(self):
        pipe = pipeline("text-generation", model=self.model, tokenizer=self.tokenizer)
        expected = pipe(PROMPT_TEXT, do_sample=False, max_new_tokens=20)
        out = pipe(PROMPT_TEXT, do_sample=False, max_new_tokens=20, lookahead_window=4)
        self.assertEqual(out, expected)
        self.assertGreater(len(out[0]["generated_text"]), len(PROMPT_TEXT))

    def test_pipeline_chat_messages_and_return_full_text(self):
        self.tokenizer.chat_template = "{% for message in messages %}{{ message['content'] }} {% endfor %}"
        pipe = pipeline("text-generation", model=self.model, tokenizer=self.tokenizer)
        messages = [{"role": "user", "content": PROMPT_TEXT}]
        for kwargs in ({}, {"return_full_text": False}):
            with self.subTest(**kwargs):
                expected = pipe(messages, do_sample=False, max_new_tokens=20, **kwargs)
                out = pipe(messages, do_sample=False, max_new_tokens=20, lookahead_window=4, **kwargs)
                self.assertEqual(out, expected)
        text = pipe(PROMPT_TEXT, do_sample=False, max_new_tokens=20, lookahead_window=4, return_full_text=False)
        self.assertFalse(text[0]["generated_text"].startswith(PROMPT_TEXT))

    def test_pipeline_with_generation_config_fields(self):
        pipe = pipeline("text-generation", model=self.model, tokenizer=self.tokenizer)
        expected = pipe(PROMPT_TEXT, do_sample=False, max_new_tokens=20)
        self.model.generation_config.lookahead_window = 4
        try:
            out = pipe(PROMPT_TEXT, do_sample=False, max_new_tokens=20)
            # The pipeline samples by default: with a fixed seed, lookahead sampling is reproducible.
            torch.manual_seed(7)
            sampled = pipe(PROMPT_TEXT, max_new_tokens=20)
            torch.manual_seed(7)
            self.assertEqual(pipe(PROMPT_TEXT, max_new_tokens=20), sampled)
        finally:
            del self.model.generation_config.lookahead_window
        self.assertEqual(out, expected)


class PropertyTest(unittest.TestCase):
    models = {name: enable_lookahead(tiny_model(name)) for name in ("llama", "gpt2", "gemma3")}

    @settings(max_examples=60, deadline=None, derandomize=True)
    @given(
        name=st.sampled_from(["llama", "gpt2", "gemma3"]),
        window=st.one_of(st.integers(1, 8), st.just("auto")),
        ngram=st.integers(2, 6),
        guess=st.integers(0, 8),
        prompt_length=st.integers(1, 40),
        seed=st.integers(0, 1000),
        new_tokens=st.integers(1, 40),
        commit=st.sampled_from(["gather", "refeed"]),
    )
    def test_identical_to_greedy(self, name, window, ngram, guess, prompt_length, seed, new_tokens, commit):
        model = self.models[name]
        prompt = random_prompt(prompt_length, seed=seed)
        expected = model.generate(prompt, max_new_tokens=new_tokens, do_sample=False)
        out = model.generate(
            prompt,
            max_new_tokens=new_tokens,
            do_sample=False,
            lookahead_window=window,
            lookahead_ngram=ngram,
            lookahead_guess=guess,
            lookahead_cache_commit=commit,
        )
        self.assertTrue(torch.equal(out, expected))


class ModelCacheTest(unittest.TestCase):
    """What `generate` gives a model for its cache, decided before any forward pass."""

    def test_a_model_generate_gives_no_cache_is_refused_by_name(self):
        from transformers import RwkvConfig, RwkvForCausalLM

        torch.manual_seed(0)
        config = RwkvConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, attention_hidden_size=32)
        model = enable_lookahead(RwkvForCausalLM(config).eval())
        passes = []
        model.register_forward_hook(lambda *args: passes.append(1))
        with self.assertRaisesRegex(ValueError, "`RwkvForCausalLM` keeps its decoding state outside .*`Cache`"):
            model.generate(random_prompt(8), max_new_tokens=6, do_sample=False, lookahead_window=4)
        self.assertEqual(passes, [], "refused before the first forward pass")

    def test_use_cache_off_in_the_model_config_is_turned_on_unless_the_user_asks(self):
        # As MPT's config ships it.
        model = tiny_model("llama")
        model.config.use_cache = False
        model.generation_config = GenerationConfig.from_model_config(model.config)
        self.assertFalse(model.generation_config.use_cache)
        model = enable_lookahead(model)
        prompt = random_prompt(10)
        expected = model.generate(prompt, max_new_tokens=12, do_sample=False)
        out = model.generate(prompt, max_new_tokens=12, do_sample=False, lookahead_window=4)
        self.assertTrue(torch.equal(out, expected))
        for asked in ({"use_cache": False}, {"generation_config": GenerationConfig(use_cache=False)}):
            with self.subTest(asked=asked), self.assertRaisesRegex(ValueError, "needs `use_cache=True`"):
                model.generate(prompt, max_new_tokens=12, do_sample=False, lookahead_window=4, **asked)
