"""A model folder that carries lookahead decoding: stock Transformers loads it with lookahead on."""

from __future__ import annotations

import copy
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .compatibility import mark_as_user_config
from .configuration_lookahead import AUTO, LOOKAHEAD_FIELDS, LookaheadConfig

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

HUB_FOLDER = Path(__file__).parent / "hub"


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
    `generation_config.json` with the `lookahead_*` fields, and `custom_generate/` (the package's entry point, which
    needs `transformers-lookahead` installed where the folder is loaded; see its `requirements.txt`).

    Calls on the loaded model use the saved fields unless they pass their own; `lookahead_window="off"` in a call or a
    request's generation config decodes without lookahead.

    Args:
        model (`PreTrainedModel`): the model to save; it is not changed.
        save_directory (`str` or `os.PathLike`): the folder to write (created if missing).
        tokenizer (`PreTrainedTokenizerBase`, *optional*): saved beside the model, as servers load it from there.
        lookahead_settings: `lookahead_*` fields to save (e.g. `lookahead_window=7`); fields not given keep the
            model's generation config values, and `lookahead_window` defaults to `"auto"` if neither sets it.

    Returns:
        `Path`: the folder.
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
    shutil.copytree(HUB_FOLDER / "custom_generate", folder / "custom_generate", dirs_exist_ok=True)
    return folder
