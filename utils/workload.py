"""
What `utils/benchmark.py`'s benchmarks run on (`Workload`: the model and the prompts its arguments name) and the
record each writes (`environment`, `write_report`).
"""

from __future__ import annotations

import json
import platform
from collections import defaultdict
from pathlib import Path

import torch

from transformers_lookahead import enable_lookahead
from utils.assets import (
    SAMPLING_RATE,
    chat_input_ids,
    chat_messages,
    held_out_prompts,
    model_path,
    spoken_audio,
    tuning_prompts,
    whisper_tiny_en_path,
)
from utils.timing import native_half_precision, provenance

# The category of every `whisper` prompt.
SPEECH = "speech (whisper)"


class Workload:
    """
    The model and the prompts a benchmark's arguments name, loaded when a benchmark asks: `--model`, `--dtype` and
    `--device` for the model; `--dataset`, `--split`, `--num-prompts` and `--context-tokens` for the prompts, each
    `(prompt_id, category, input_ids, prompt_length)`; the `whisper` benchmark's for Whisper tiny.en and MT-Bench questions read
    aloud. Tests give a benchmark a workload of their own (a tiny model, fixed prompts).

    Args:
        args (`argparse.Namespace`): the benchmark's arguments.
    """

    def __init__(self, args):
        self.args = args

    @property
    def device(self) -> torch.device:
        return torch.device(self.args.device or ("cuda" if torch.cuda.is_available() else "cpu"))

    def load(self, dtype: str | None = None, **loading):
        """`(model, tokenizer, device)`: the causal language model in `dtype` (default `--dtype`), lookahead on."""
        from transformers import AutoModelForCausalLM, AutoTokenizer

        path = model_path(self.args.model, self.args.cache_dir)
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype or self.args.dtype), **loading)
        return enable_lookahead(model.to(self.device).eval()), tokenizer, self.device

    def prompts(self, tokenizer, device: torch.device) -> list[tuple]:
        """
        `(prompt_id, category, input_ids, prompt_length)` per prompt; with `--context-tokens N`, each prompt comes
        after an earlier turn of other tuning prompts' text, so that the model reads about N tokens before answering.
        """
        args = self.args
        datasets = ["mt_bench", "humaneval"] if args.dataset == "all" else [args.dataset]
        prompts = []
        for dataset in datasets:
            for prompt_id, category, text in self._dataset_items(dataset):
                ids = chat_input_ids(tokenizer, text, dataset)
                if getattr(args, "context_tokens", None):
                    ids = self._with_context(tokenizer, prompt_id, text, dataset, args.context_tokens - ids.shape[1])
                prompts.append((prompt_id, category, ids.to(device), ids.shape[1]))
        return prompts

    def load_whisper(self):
        """`(model, feature_extractor, device)`: Whisper tiny.en in `--dtype`, lookahead on."""
        from transformers import WhisperFeatureExtractor, WhisperForConditionalGeneration

        path = whisper_tiny_en_path(self.args.cache_dir)
        model = WhisperForConditionalGeneration.from_pretrained(path, dtype=getattr(torch, self.args.dtype))
        return (
            enable_lookahead(model.to(self.device).eval()),
            WhisperFeatureExtractor.from_pretrained(path),
            self.device,
        )

    def spoken_prompts(self, extractor, model, device: torch.device) -> list[tuple]:
        """MT-Bench questions read aloud by espeak-ng, as `(prompt_id, SPEECH, input_features, prompt_length)`."""
        prompts = []
        for prompt_id, _, text in self._dataset_items("mt_bench"):
            audio = spoken_audio(text, self.args.cache_dir)
            features = extractor(audio, sampling_rate=SAMPLING_RATE, return_tensors="pt")["input_features"]
            prompts.append((prompt_id, SPEECH, features.to(device, model.dtype), 0))
        return prompts

    def _dataset_items(self, dataset: str) -> list[tuple[str, str, str]]:
        args = self.args
        items = (tuning_prompts if args.split == "tuning" else held_out_prompts)(dataset, args.cache_dir)
        if dataset == "mt_bench":
            # Round-robin over categories, so a small --num-prompts still covers every category.
            by_category = defaultdict(list)
            for item in items:
                by_category[item[1]].append(item)
            items = [item for group in zip(*by_category.values()) for item in group]
        return items[: args.num_prompts]

    def _with_context(self, tokenizer, prompt_id: str, text: str, dataset: str, room: int) -> torch.LongTensor:
        """The chat of `text` after an earlier turn holding `room` tokens of the other tuning prompts' text."""
        others = [
            other
            for name in ("humaneval", "mt_bench")
            for other_id, _, other in tuning_prompts(name, self.args.cache_dir)
            if other_id != prompt_id
        ]
        filler = tokenizer("\n\n".join(others), add_special_tokens=False).input_ids[: max(room - 16, 0)]
        earlier = [
            {"role": "user", "content": "Read this material; questions follow.\n\n" + tokenizer.decode(filler)},
            {"role": "assistant", "content": "I have read it."},
        ]
        return tokenizer.apply_chat_template(
            earlier + chat_messages(text, dataset), add_generation_prompt=True, return_tensors="pt", return_dict=True
        )["input_ids"]


def environment(args, device: torch.device) -> dict:
    """What a result was measured with: versions, threads, device, dtype, the command and the revision."""
    import transformers

    return {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "threads": torch.get_num_threads(),
        "device": str(device),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "dtype": args.dtype,
        "max_new_tokens": args.max_new_tokens,
        "repeats": args.repeats,
        "command": args.command,
        "native_half_precision": native_half_precision(device),
        **provenance(),
    }


def write_report(stem: Path, result: dict, args, device: torch.device, summarize_rows) -> None:
    """
    Adds the environment and the summary (`summarize_rows(result)`) to `result`, writes `stem.json` and prints the
    table the results page renders for it.
    """
    from utils.render_results import result_table

    result["environment"] = environment(args, device)
    result["summary"] = summarize_rows(result)
    stem.with_suffix(".json").write_text(json.dumps(result, indent=1))
    print("\n".join(result_table(stem.name, result)))
    print(f"written: {stem.with_suffix('.json')}")
