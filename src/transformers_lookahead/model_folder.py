"""A model folder that carries lookahead decoding: stock Transformers loads it with lookahead on."""

from __future__ import annotations

import copy
import os
import re
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .compatibility import TORCH_REQUIREMENT, TRANSFORMERS_REQUIREMENT, mark_as_user_config
from .configuration_lookahead import AUTO, LOOKAHEAD_FIELDS, LookaheadConfig

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

PACKAGE_DIR = Path(__file__).parent
# The modules that become `custom_generate/generate.py`: the Hub repository's (the core) and a model folder's (all
# the package adds); the modules an entry imports keep their names beside it.
HUB_ENTRY = "hub_generate"
FOLDER_ENTRY = "folder_generate"
# The relative imports Transformers follows when it loads a `custom_generate/` folder (the same pattern).
_RELATIVE_IMPORT = re.compile(r"^\s*from\s+\.(\w+)\s+import", flags=re.MULTILINE)


def custom_generate_files(entry: str = HUB_ENTRY) -> dict[str, str]:
    """
    The files of a self-contained `custom_generate/` folder, by name: `generate.py` (the `entry` module), every
    package module it imports directly or not (verbatim: they import each other with relative imports only, which
    Transformers follows), and a `requirements.txt` that Transformers checks before running the code.

    Args:
        entry (`str`, *optional*): `HUB_ENTRY` (the core) or `FOLDER_ENTRY` (everything the package adds).
    """
    if entry not in (HUB_ENTRY, FOLDER_ENTRY):
        raise ValueError(f"`entry` must be one of {(HUB_ENTRY, FOLDER_ENTRY)}, got {entry!r}.")
    files, pending = {}, [entry]
    while pending:
        module = pending.pop()
        name = "generate.py" if module == entry else f"{module}.py"
        if name in files:
            continue
        files[name] = (PACKAGE_DIR / f"{module}.py").read_text(encoding="utf-8")
        pending.extend(_RELATIVE_IMPORT.findall(files[name]))
    # Transformers reads one comparison per line, so each bound gets its own line.
    requirements = [f"transformers{bound}" for bound in TRANSFORMERS_REQUIREMENT]
    requirements += [f"torch{bound}" for bound in TORCH_REQUIREMENT]
    files["requirements.txt"] = "\n".join(requirements) + "\n"
    return dict(sorted(files.items()))


def write_custom_generate(directory: str | os.PathLike, entry: str = HUB_ENTRY) -> Path:
    """
    Writes the self-contained `custom_generate/` folder of `entry` (see `custom_generate_files`) into `directory`
    (created if missing), replacing one that is there: `model.generate(..., custom_generate=directory,
    trust_remote_code=True)` then decodes with lookahead where only torch and Transformers are installed, and so
    does a model folder holding it once loaded with `from_pretrained(directory, trust_remote_code=True)`. Returns the
    `custom_generate/` folder.
    """
    folder = Path(directory) / "custom_generate"
    staging = folder.with_name("custom_generate.part")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    for name, text in custom_generate_files(entry).items():
        (staging / name).write_text(text, encoding="utf-8")
    # Replaced whole: a module an older version wrote and this one no longer has must not stay behind.
    shutil.rmtree(folder, ignore_errors=True)
    staging.rename(folder)
    return folder


def save_lookahead_model(
    model: PreTrainedModel,
    save_directory: str | os.PathLike,
    tokenizer: PreTrainedTokenizerBase | None = None,
    **lookahead_settings: Any,
) -> Path:
    """
    Writes `model` (and `tokenizer`) to a folder that decodes with lookahead wherever it is loaded with
    `trust_remote_code=True`: `AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).generate(...)`,
    `transformers serve folder --trust-remote-code`, pipelines. The folder holds the weights, the tokenizer, a
    `generation_config.json` with the `lookahead_*` fields, and a self-contained `custom_generate/` (see
    `write_custom_generate`): where the folder is loaded, only torch and Transformers need to be installed.

    Calls on the loaded model use the saved fields unless they pass their own; `lookahead_window="off"` in a call or a
    request's generation config decodes without lookahead.

    Args:
        model (`PreTrainedModel`): the model to save; it is not changed.
        save_directory (`str` or `os.PathLike`): the folder to write (created if missing).
        tokenizer (`PreTrainedTokenizerBase`, *optional*): saved beside the model, as servers load it from there.
        lookahead_settings: `lookahead_*` fields to save (e.g. `lookahead_window=7`); fields not given keep the
            model's generation config values, and `lookahead_window` defaults to `"auto"` if neither sets it.
    """
    unknown = sorted(set(lookahead_settings) - set(LOOKAHEAD_FIELDS))
    if unknown:
        raise ValueError(f"Unknown lookahead settings {unknown}; the fields are {list(LOOKAHEAD_FIELDS)}.")
    generation_config = copy.deepcopy(model.generation_config)
    for field, value in lookahead_settings.items():
        setattr(generation_config, field, value)
    if getattr(generation_config, "lookahead_window", None) is None:
        generation_config.lookahead_window = AUTO
    # Refuse bad values now, not at the first request of a server.
    LookaheadConfig.from_sources(generation_config)
    mark_as_user_config(generation_config)

    folder = Path(save_directory)
    model.save_pretrained(folder)
    # Written after the model's own: the model's generation config stays as it was.
    generation_config.save_pretrained(folder)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    write_custom_generate(folder, FOLDER_ENTRY)
    return folder
