"""SmolLM2-135M-Instruct on real MT-Bench and HumanEval prompts (slow: run with RUN_SLOW=1, as `make test` does)."""

import unittest

import torch
from parameterized import parameterized
from transformers import AutoModelForCausalLM, AutoTokenizer, TextIteratorStreamer
from transformers.testing_utils import slow

from transformers_lookahead import enable_lookahead
from transformers_lookahead.assets import chat_input_ids, smollm2_path, tuning_prompts

NEW_TOKENS = 64
PROMPTS_PER_DATASET = 10
LARGE_STEP_PROMPTS = 5


@slow
class SmolLM2LookaheadTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        path = smollm2_path()
        cls.tokenizer = AutoTokenizer.from_pretrained(path)
        cls.model = enable_lookahead(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval())
        cls.prompts = []
        for dataset in ("mt_bench", "humaneval"):
            for prompt_id, _, text in tuning_prompts(dataset)[:PROMPTS_PER_DATASET]:
                cls.prompts.append((prompt_id, chat_input_ids(cls.tokenizer, text, dataset)))
        cls.greedy = [cls.model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False) for _, ids in cls.prompts]

    @parameterized.expand(
        [
            ("lade_small", 7, 4, 7, len),
            ("lade_large", 15, 5, 15, lambda prompts: LARGE_STEP_PROMPTS),
            ("auto", "auto", 5, None, len),
        ]
    )
    def test_identical_to_greedy_on_real_prompts(self, label, window, ngram, guess, count):
        new_tokens, passes = 0, 0
        for (prompt_id, ids), expected in list(zip(self.prompts, self.greedy))[: count(self.prompts)]:
            out = self.model.generate(
                ids,
                max_new_tokens=NEW_TOKENS,
                do_sample=False,
                lookahead_window=window,
                lookahead_ngram=ngram,
                lookahead_guess=guess,
                return_dict_in_generate=True,
            )
            with self.subTest(prompt=prompt_id):
                self.assertTrue(torch.equal(out.sequences, expected))
            new_tokens += out.sequences.shape[1] - ids.shape[1]
            passes += out.num_forward_passes
        print(f"\n{label} W/N/G={window}/{ngram}/{guess}: compression {new_tokens / passes:.2f} tokens per forward")
        self.assertGreater(new_tokens / passes, 1.0)

    def test_stop_strings(self):
        for (_, ids), expected in list(zip(self.prompts, self.greedy))[PROMPTS_PER_DATASET : PROMPTS_PER_DATASET + 3]:
            text = self.tokenizer.decode(expected[0, ids.shape[1] :])
            for start in (20, 45, 70):
                stop = text[start : start + 7]
                kwargs = {"max_new_tokens": NEW_TOKENS, "do_sample": False, "stop_strings": [stop]}
                kwargs["tokenizer"] = self.tokenizer
                plain = self.model.generate(ids, **kwargs)
                lookahead = self.model.generate(ids, lookahead_window="auto", **kwargs)
                with self.subTest(stop=stop):
                    self.assertTrue(torch.equal(lookahead, plain))
                    self.assertLess(plain.shape[1], expected.shape[1], "the stop string must end generation early")

    def test_text_streamer_and_pipeline(self):
        from threading import Thread

        from transformers import pipeline

        _, ids = self.prompts[0]
        streamer = TextIteratorStreamer(self.tokenizer, skip_prompt=True)
        kwargs = {"max_new_tokens": 32, "do_sample": False, "lookahead_window": 7, "streamer": streamer}
        thread = Thread(target=self.model.generate, args=(ids,), kwargs=kwargs)
        thread.start()
        streamed = "".join(streamer)
        thread.join()
        expected = self.tokenizer.decode(self.greedy[0][0, ids.shape[1] : ids.shape[1] + 32], skip_special_tokens=True)
        self.assertEqual(streamed.strip(), expected.strip())

        pipe = pipeline("text-generation", model=self.model, tokenizer=self.tokenizer)
        messages = [{"role": "user", "content": "Write a haiku about the sea."}]
        plain = pipe(messages, do_sample=False, max_new_tokens=32)
        fast = pipe(messages, do_sample=False, max_new_tokens=32, lookahead_window=7)
        self.assertEqual(fast, plain)
