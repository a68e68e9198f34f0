"""
`transformers serve` with lookahead decoding (slow: the real SmolLM2 model; RUN_SLOW=1, as `make test` does).

One real server process on 127.0.0.1 and a free port serves the folder `save_lookahead_model` wrote (`"auto"`), with
`--trust-remote-code`; the tests talk to it with the real `openai` client. The reference is the same server with
`lookahead_window="off"` in the request's generation config, and plain greedy `generate` in this process.
"""

import json
import tempfile
import threading
import unittest
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.testing_utils import slow

from transformers_lookahead.lookahead_state import MEMORY_DIR_VARIABLE
from transformers_lookahead.suffix_memory import read_memory_file, vocabulary_key
from utils.faithfulness import greedy_margins, off_greedy_positions
from utils.serving import ServeProcess, lookahead_folder

from .utils import read_stream, stream_chats_at_once, stream_writes

PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number.",
    "List three facts about the Moon.",
    'def is_palindrome(text):\n    """Return True if text reads the same backwards."""',
    "Explain what a hash table is in two sentences.",
]
MAX_TOKENS = 40
OFF = {"generation_config": json.dumps({"lookahead_window": "off"})}
# A fixed window takes multi-token steps on any machine; the folder's "auto" follows this machine's measured costs.
FIXED_WINDOW = {"generation_config": json.dumps({"lookahead_window": 4, "lookahead_ngram": 3})}


def _plain_greedy_answers(folder: Path, prompts: list[str]) -> dict[str, str]:
    """Each prompt's answer by plain greedy `generate` in this process (fp32, `MAX_TOKENS`), as a chat turn."""
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    answers = {}
    for prompt in prompts:
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, return_tensors="pt", return_dict=True
        )["input_ids"]
        plain = model.generate(ids, max_new_tokens=MAX_TOKENS, do_sample=False)
        answers[prompt] = tokenizer.decode(plain[0, ids.shape[1] :], skip_special_tokens=True)
    return answers


@slow
class ServeTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        import openai

        cls.folder = lookahead_folder("auto")
        cls.server = ServeProcess(cls.folder, trust_remote_code=True).__enter__()
        cls.model_id = str(cls.folder)
        cls.client = openai.OpenAI(base_url=cls.server.base_url, api_key="unused", timeout=600, max_retries=0)

    @classmethod
    def tearDownClass(cls):
        cls.server.stop()

    def _chat(self, prompt: str, stream: bool = False, **kwargs):
        return self.client.chat.completions.create(
            model=self.model_id,
            messages=[{"role": "user", "content": prompt}],
            max_tokens=kwargs.pop("max_tokens", MAX_TOKENS),
            temperature=kwargs.pop("temperature", 0),
            stream=stream,
            **kwargs,
        )

    def _text(self, prompt: str, **kwargs) -> str:
        return self._chat(prompt, **kwargs).choices[0].message.content

    def _streamed(self, prompt: str, **kwargs) -> tuple[str, list[float]]:
        """The concatenated text of a streamed answer, and when each text chunk arrived."""
        return read_stream(self._chat(prompt, stream=True, **kwargs))

    def test_greedy_answers_equal_plain_greedy(self):
        expected = _plain_greedy_answers(self.folder, PROMPTS[:2])
        for prompt in PROMPTS[:2]:
            with self.subTest(prompt=prompt):
                self.assertEqual(self._text(prompt), expected[prompt])
                self.assertEqual(self._text(prompt, extra_body=OFF), expected[prompt])

    def test_stream_equals_the_answer_and_sends_accepted_chunks_together(self):
        prompt = PROMPTS[2]
        text, arrivals = self._streamed(prompt, max_tokens=64, extra_body=FIXED_WINDOW)
        self.assertEqual(text, self._text(prompt, max_tokens=64))
        plain_text, plain_arrivals = self._streamed(prompt, max_tokens=64, extra_body=OFF)
        self.assertEqual(plain_text, text)
        # A step's accepted tokens leave the server in one write, so the stream takes clearly fewer writes than plain
        # decoding's, which writes once per forward pass. Counting writes rather than chunks holds whether the server
        # sends a write's tokens as one event or one event each.
        writes, plain_writes = stream_writes(arrivals), stream_writes(plain_arrivals)
        self.assertLessEqual(writes, 0.9 * plain_writes, f"{writes} writes against plain decoding's {plain_writes}")

    def test_completions_endpoint(self):
        prompt = "The three primary colors are"
        answer = self.client.completions.create(model=self.model_id, prompt=prompt, max_tokens=24, temperature=0)
        plain = self.client.completions.create(
            model=self.model_id, prompt=prompt, max_tokens=24, temperature=0, extra_body=OFF
        )
        self.assertEqual(answer.choices[0].text, plain.choices[0].text)
        self.assertTrue(answer.choices[0].text)

    def test_request_options_behave_as_without_lookahead(self):
        prompt = PROMPTS[0]
        options = [
            {"max_tokens": 7},
            {"stop": ["\n"]},
            {"frequency_penalty": 0.5},
            {"logit_bias": {"28": 5.0, "1": -100.0}},
        ]
        for kwargs in options:
            with self.subTest(options=kwargs):
                looked = self._text(prompt, **kwargs)
                plain = self._text(prompt, **kwargs, extra_body=OFF)
                self.assertEqual(looked, plain)
        # Sampling: the same seed gives the same text (lookahead keeps plain sampling's distribution, not its
        # random draws, so texts match plain sampling in distribution rather than token for token).
        sampled = [self._text(prompt, temperature=0.7, seed=11, max_tokens=24) for _ in range(2)]
        self.assertEqual(sampled[0], sampled[1])

    def test_request_settings_and_turning_lookahead_off(self):
        prompt = PROMPTS[3]
        reference = self._text(prompt, extra_body=OFF)
        for settings in ({"lookahead_window": 4, "lookahead_ngram": 3}, {"lookahead_window": "auto"}):
            with self.subTest(settings=settings):
                body = {"generation_config": json.dumps({**settings, "max_new_tokens": MAX_TOKENS})}
                self.assertEqual(self._text(prompt, extra_body=body), reference)

    def test_invalid_settings_are_refused_and_the_server_keeps_serving(self):
        import openai

        cases = [
            ({"lookahead_window": -1}, "lookahead_window"),
            ({"lookahead_window": "abc"}, "lookahead_window"),
            ({"lookahead_window": 4, "num_beams": 2}, "num_beams"),
            ({"lookahead_memory_namespace": "../other-tenant"}, "lookahead_memory_namespace"),
            # Unbounded, these would allocate more than the machine has before failing.
            ({"lookahead_window": 20_000}, "lookahead_window"),
            ({"lookahead_window": 64, "lookahead_ngram": 16}, "lookahead_ngram"),
            ({"lookahead_window": "auto", "lookahead_memory_size": 10**12}, "lookahead_memory_size"),
        ]
        for settings, field in cases:
            with self.subTest(settings=settings):
                body = {"generation_config": json.dumps(settings)}
                with self.assertRaises(openai.APIStatusError) as context:
                    self._chat(PROMPTS[1], extra_body=body)
                # Transformers 5.24 refuses them as unprocessable (422), 5.25 as a bad request (400).
                self.assertIn(context.exception.status_code, (400, 422))
                self.assertIn(field, context.exception.response.json()["detail"])
                self.assertTrue(self._text(PROMPTS[1], max_tokens=8))

    def test_concurrent_streaming_clients_and_one_that_disconnects(self):
        prompts = [PROMPTS[i % len(PROMPTS)] for i in range(8)]
        expected = {prompt: self._text(prompt) for prompt in set(prompts)}
        results, errors = {}, []

        def client(index: int) -> None:
            try:
                results[index] = self._streamed(prompts[index])[0]
            except Exception as error:  # reported below with the client's index
                errors.append((index, repr(error)))

        def quitter() -> None:
            stream = self._chat(PROMPTS[0], stream=True, max_tokens=200)
            for received, _ in enumerate(stream):
                if received == 3:
                    stream.close()  # the connection drops mid-answer
                    return

        threads = [threading.Thread(target=quitter)] + [threading.Thread(target=client, args=(i,)) for i in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=600)
        self.assertFalse(any(thread.is_alive() for thread in threads), "a client did not finish")
        self.assertEqual(errors, [])
        for index, prompt in enumerate(prompts):
            self.assertEqual(results[index], expected[prompt], f"client {index}")
        self.assertEqual(self._text(PROMPTS[1]), expected[PROMPTS[1]], "the server serves on")


@slow
class ServeBfloat16Test(unittest.TestCase):
    """The same folder served in bfloat16: answers as lookahead gives them in this process, and near-greedy."""

    @classmethod
    def setUpClass(cls):
        import openai

        cls.folder = lookahead_folder("auto")
        cls.server = ServeProcess(cls.folder, trust_remote_code=True, dtype="bfloat16").__enter__()
        cls.client = openai.OpenAI(base_url=cls.server.base_url, api_key="unused", timeout=600, max_retries=0)

    @classmethod
    def tearDownClass(cls):
        cls.server.stop()

    def test_answers_equal_lookahead_in_process_and_are_near_greedy(self):
        from transformers_lookahead import enable_lookahead

        tokenizer = AutoTokenizer.from_pretrained(self.folder)
        model = enable_lookahead(AutoModelForCausalLM.from_pretrained(self.folder, dtype=torch.bfloat16).eval())
        # A fixed window: what "auto" verifies follows this machine's timings, and in bfloat16 what a step verifies
        # can change the text.
        settings = {"lookahead_window": 4, "lookahead_ngram": 3, "lookahead_memory": False}
        body = {"generation_config": json.dumps({**settings, "max_new_tokens": MAX_TOKENS})}
        for prompt in PROMPTS[:3]:
            with self.subTest(prompt=prompt):
                messages = [{"role": "user", "content": prompt}]
                ids = tokenizer.apply_chat_template(
                    messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
                )["input_ids"]
                common = {"max_new_tokens": MAX_TOKENS, "do_sample": False}
                out = model.generate(ids, **common, **settings, return_dict_in_generate=True)
                self.assertGreater(max(out.accepted_per_step), 1, "no step accepted several tokens")
                texts = out.sequences[:, ids.shape[1] :]
                served = self.client.chat.completions.create(
                    model=str(self.folder), messages=messages, max_tokens=MAX_TOKENS, temperature=0, extra_body=body
                )
                self.assertEqual(
                    served.choices[0].message.content, tokenizer.decode(texts[0], skip_special_tokens=True)
                )
                margins, scales = greedy_margins(model, {"input_ids": ids}, texts)
                self.assertEqual(off_greedy_positions(margins, scales, torch.bfloat16), [])
                # The folder's generation config sets "auto": plain greedy needs "off" here as in the request.
                plain = model.generate(ids, **common, lookahead_window="off")
                off = self.client.chat.completions.create(
                    model=str(self.folder), messages=messages, max_tokens=MAX_TOKENS, temperature=0, extra_body=OFF
                )
                self.assertEqual(
                    off.choices[0].message.content,
                    tokenizer.decode(plain[0, ids.shape[1] :], skip_special_tokens=True),
                )


@slow
class ServeMemoryTest(unittest.TestCase):
    """With `TRANSFORMERS_LOOKAHEAD_MEMORY_DIR`, a restarted server starts from the memory the last one kept."""

    def test_memory_survives_a_restart_and_namespaces_stay_apart(self):
        import openai

        folder = lookahead_folder("auto", memory=True)
        with tempfile.TemporaryDirectory() as memory_dir:
            environment = {MEMORY_DIR_VARIABLE: memory_dir}
            answers = []
            for prompt in PROMPTS[:2]:
                with ServeProcess(folder, trust_remote_code=True, environment=environment) as server:
                    client = openai.OpenAI(base_url=server.base_url, api_key="unused", timeout=600, max_retries=0)
                    answers.append(
                        client.chat.completions.create(
                            model=str(folder),
                            messages=[{"role": "user", "content": prompt}],
                            max_tokens=16,
                            temperature=0,
                        )
                    )
                    if len(answers) == 2:
                        tenant = {"generation_config": json.dumps({"lookahead_memory_namespace": "tenant-b"})}
                        tenant_answer = client.chat.completions.create(
                            model=str(folder),
                            messages=[{"role": "user", "content": prompt}],
                            max_tokens=16,
                            temperature=0,
                            extra_body=tenant,
                        )
            files = {path.name.split(".")[1]: path for path in Path(memory_dir).glob("*.safetensors")}
            self.assertEqual(sorted(files), ["default", "tenant-b"])
            model = AutoModelForCausalLM.from_pretrained(folder)
            documents = {name: read_memory_file(path, vocabulary_key(model)) for name, path in files.items()}
        self.assertEqual(len(documents["default"]), 2, "the restarted server loaded the first one's memory")
        self.assertEqual(len(documents["tenant-b"]), 1)
        # Another tenant's memory holds other text; the greedy answer is the same.
        self.assertEqual(tenant_answer.choices[0].message.content, answers[1].choices[0].message.content)


@slow
class ProposedContinuousBatchingHookTest(unittest.TestCase):
    """
    `transformers serve --continuous-batching` with the guide's upstream proposal applied
    (`utils/proposed_serving_hook.py`, which binds the folder's `init_continuous_batching` too). Stock Transformers
    serves the same folder with plain continuous batching: that is the reference.
    """

    def test_the_served_engine_takes_lookahead_steps_and_answers_as_plain_greedy(self):
        import openai

        # A fixed window: its steps do not depend on this machine's timings.
        folder = lookahead_folder(4)
        prompts = PROMPTS[:2]
        expected = _plain_greedy_answers(folder, prompts)
        streams = {}
        for hook in (True, False):
            with ServeProcess(folder, extra_args=["--continuous-batching"], proposed_hook=hook) as server:
                client = openai.OpenAI(base_url=server.base_url, api_key="unused", timeout=600, max_retries=0)
                # Two clients at once: the engine batches them.
                streams[hook], errors = stream_chats_at_once(client, str(folder), dict.fromkeys(prompts), MAX_TOKENS)
                self.assertEqual(errors, [], server.log())
        for hook, results in streams.items():
            self.assertEqual({prompt: text for prompt, (text, _) in results.items()}, expected, f"hook={hook}")
        # Plain continuous batching writes once per token; a lookahead step's tokens are one write.
        writes = sum(stream_writes(arrivals) for _, arrivals in streams[True].values())
        plain_writes = sum(stream_writes(arrivals) for _, arrivals in streams[False].values())
        self.assertLessEqual(writes, 0.9 * plain_writes, f"{writes} writes against plain decoding's {plain_writes}")
