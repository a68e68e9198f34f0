import unittest

import torch
import transformers
from parameterized import parameterized

from transformers_lookahead import enable_lookahead
from transformers_lookahead.chain_steps import LONGEST_CHAIN_CHECKED
from transformers_lookahead.step_check import StepCheck, step_failure

from .utils import random_prompt, tiny_model


class IgnoresPositionIds(transformers.LlamaForCausalLM):
    """Places tokens by the cache length, as decoders that derive positions do."""

    def forward(self, *args, position_ids=None, **kwargs):
        return super().forward(*args, **kwargs)


class IgnoresCustomMasks(transformers.LlamaForCausalLM):
    """Builds its own causal mask whatever it is given, as backends that rebuild masks do."""

    def forward(self, *args, attention_mask=None, **kwargs):
        return super().forward(*args, **kwargs)


class FailsOnSteps(transformers.LlamaForCausalLM):
    """Raises on a pass over several tokens after the prefill, as models whose biases cannot take a 4D mask do."""

    def forward(self, input_ids=None, attention_mask=None, **kwargs):
        if attention_mask is not None and attention_mask.dim() == 4:
            raise RuntimeError("cannot lay out this mask")
        return super().forward(input_ids=input_ids, attention_mask=attention_mask, **kwargs)


class PaddingAsText(transformers.LlamaForCausalLM):
    """Lets padding be seen in plain decoding (its 2D mask dropped), as a model with its own padding rules might."""

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, **kwargs):
        if attention_mask is not None and attention_mask.dim() == 2:
            attention_mask = None
        return super().forward(input_ids, attention_mask=attention_mask, position_ids=position_ids, **kwargs)


class ComputesStepsOtherwise(transformers.LlamaForCausalLM):
    """Moves its logits on passes of several tokens after a prefix, as a model whose multi-token passes differ does."""

    def forward(self, input_ids=None, **kwargs):
        output = super().forward(input_ids=input_ids, **kwargs)
        cache = output.past_key_values
        if input_ids.shape[1] > 1 and cache is not None and cache.get_seq_length() > input_ids.shape[1]:
            output.logits = output.logits + torch.linspace(0, 1, output.logits.shape[-1])
        return output


def tiny(model_class: type) -> transformers.PreTrainedModel:
    """A tiny Llama of `model_class`, as `tiny_model("llama")` builds one."""
    torch.manual_seed(0)
    return model_class(tiny_model("llama").config).eval()


class StepCheckTest(unittest.TestCase):
    def test_a_model_that_computes_steps_as_plain_decoding_passes(self):
        self.assertIsNone(step_failure(tiny_model("llama")))
        self.assertIsNone(step_failure(tiny_model("gemma3")), "sliding and full layers, each with its mask")

    @parameterized.expand(
        [
            (
                "positions",
                IgnoresPositionIds,
                r"it ignores the step's `position_ids` \(it places tokens by their index",
            ),
            ("mask", IgnoresCustomMasks, "it ignores the step's 4D attention mask"),
            ("raises", FailsOnSteps, r"failed on a lookahead step's forward pass \(RuntimeError: cannot lay out"),
        ]
    )
    def test_a_model_that_only_computes_chains_decodes_in_chain_steps(self, _, model_class, reason):
        # A class of its own: the log says it once per process, and other tests decode the model class too.
        model_class = type(f"{model_class.__name__}Alone", (model_class,), {})
        check, model = StepCheck(), tiny(model_class)
        with self.assertLogs("transformers_lookahead.step_check", "WARNING") as logs:
            self.assertTrue(check.refuse_if_failing(model, chain_steps=True))
            self.assertTrue(check.refuse_if_failing(model, padded=True, chain_steps=True), "padding is fed as usual")
        self.assertEqual(len(logs.records), 1, "said once")
        self.assertRegex(logs.output[0], f"`{model_class.__name__}` .*{reason}.*decodes it in chain steps")
        with self.assertRaisesRegex(ValueError, f"`{model_class.__name__}` .*{reason}.*continuous batching"):
            check.refuse_if_failing(model)

    def test_a_model_that_computes_no_chain_as_plain_decoding_is_refused_by_name_before_decoding(self):
        model = enable_lookahead(tiny(ComputesStepsOtherwise))
        prompt = random_prompt(10)
        with self.assertRaisesRegex(
            ValueError, "`ComputesStepsOtherwise` computes a pass over several tokens otherwise.*also gives other"
        ):
            model.generate(prompt, max_new_tokens=8, do_sample=False, lookahead_window=4)
        plain = model.generate(prompt, max_new_tokens=8, do_sample=False)
        self.assertEqual(plain.shape[1], prompt.shape[1] + 8, "plain decoding still runs")

    def test_the_verdict_is_kept_per_model(self):
        check, model = StepCheck(), tiny(ComputesStepsOtherwise)
        passes = []
        model.register_forward_pre_hook(lambda *args: passes.append(1))
        for _ in range(2):
            with self.assertRaisesRegex(ValueError, "ComputesStepsOtherwise"):
                check.refuse_if_failing(model, chain_steps=True)
        # One check: two prefilled runs of 2 and 3 one-token passes and two steps; for the chain, a prefilled run of
        # `LONGEST_CHAIN_CHECKED` one-token passes and a prefilled chain step.
        checked = 3 + 4 + 2 * 2 + (1 + LONGEST_CHAIN_CHECKED) + 2
        self.assertEqual(len(passes), checked)
        model.set_attn_implementation("eager")
        with self.assertRaises(ValueError):
            check.refuse_if_failing(model)
        self.assertEqual(len(passes), checked, "what is checked is the model's structure")
        with self.assertRaises(ValueError):
            StepCheck().refuse_if_failing(model)
        self.assertGreater(len(passes), checked, "another check checks again")

    def test_a_refused_call_runs_the_check_alone_and_once(self):
        from transformers_lookahead import LookaheadState

        model = enable_lookahead(tiny(ComputesStepsOtherwise), LookaheadState(cost_dir=None))
        lengths = []
        model.register_forward_pre_hook(
            lambda module, args, kwargs: lengths.append(kwargs["input_ids"].shape[1]), with_kwargs=True
        )
        prompt = random_prompt(10)
        with self.assertRaisesRegex(ValueError, "ComputesStepsOtherwise"):
            model.generate(prompt, max_new_tokens=8, do_sample=False, lookahead_window=4)
        self.assertTrue(lengths, "the first lookahead call checks the model")
        self.assertNotIn(prompt.shape[1], lengths, "no prefill")
        lengths.clear()
        with self.assertRaisesRegex(ValueError, "ComputesStepsOtherwise"):
            model.generate(prompt, max_new_tokens=8, do_sample=False, lookahead_window="auto")
        self.assertEqual(lengths, [], "the verdict is remembered: no check, no cost table, no prefill")

    def test_a_model_that_decodes_padding_as_text_decodes_padded_batches_in_chain_steps(self):
        model = enable_lookahead(tiny(PaddingAsText))
        prompt = random_prompt(10)
        out = model.generate(prompt, max_new_tokens=8, do_sample=False, lookahead_window=4)
        self.assertTrue(torch.equal(out, model.generate(prompt, max_new_tokens=8, do_sample=False)))
        self.assertIsNone(model.lookahead_state.step_check.chain_reason(model), "full steps for unpadded rows")
        padded = {"input_ids": torch.cat([torch.zeros(1, 3, dtype=torch.long), prompt], 1)}
        padded["attention_mask"] = (padded["input_ids"] != 0).long()
        padded["attention_mask"][:, 3:] = 1
        plain = model.generate(**padded, max_new_tokens=8, do_sample=False, pad_token_id=0)
        with self.assertLogs("transformers_lookahead.step_check", "WARNING") as logs:
            out = model.generate(**padded, max_new_tokens=8, do_sample=False, lookahead_window=4, pad_token_id=0)
        self.assertTrue(torch.equal(out, plain), "plain greedy's output, padding seen as it sees it")
        self.assertRegex(logs.output[0], "`PaddingAsText`'s own greedy decoding of a left-padded row differs.*chain")
        self.assertRegex(model.lookahead_state.step_check.chain_reason(model), "left-padded row differs")
        with self.assertRaisesRegex(ValueError, "`PaddingAsText`'s own greedy decoding.*continuous batching"):
            model.lookahead_state.step_check.refuse_if_failing(model, padded=True)

    def test_a_model_in_training_mode_is_checked_as_it_decodes(self):
        model = tiny_model("llama")
        model.config.attention_dropout = 0.5
        for layer in model.model.layers:
            layer.self_attn.attention_dropout = 0.5
        model.train()
        check = StepCheck()
        check.refuse_if_failing(model)
        self.assertTrue(model.training, "the mode is restored")

    def test_half_precision_passes_within_its_tolerance(self):
        self.assertIsNone(step_failure(tiny_model("llama").to(torch.bfloat16)))

    def test_continuous_batching_refuses_the_model_before_its_engine_starts(self):
        from transformers import GenerationConfig

        model = enable_lookahead(tiny(IgnoresCustomMasks))
        config = GenerationConfig(max_new_tokens=4, do_sample=False, lookahead_window=4)
        with self.assertRaisesRegex(ValueError, "`IgnoresCustomMasks` .*4D attention mask.*not lay out"):
            model.generate_batch([random_prompt(8)[0].tolist()], config)
