"""`SuffixMemory`: lookup, bounds, persistence and threads; and what it does inside `generate`."""

import tempfile
import threading
import unittest
from pathlib import Path

import torch
from parameterized import parameterized
from safetensors.torch import save_file

from transformers_lookahead import LookaheadState, enable_lookahead
from transformers_lookahead.auto_tuning import AUTO_TUNING
from transformers_lookahead.suffix_memory import MEMORY_FORMAT, SuffixMemory, vocabulary_key

from .utils import VOCAB, flat_state, random_prompt, tiny_model

VOCABULARY = f"llama/{VOCAB}"
# Without the memory a step accepts at most the context's continuation plus one token (the pool's n-grams are
# shorter): a longer step can only come from the memory.
LONGEST_STEP_WITHOUT_MEMORY = AUTO_TUNING.context_depth + 1


class SuffixMemoryTest(unittest.TestCase):
    def test_longest_suffix_proposes_what_followed_it_most_recent_first(self):
        memory = SuffixMemory(VOCABULARY, 100, max_match=3, depth_per_match=2)
        memory.add([[1, 2, 3, 4, 5, 6, 7, 8], [9, 2, 3, 10, 11, 12, 13]])
        match = memory.match([50, 9, 2, 3], max_depth=16)
        self.assertEqual(match.length, 3)
        self.assertEqual(match.continuations, ((10, 11, 12, 13),))
        match = memory.match([50, 2, 3], max_depth=16)
        self.assertEqual(match.length, 2)
        self.assertEqual(match.continuations, ((10, 11, 12, 13), (4, 5, 6, 7)))
        self.assertEqual(memory.match([50, 2, 3], max_depth=3).continuations, ((10, 11, 12), (4, 5, 6)))
        self.assertEqual(memory.match([50, 3], max_depth=16).continuations, ((10, 11), (4, 5)), "2 tokens per match")
        self.assertIsNone(memory.match([50, 51], max_depth=16))
        self.assertIsNone(memory.match([1, 2], max_depth=0))

    def test_bounded_by_evicting_the_oldest_calls(self):
        memory = SuffixMemory(VOCABULARY, 10, max_match=2)
        memory.add([[1, 2, 3, 4, 5, 6]])
        memory.add([[7, 8, 9, 10, 11, 12]])
        self.assertEqual((len(memory), memory.num_documents), (6, 1))
        self.assertIsNone(memory.match([1, 2], 4), "an evicted call proposes nothing")
        self.assertEqual(memory.match([7, 8], 4).continuations, ((9, 10, 11, 12),))
        self.assertTrue(all(all(d == 1 for d, _ in entries) for entries in memory._index.values()))
        memory.add([list(range(20, 40))])
        self.assertEqual(memory.documents(), [tuple(range(30, 40))], "a longer sequence keeps its end")
        memory.resize(4)
        self.assertEqual(len(memory), 0)
        self.assertEqual(memory._index, {})

    def test_keeps_the_most_recent_occurrences_per_suffix(self):
        memory = SuffixMemory(VOCABULARY, 1000, max_match=1, max_occurrences=2)
        memory.add([[5, token] for token in (10, 11, 12)])
        self.assertEqual(memory.match([5], 4).continuations, ((12,), (11,)))

    def test_save_and_load(self):
        memory = SuffixMemory(VOCABULARY, 100)
        memory.add([[1, 2, 3, 4, 5], [6, 2, 3, 7]])
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "sub" / "memory.safetensors"
            memory.save(path)
            loaded = SuffixMemory(VOCABULARY, 100)
            loaded.load(path)
        self.assertEqual(loaded.documents(), memory.documents())
        self.assertEqual(loaded.match([2, 3], 8), memory.match([2, 3], 8))

    @parameterized.expand(
        [
            ("missing", None, "no such file"),
            ("garbage", b"not a memory at all", "not a safetensors file"),
            ("other_format", {"format": "something-else"}, "not a lookahead memory"),
            ("other_version", {"version": "99"}, "version '99'"),
            ("other_vocabulary", {"vocabulary": "gpt2/50257"}, "vocabulary 'gpt2/50257', this one is 'llama/96'"),
            ("token_out_of_range", {"tokens": [1, 2, VOCAB]}, "outside the vocabulary"),
            ("lengths_do_not_add_up", {"lengths": [2]}, "do not add up"),
        ]
    )
    def test_refuses_a_bad_file_and_keeps_what_it_holds(self, _, change, message):
        memory = SuffixMemory(VOCABULARY, 100)
        memory.add([[1, 2, 3]])
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "memory.safetensors"
            if isinstance(change, bytes):
                path.write_bytes(change)
            elif change is not None:
                metadata = {"format": MEMORY_FORMAT, "version": "1", "vocabulary": VOCABULARY, "max_tokens": "100"}
                metadata.update({k: v for k, v in change.items() if k not in ("tokens", "lengths")})
                tokens = torch.tensor(change.get("tokens", [4, 5, 6]), dtype=torch.int64)
                lengths = torch.tensor(change.get("lengths", [len(tokens)]), dtype=torch.int64)
                save_file({"tokens": tokens, "lengths": lengths}, str(path), metadata=metadata)
            with self.assertRaisesRegex(ValueError, f"Cannot load the lookahead memory file .*{message}"):
                memory.load(path)
        self.assertEqual(memory.documents(), [(1, 2, 3)])

    def test_threads(self):
        memory = SuffixMemory(VOCABULARY, 10**6)
        errors = []

        def work(seed: int):
            try:
                for round in range(20):
                    tokens = random_prompt(40, seed=100 * seed + round)[0].tolist()
                    memory.add([tokens])
                    memory.match(tokens[:10], 16)
            except Exception as error:  # pragma: no cover - reported below
                errors.append(error)

        threads = [threading.Thread(target=work, args=(seed,)) for seed in range(6)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
        self.assertEqual(errors, [])
        self.assertEqual((memory.num_documents, len(memory)), (120, 120 * 40))


class MemoryInGenerateTest(unittest.TestCase):
    """The memory inside `generate`: what it proposes pays off, and it never changes the output."""

    def setUp(self):
        self.model = enable_lookahead(tiny_model("llama"), flat_state())
        self.prompt = random_prompt(24, seed=3)

    def _generate(self, prompt=None, **kwargs):
        kwargs = {
            "max_new_tokens": 40,
            "do_sample": False,
            "lookahead_window": "auto",
            "lookahead_memory": True,
            **kwargs,
        }
        return self.model.generate(self.prompt if prompt is None else prompt, return_dict_in_generate=True, **kwargs)

    def _longest_step(self, output) -> int:
        steps = output.accepted_per_step
        return max(max(row) for row in steps) if isinstance(steps[0], tuple) else max(steps)

    def test_a_repeated_request_is_answered_from_memory_exactly(self):
        expected = self.model.generate(self.prompt, max_new_tokens=40, do_sample=False)
        first = self._generate()
        second = self._generate()
        self.assertTrue(torch.equal(first.sequences, expected))
        self.assertTrue(torch.equal(second.sequences, expected))
        self.assertLessEqual(self._longest_step(first), LONGEST_STEP_WITHOUT_MEMORY)
        self.assertGreater(self._longest_step(second), LONGEST_STEP_WITHOUT_MEMORY)
        self.assertLess(second.num_forward_passes, first.num_forward_passes)
        memory = self.model.lookahead_state.memory(self.model)
        self.assertEqual(memory.num_documents, 2)
        self.assertEqual(memory.documents()[0], tuple(expected[0].tolist()))

    def test_off_neither_reads_nor_writes(self):
        self._generate()
        second = self._generate(lookahead_memory=False)
        self.assertLessEqual(self._longest_step(second), LONGEST_STEP_WITHOUT_MEMORY)
        self.assertEqual(self.model.lookahead_state.memory(self.model).num_documents, 1)

    def test_namespaces_do_not_share(self):
        self._generate(lookahead_memory_namespace="tenant-a")
        other = self._generate(lookahead_memory_namespace="tenant-b")
        self.assertLessEqual(self._longest_step(other), LONGEST_STEP_WITHOUT_MEMORY)
        same = self._generate(lookahead_memory_namespace="tenant-a")
        self.assertGreater(self._longest_step(same), LONGEST_STEP_WITHOUT_MEMORY)

    def test_size_bounds_the_memory(self):
        self._generate(lookahead_memory_size=50)
        self._generate(prompt=random_prompt(24, seed=4), lookahead_memory_size=50)
        memory = self.model.lookahead_state.memory(self.model, max_tokens=50)
        self.assertLessEqual(len(memory), 50)
        self.assertEqual(memory.num_documents, 1, "the older call was evicted")

    def test_batch_rows_read_it_and_are_added(self):
        prompts = torch.cat([self.prompt, random_prompt(24, seed=4)])
        expected = self.model.generate(prompts, max_new_tokens=40, do_sample=False)
        self._generate(prompt=prompts)
        self.assertEqual(self.model.lookahead_state.memory(self.model).num_documents, 2)
        again = self._generate(prompt=prompts)
        self.assertTrue(torch.equal(again.sequences, expected))
        for row in again.accepted_per_step:
            self.assertGreater(max(row), LONGEST_STEP_WITHOUT_MEMORY)

    def test_seeded_sampling_does_not_depend_on_the_memory(self):
        def sample(**kwargs):
            torch.manual_seed(11)
            return self._generate(do_sample=True, temperature=0.8, **kwargs)

        before = sample()
        for seed in range(3):
            self._generate(prompt=random_prompt(24, seed=seed))
        self._generate()
        after = sample()
        self.assertTrue(torch.equal(before.sequences, after.sequences), "the memory changed, the text must not")
        self.assertGreater(self._longest_step(after), 1, "the test must exercise multi-token acceptance")
        self.assertTrue(torch.equal(sample(lookahead_memory=False).sequences, before.sequences))
        fixed_window = sample(lookahead_window=3, lookahead_memory=False)
        self.assertTrue(torch.equal(fixed_window.sequences, before.sequences))

    def test_memory_dir_keeps_it_across_processes(self):
        with tempfile.TemporaryDirectory() as tmp:
            self.model.lookahead_state = flat_state(memory_dir=tmp)
            self._generate()
            (path,) = Path(tmp).glob("*.safetensors")
            self.assertEqual(path.name, f"{vocabulary_key(self.model).replace('/', '-')}.default.safetensors")
            # A new state, as a restarted server has: the first call already answers from the file.
            self.model.lookahead_state = flat_state(memory_dir=tmp)
            restarted = self._generate()
            self.assertGreater(self._longest_step(restarted), LONGEST_STEP_WITHOUT_MEMORY)

    def test_corrupt_file_in_memory_dir_is_refused_and_kept(self):
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / f"{vocabulary_key(self.model).replace('/', '-')}.default.safetensors"
            path.write_bytes(b"\x00" * 64)
            self.model.lookahead_state = flat_state(memory_dir=tmp)
            with self.assertRaisesRegex(ValueError, "Cannot load the lookahead memory file .*default.safetensors"):
                self._generate()
            self.assertEqual(path.read_bytes(), b"\x00" * 64, "the file is left for its owner")
            expected = self.model.generate(self.prompt, max_new_tokens=40, do_sample=False)
            self.assertTrue(torch.equal(self._generate(lookahead_memory=False).sequences, expected))

    def test_save_memory_and_load_memory(self):
        self._generate()
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "memory.safetensors"
            self.model.lookahead_state.save_memory(path)
            # Flat costs: with the machine's measured table a loaded CPU may price the memory's long steps out.
            fresh = flat_state()
            fresh.load_memory(self.model, path, namespace="restored")
            self.model.lookahead_state = fresh
            restored = self._generate(lookahead_memory_namespace="restored")
            self.assertGreater(self._longest_step(restored), LONGEST_STEP_WITHOUT_MEMORY)
            with self.assertRaisesRegex(ValueError, "no lookahead memory of namespace 'nope'"):
                fresh.save_memory(path, namespace="nope")
            other = tiny_model("gpt2")
            with self.assertRaisesRegex(ValueError, "vocabulary 'llama/96', this one is 'gpt2/96'"):
                LookaheadState(cost_dir=None, memory_dir=None).load_memory(other, path)

    def test_threads_share_one_memory(self):
        prompts = [random_prompt(24, seed=seed) for seed in range(4)]
        expected = [self.model.generate(prompt, max_new_tokens=40, do_sample=False) for prompt in prompts]
        failures = []

        def work(index: int):
            for _ in range(2):
                output = self.model.generate(
                    prompts[index], max_new_tokens=40, do_sample=False, lookahead_window="auto", lookahead_memory=True
                )
                if not torch.equal(output, expected[index]):
                    failures.append(index)

        threads = [threading.Thread(target=work, args=(index,)) for index in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=300)
        self.assertEqual(failures, [])
        self.assertEqual(self.model.lookahead_state.memory(self.model).num_documents, 8)
