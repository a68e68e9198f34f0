"""Batches: left padding, rows that accept and finish at different steps, `num_return_sequences`."""

import unittest

import torch
import transformers
from parameterized import parameterized
from transformers import StoppingCriteria, StoppingCriteriaList, TextStreamer

from transformers_lookahead import enable_lookahead
from utils.distribution_check import homogeneity_p_value, token_counts
from utils.faithfulness import greedy_margins, off_greedy_positions
from utils.tiny_models import left_padded

from .test_verification import P_VALUE
from .utils import SMALL_VOCABULARY, flat_state, random_prompt, small_vocabulary_model, tiny_model

SHAPES = [(4, 3, 4), (7, 5, 7), ("auto", 5, None)]


def mixed_prompts(count: int = 3) -> list[torch.LongTensor]:
    return [random_prompt(length, seed=seed) for seed, length in zip(range(count), (21, 9, 30, 4, 15, 26, 12, 18))]


def _greedy_with_shape(model, inputs: dict, window, ngram, guess, **settings):
    return model.generate(
        **inputs,
        max_new_tokens=30,
        do_sample=False,
        lookahead_window=window,
        lookahead_ngram=ngram,
        lookahead_guess=guess,
        return_dict_in_generate=True,
        **settings,
    )


class BatchedExactnessTest(unittest.TestCase):
    @parameterized.expand([("llama",), ("gpt2",), ("qwen3",), ("opt",), ("mistral",), ("gpt_neox",)])
    def test_identical_to_batched_greedy_and_to_each_row_alone(self, name):
        # A flat cost table for "auto": with the machine's measured one, whether rows ever accept different numbers
        # of tokens (checked below) would depend on the load while the table was measured.
        model = enable_lookahead(tiny_model(name), flat_state())
        prompts = mixed_prompts(3)
        inputs = left_padded(prompts)
        expected = model.generate(**inputs, max_new_tokens=30, do_sample=False)
        for window, ngram, guess in SHAPES:
            with self.subTest(window=window, ngram=ngram, guess=guess):
                out = _greedy_with_shape(model, inputs, window, ngram, guess)
                self.assertTrue(torch.equal(out.sequences, expected))
                self.assertEqual(len(out.accepted_per_step), 3)
                for row, prompt in enumerate(prompts):
                    alone = model.generate(prompt, max_new_tokens=30, do_sample=False)
                    self.assertTrue(torch.equal(out.sequences[row, -30:], alone[0, -30:]))
                    self.assertEqual(sum(out.accepted_per_step[row]) + 1, 30)
                # Rows accepted different numbers of tokens in some step, so unused cache slots were masked.
                steps = min(len(accepted) for accepted in out.accepted_per_step)
                self.assertTrue(any(len({acc[s] for acc in out.accepted_per_step}) > 1 for s in range(steps)))

    @parameterized.expand(
        [
            (f"{dtype}_{name}", name, dtype)
            for dtype in ("bfloat16", "float16")
            for name in ("llama", "gpt2", "qwen3", "gemma3")
        ]
    )
    def test_half_precision_rows_are_near_greedy(self, _, name, dtype):
        # In half precision a multi-token pass (or a batch of rows) rounds otherwise than plain greedy's one-token
        # pass, so the promise is a near-tie of plain greedy's choice at every token, along each row's own text.
        dtype = getattr(torch, dtype)
        model = enable_lookahead(tiny_model(name).to(dtype), flat_state())
        inputs = left_padded(mixed_prompts(3))
        for window, ngram, guess in SHAPES:
            # "auto" plans from a flat cost table: with this machine's measured one, its steps (and so whether
            # any step accepts several tokens) would depend on the load while the table was measured.
            with self.subTest(window=window, ngram=ngram, guess=guess):
                out = _greedy_with_shape(model, inputs, window, ngram, guess)
                self.assertGreater(max(max(row) for row in out.accepted_per_step), 1, "no step accepted several")
                margins, scales = greedy_margins(model, inputs, out.sequences[:, -30:])
                self.assertEqual(margins.shape, (3, 30))
                self.assertEqual(off_greedy_positions(margins, scales, dtype), [])

    @parameterized.expand([("gather",), ("refeed",)])
    def test_cache_commit_strategies(self, strategy):
        model = enable_lookahead(tiny_model("llama", "eager"))
        inputs = left_padded(mixed_prompts(4))
        expected = model.generate(**inputs, max_new_tokens=40, do_sample=False)
        out = model.generate(
            **inputs, max_new_tokens=40, do_sample=False, lookahead_window=4, lookahead_cache_commit=strategy
        )
        self.assertTrue(torch.equal(out, expected))

    def test_one_padded_row(self):
        model = enable_lookahead(tiny_model("llama"))
        inputs = left_padded([random_prompt(12, seed=3)])
        inputs["input_ids"] = torch.cat([torch.zeros(1, 5, dtype=torch.long), inputs["input_ids"]], dim=1)
        inputs["attention_mask"] = torch.cat([torch.zeros(1, 5, dtype=torch.long), inputs["attention_mask"]], dim=1)
        expected = model.generate(**inputs, max_new_tokens=30, do_sample=False)
        out = model.generate(**inputs, max_new_tokens=30, do_sample=False, lookahead_window=4)
        self.assertTrue(torch.equal(out, expected))

    def test_rows_finishing_at_different_steps(self):
        model = enable_lookahead(tiny_model("qwen2"))
        prompts = mixed_prompts(4)
        inputs = left_padded(prompts)
        free = model.generate(**inputs, max_new_tokens=40, do_sample=False)[:, inputs["input_ids"].shape[1] :]
        # EOS ids that end row 0 early and row 2 a little later; the other rows run to max_new_tokens.
        eos = [int(free[0, 6]), int(free[2, 17])]
        expected = model.generate(**inputs, max_new_tokens=40, do_sample=False, eos_token_id=eos)
        self.assertLess((expected[:, -40:] == 0).sum(dim=1)[0], 40, "row 0 must stop early")
        forward_batches = []
        hook = model.register_forward_pre_hook(
            lambda module, args, kwargs: forward_batches.append(kwargs["input_ids"].shape[0]), with_kwargs=True
        )
        try:
            out = model.generate(**inputs, max_new_tokens=40, do_sample=False, eos_token_id=eos, lookahead_window=4)
        finally:
            hook.remove()
        self.assertTrue(torch.equal(out, expected))
        self.assertLess(forward_batches[-1], 4, "finished rows must leave the batch")

    def test_stopping_criteria_without_eos(self):
        """Without an EOS criterion plain decoding keeps every row going until all rows' criteria have fired."""

        class StopAfter(StoppingCriteria):
            def __init__(self, token):
                self.token = token

            def __call__(self, input_ids, scores, **kwargs):
                return (input_ids[:, -1] == self.token).flatten()

        model = enable_lookahead(tiny_model("llama"))
        inputs = left_padded(mixed_prompts(3))
        free = model.generate(**inputs, max_new_tokens=40, do_sample=False)[:, inputs["input_ids"].shape[1] :]
        criteria = StoppingCriteriaList([StopAfter(int(free[1, 8]))])
        expected = model.generate(**inputs, max_new_tokens=40, do_sample=False, stopping_criteria=criteria)
        out = model.generate(
            **inputs, max_new_tokens=40, do_sample=False, stopping_criteria=criteria, lookahead_window=4
        )
        self.assertTrue(torch.equal(out, expected))

    def test_processors_per_row(self):
        model = enable_lookahead(tiny_model("llama"))
        inputs = left_padded(mixed_prompts(3))

        def allowed(batch_id, ids):
            # Row-dependent constraint: the batch index must reach the processor intact.
            return list(range(2 + batch_id * 20, 2 + batch_id * 20 + 40))

        settings = {
            "repetition_penalty": 1.3,
            "no_repeat_ngram_size": 3,
            "min_new_tokens": 5,
            "sequence_bias": {(7,): 2.0},
            "prefix_allowed_tokens_fn": allowed,
        }
        expected = model.generate(**inputs, max_new_tokens=30, do_sample=False, **settings)
        out = model.generate(**inputs, max_new_tokens=30, do_sample=False, lookahead_window=4, **settings)
        self.assertTrue(torch.equal(out, expected))

    def test_scores_and_logits(self):
        model = enable_lookahead(tiny_model("llama"))
        prompts = mixed_prompts(3)
        inputs = left_padded(prompts)
        free = model.generate(**inputs, max_new_tokens=20, do_sample=False)[:, inputs["input_ids"].shape[1] :]
        common = {
            "max_new_tokens": 20,
            "do_sample": False,
            "eos_token_id": int(free[1, 5]),
            "return_dict_in_generate": True,
            "output_scores": True,
            "output_logits": True,
        }
        expected = model.generate(**inputs, **common)
        out = model.generate(**inputs, lookahead_window=4, **common)
        self.assertTrue(torch.equal(out.sequences, expected.sequences))
        self.assertEqual(len(out.scores), len(expected.scores))
        generated = expected.sequences[:, inputs["input_ids"].shape[1] :]
        for row in range(3):
            # Up to and including the row's EOS; plain decoding computes the padding's scores too.
            ends = (generated[row] == common["eos_token_id"]).nonzero()
            length = int(ends[0]) + 1 if len(ends) else 20
            for t in range(length):
                torch.testing.assert_close(out.scores[t][row], expected.scores[t][row], rtol=1e-4, atol=1e-4)
                torch.testing.assert_close(out.logits[t][row], expected.logits[t][row], rtol=1e-4, atol=1e-4)

    def test_a_batch_returns_no_cache_and_says_so(self):
        model = enable_lookahead(tiny_model("llama"))
        inputs = left_padded(mixed_prompts(2))
        plain = model.generate(**inputs, max_new_tokens=8, do_sample=False, return_dict_in_generate=True)
        self.assertIsNotNone(plain.cache)
        # Said once per process: forget that an earlier test of this worker said it.
        transformers.utils.logging.warning_once.cache_clear()
        with self.assertLogs("transformers_lookahead.lookahead_decoding", level="WARNING") as logs:
            out = model.generate(
                **inputs, max_new_tokens=8, do_sample=False, lookahead_window=4, return_dict_in_generate=True
            )
        self.assertIsNone(out.cache)
        self.assertIn("returns no cache (`cache=None` in the output) for a batch", logs.output[0])
        alone = model.generate(mixed_prompts(1)[0], max_new_tokens=8, lookahead_window=4, return_dict_in_generate=True)
        self.assertIsNotNone(alone.cache)

    def test_streamer_with_a_batch_is_refused(self):
        model = enable_lookahead(tiny_model("llama"))

        class Tokenizer:
            def decode(self, *args, **kwargs):
                return ""

        with self.assertRaisesRegex(ValueError, "Streaming supports one sequence"):
            model.generate(
                **left_padded(mixed_prompts(2)),
                max_new_tokens=5,
                lookahead_window=4,
                streamer=TextStreamer(Tokenizer()),
            )

    def test_sliding_layers_within_the_window(self):
        model = enable_lookahead(tiny_model("qwen2_hybrid"))
        model.config.sliding_window = 512
        model.config.layer_types = ["sliding_attention"] + ["full_attention"] * 2
        inputs = left_padded(mixed_prompts(3))
        expected = model.generate(**inputs, max_new_tokens=30, do_sample=False)
        out = model.generate(**inputs, max_new_tokens=30, do_sample=False, lookahead_window=4)
        self.assertTrue(torch.equal(out, expected))

    @parameterized.expand([("mistral_window8",), ("qwen2_hybrid",), ("gemma2",), ("gemma3",), ("cohere2",)])
    def test_sliding_layers_beyond_the_window(self, name):
        """Window 8, prompts of 2 to 30 tokens, 40 new tokens: every row outgrows its window several times."""
        model = enable_lookahead(tiny_model(name))
        prompts = [random_prompt(2, seed=9)] + mixed_prompts(4)
        inputs = left_padded(prompts)
        expected = model.generate(**inputs, max_new_tokens=40, do_sample=False)
        for window, commit in ((4, "gather"), ("auto", "gather"), (4, "refeed")):
            with self.subTest(window=window, commit=commit):
                out = model.generate(
                    **inputs,
                    max_new_tokens=40,
                    do_sample=False,
                    lookahead_window=window,
                    lookahead_cache_commit=commit,
                    return_dict_in_generate=True,
                )
                self.assertTrue(torch.equal(out.sequences, expected))
                self.assertTrue(any(len(set(step)) > 1 for step in zip(*out.accepted_per_step)), "rows must differ")
        for row, prompt in enumerate(prompts):
            alone = model.generate(prompt, max_new_tokens=40, do_sample=False)
            self.assertTrue(torch.equal(alone[0], expected[row, -alone.shape[1] :]))


def holey_masks(prompts: list[torch.LongTensor]) -> dict[str, dict[str, torch.Tensor]]:
    """
    Masks with zeros after real tokens, as Transformers' model testers build them: lower-triangular (`torch.tril`),
    right padding, and holes inside the prompts (a left-padded row beside them).
    """
    width = max(prompt.shape[-1] for prompt in prompts) + 3
    input_ids = torch.zeros(len(prompts), width, dtype=torch.long)
    right = torch.zeros_like(input_ids)
    holes = torch.zeros_like(input_ids)
    for row, prompt in enumerate(prompts):
        length = prompt.shape[-1]
        input_ids[row, :length] = prompt[0]
        right[row, :length] = 1
        holes[row, :length] = 1
        holes[row, 1 + row : 3 + row] = 0
    holes[-1] = 0
    holes[-1, -3:] = 1
    tril = torch.tril(torch.ones_like(input_ids))
    return {
        name: {"input_ids": input_ids, "attention_mask": mask}
        for name, mask in (("tril", tril), ("right_padded", right), ("holes", holes))
    }


class HoleyMaskTest(unittest.TestCase):
    """Every mask plain `generate` decodes (with its right-padding warning) decodes to plain greedy's tokens."""

    @parameterized.expand(
        [("llama", {}), ("gpt2", {}), ("mistral", {"sliding_window": 4}), ("gemma2", {}), ("qwen2_hybrid", {})]
    )
    def test_identical_to_plain_greedy(self, name, overrides):
        # Chain steps (the model's own mask from the 2D padding mask) are checked by the zoo's holey batch.
        model = enable_lookahead(tiny_model(name, **overrides), flat_state())
        for mask_name, inputs in holey_masks(mixed_prompts(3)).items():
            with self.assertLogs("transformers", level="WARNING"):
                expected = model.generate(**inputs, max_new_tokens=30, do_sample=False)
            for window, commit in ((4, "gather"), ("auto", "gather"), (4, "refeed")):
                with self.subTest(mask=mask_name, window=window, commit=commit):
                    out = _greedy_with_shape(model, inputs, window, 3, None, lookahead_cache_commit=commit)
                    self.assertTrue(torch.equal(out.sequences, expected))
                    self.assertTrue(any(max(row) > 1 for row in out.accepted_per_step), "multi-token steps")


class BatchedSamplingTest(unittest.TestCase):
    """Each row of a sampled batch, `num_return_sequences` included, keeps plain sampling's distribution."""

    @parameterized.expand([("float32", torch.float32), ("bfloat16", torch.bfloat16), ("float16", torch.float16)])
    def test_first_tokens_per_row(self, _, dtype):
        vocab = SMALL_VOCABULARY
        model = enable_lookahead(small_vocabulary_model().to(dtype))
        prompts = [torch.tensor([[3, 4, 5, 3, 4, 5, 3, 4]]), torch.tensor([[6, 7, 6, 7, 6]])]
        inputs = left_padded(prompts)
        # Many copies per call rather than many calls: the same samples per prompt, in a twentieth of the calls.
        runs, new_tokens, copies = 35, 4, 40
        samples = {}
        multi_token = 0
        for label, extra in (("plain", {}), ("lookahead", {"lookahead_window": 2, "lookahead_ngram": 3})):
            drawn = []
            for _ in range(runs):
                out = model.generate(
                    **inputs,
                    do_sample=True,
                    temperature=0.8,
                    max_new_tokens=new_tokens,
                    num_return_sequences=copies,
                    return_dict_in_generate=True,
                    **extra,
                )
                drawn.append(out.sequences[:, -new_tokens:])
                if extra:
                    multi_token += sum(any(kept > 1 for kept in row) for row in out.accepted_per_step)
            samples[label] = torch.stack(drawn)  # (runs, prompts x copies, new_tokens)
        # A fixed 2/3 step on a random model accepts a second token in about 2.5% of the sampled rows.
        self.assertGreater(multi_token, runs * 2 * copies // 100, "the test must exercise multi-token acceptance")
        # `num_return_sequences` repeats each prompt: rows 0-1 sample prompt 0, rows 2-3 prompt 1.
        for prompt in range(2):
            rows = slice(prompt * copies, (prompt + 1) * copies)
            plain = token_counts(samples["plain"][:, rows].reshape(-1, new_tokens), vocab)
            lookahead = token_counts(samples["lookahead"][:, rows].reshape(-1, new_tokens), vocab)
            for position in range(new_tokens):
                with self.subTest(prompt=prompt, position=position):
                    self.assertGreater(homogeneity_p_value(plain[position], lookahead[position]), P_VALUE)
