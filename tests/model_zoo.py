"""
Transformers' own model zoo, built tiny and random from each architecture's config class: no list of architectures
and no per-model settings, so a new Transformers release's models are tested the day it is installed.

`shrink` makes any config small by what its fields are called (sizes, layer counts, heads, experts, windows), keeping
one layer of every kind the config lays out; `build` makes the model; `zoo` lists the architectures of the mappings
the zoo covers.
"""

from __future__ import annotations

import inspect
import re
import sys
from dataclasses import dataclass
from typing import Any

import torch
import transformers
from transformers import AutoConfig, PretrainedConfig
from transformers.models.auto import modeling_auto

VOCAB = 128
# Sizes by field name (the first rule that matches a field sets it); a field larger than the value shrinks to it.
SIZE_RULES: tuple[tuple[str, int], ...] = (
    (r"vocab", VOCAB),
    (r"(hidden_size|^d_model|^n_embd|^dim|emb_dim|embed_dim|model_dim|word_embed_proj_dim)", 64),
    (r"(intermediate|ffn_dim|inner_dim|n_inner|d_ff|d_inner|mlp_dim|^dff$)", 128),
    (r"attention_head_dim$", 16),
    (r"^(num_attention_heads|n_head|n_heads|num_heads|decoder_attention_heads|encoder_attention_heads)$", 4),
    (r"(num_key_value_heads|num_kv_heads|n_kv_heads|multi_query_group_num)$", 2),
    (r"^head_dim$", 16),
    (r"^(index|linear)_\w*head_dim$", 16),
    (r"^(kv_lora_rank|q_lora_rank)$", 32),
    (r"^qk_rope_head_dim$", 8),
    (r"^(qk_nope_head_dim|v_head_dim)$", 16),
    (r"^qk_head_dim$", 24),
    (r"(num_experts|num_local_experts|n_routed_experts|moe_num_experts)$", 4),
    (r"(num_experts_per_tok|num_experts_per_token|moe_topk|top_k)$", 2),
    (r"(n_group|topk_group)$", 1),
    (r"max_position_embeddings$|^n_positions$|^n_ctx$", 512),
    (r"(sliding_window|attention_chunk_size|window_size|window_len|local_window)", 8),
    (r"index_topk$", 4),
    (r"pool_size$", 64),
    # State-space layers: the state's size, and the chunks their scan runs over a pass in.
    (r"(d_state|ssm_state_size)$", 16),
    (r"chunk_size$", 16),
)
LAYER_FIELDS = ("num_hidden_layers", "n_layer", "n_layers", "num_layers", "decoder_layers")
# Size fields a config class may leave unset (`None`) for its model to derive, which some models do not: these take
# their rule's size (a `None` window or expert count means none, and stays).
FILLED_WHEN_UNSET = re.compile(r"^(head_dim|num_key_value_heads|moe_intermediate_size|intermediate_size)$")


def shrink(config: PretrainedConfig, layers: bool = True) -> PretrainedConfig:
    """
    `config`, made tiny in place (its sub-configs too), as the module docstring says. With `layers=False` the layer
    count is kept (for configs whose layers refer to each other, e.g. by sharing caches).
    """
    token_ids = 0
    for name, value in list(vars(config).items()):
        if isinstance(value, PretrainedConfig):
            shrink(value, layers)
        elif isinstance(value, (list, tuple)) and value and all(isinstance(item, PretrainedConfig) for item in value):
            for item in value:
                shrink(item, layers)
        elif value is None and FILLED_WHEN_UNSET.search(name):
            _set(config, name, next(size for pattern, size in SIZE_RULES if re.search(pattern, name)))
        elif isinstance(value, int) and not isinstance(value, bool):
            if re.search(r"_token_(id|index)$", name) and value >= VOCAB:
                # Special tokens inside the shrunk vocabulary, each its own.
                token_ids += 1
                _set(config, name, 0 if name == "pad_token_id" else VOCAB - token_ids)
                continue
            for pattern, size in SIZE_RULES:
                if re.search(pattern, name):
                    if value > size:
                        _set(config, name, size)
                    break
    # Sizes derived from others: rotary dimensions within a head, multi-head latent attention's head sizes.
    if "kv_lora_rank" in vars(config) and "num_attention_heads" in vars(config):
        # Latent attention expands keys and values for every head.
        _set(config, "num_key_value_heads", config.num_attention_heads)
    if "qk_rope_head_dim" in vars(config):
        _set(config, "head_dim", config.qk_rope_head_dim)
        _set(config, "qk_head_dim", config.qk_rope_head_dim + vars(config).get("qk_nope_head_dim", 0))
    fields = vars(config)
    if all(isinstance(fields.get(name), int) for name in ("expand", "hidden_size", "num_heads", "head_dim")):
        # A state-space mixer's heads fill its expanded width (Mamba-2).
        _set(config, "num_heads", max(1, config.expand * config.hidden_size // config.head_dim))
    for name in ("rotary_dim", "rotary_emb_dim"):
        if isinstance(vars(config).get(name), int):
            _set(config, name, 8)
    _fit_rotary_sections(config)
    if layers:
        _keep_one_layer_of_each_kind(config)
    if "is_decoder" in vars(config):
        config.is_decoder = True
    config.initializer_range = 0.3
    return config


def _fit_rotary_sections(config: PretrainedConfig) -> None:
    """
    Multimodal rotary sections (`rope_parameters["mrope_section"]`, Qwen2-VL's and GLM-4V's) split half a head's
    rotary dimensions: scaled in proportion to the shrunk head.
    """
    rope = vars(config).get("rope_parameters")
    if not isinstance(rope, dict) or not isinstance(rope.get("mrope_section"), (list, tuple)):
        return
    fields = vars(config)
    head_dim = fields.get("head_dim")
    if not head_dim and fields.get("hidden_size") and fields.get("num_attention_heads"):
        head_dim = fields["hidden_size"] // fields["num_attention_heads"]
    if not head_dim:
        return
    partial = rope.get("partial_rotary_factor", fields.get("partial_rotary_factor")) or 1.0
    total, sections = int(head_dim * partial) // 2, list(rope["mrope_section"])
    scaled = [max(1, section * total // sum(sections)) for section in sections[:-1]]
    rope["mrope_section"] = type(rope["mrope_section"])([*scaled, total - sum(scaled)])


def _configs(config: PretrainedConfig) -> list[PretrainedConfig]:
    """`config` and every config inside it."""
    found = [config]
    for value in vars(config).values():
        if isinstance(value, PretrainedConfig):
            found += _configs(value)
    return found


def _set(config: PretrainedConfig, name: str, value: Any) -> None:
    # Some fields are derived (a property without a setter) or per layer (set through the layers' own configs).
    try:
        setattr(config, name, value)
    except Exception:  # noqa: BLE001 - any refusal of a config to take a value leaves that field as it was
        pass


def _keep_one_layer_of_each_kind(config: PretrainedConfig) -> None:
    """Two layers, or one of every kind `layer_types` names; every per-layer list follows the layers kept."""
    for field in LAYER_FIELDS:
        layers = vars(config).get(field)
        if isinstance(layers, int) and layers > 0:
            break
    else:
        return
    per_layer = {
        name: value
        for name, value in vars(config).items()
        if isinstance(value, (list, tuple)) and len(value) == layers and name != "architectures"
    }
    chosen, seen = [], set()
    for index, kind in enumerate(per_layer.get("layer_types", ())):
        if str(kind) not in seen:
            seen.add(str(kind))
            chosen.append(index)
    for index in range(layers):
        if len(chosen) >= 2:
            break
        if index not in chosen:
            chosen.append(index)
    chosen.sort()
    _set(config, field, len(chosen))
    for name, value in per_layer.items():
        _set(config, name, type(value)(value[index] for index in chosen))


@dataclass
class Architecture:
    model_type: str
    class_name: str
    mapping: str


def zoo() -> list[Architecture]:
    """Every architecture of the causal-LM mapping and the image-text-to-text mapping (its text path)."""
    found = []
    for mapping, names in (
        ("causal_lm", modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES),
        ("image_text_to_text", modeling_auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES),
    ):
        for model_type, class_name in names.items():
            found.append(Architecture(model_type, class_name, mapping))
    return found


def text_config(config: PretrainedConfig, model_class: type) -> PretrainedConfig:
    """The config `model_class` takes: `config` itself, or the sub-config of its class (a causal LM's text config)."""
    wanted = getattr(model_class, "config_class", None)
    if wanted is None or isinstance(config, wanted):
        return config
    for value in vars(config).values():
        if isinstance(value, wanted):
            return value
    return config


# A shrunk model larger than this kept a size field `shrink` does not know: it is reported, not built.
MAX_PARAMETERS = 150_000_000


def build(architecture: Architecture, layers: bool = True, seed: int = 0, **overrides: Any) -> Any:
    """
    The architecture's model, tiny and random in fp32, in eval mode (`layers`: as `shrink` takes it), with
    `overrides` set on its config after shrinking.
    """
    model_class = getattr(transformers, architecture.class_name)
    config = shrink(text_config(AutoConfig.for_model(architecture.model_type), model_class), layers)
    for name, value in overrides.items():
        setattr(config, name, value)
    if "mrope_section" in inspect.getsource(sys.modules[model_class.__module__]):
        # The model splits its rotary dimensions into sections, by default Qwen2-VL's when the config names none.
        for part in _configs(config):
            rope = vars(part).get("rope_parameters")
            if isinstance(rope, dict) and "mrope_section" not in rope:
                rope["mrope_section"] = [16, 24, 24]
                _fit_rotary_sections(part)
    with torch.device("meta"):
        parameters = sum(parameter.numel() for parameter in model_class(config).parameters())
    if parameters > MAX_PARAMETERS:
        raise ValueError(f"the shrunk config still makes {parameters:,} parameters")
    torch.manual_seed(seed)
    return model_class(config).eval()


# Learned position tables are scaled up, as trained weights have them: random ones are too weak for a model that
# places tokens at the wrong positions to produce other tokens.
POSITION_SCALE = 8.0
# A text longer than every sliding, chunked or local window `shrink` leaves (8 tokens), repeating itself so that
# lookahead's n-gram pool finds candidates that verify.
PROMPTS = (
    [5, 17, 33, 9, 5, 17, 33, 9, 5, 17, 33, 9, 41, 6],
    [70, 12, 3, 88, 12, 3, 88, 54, 23, 7],
)
NEW_TOKENS = 24


def strengthen_positions(model: torch.nn.Module) -> None:
    """Scales every embedding table named for positions by `POSITION_SCALE`."""
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Embedding) and re.search(r"pos", name, re.IGNORECASE):
                module.weight.mul_(POSITION_SCALE)


def left_padded_batch(pad_token_id: int) -> dict[str, torch.Tensor]:
    longest = max(len(prompt) for prompt in PROMPTS)
    input_ids = torch.full((len(PROMPTS), longest), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for row, prompt in enumerate(PROMPTS):
        input_ids[row, longest - len(prompt) :] = torch.tensor(prompt)
        attention_mask[row, longest - len(prompt) :] = 1
    return {"input_ids": input_ids, "attention_mask": attention_mask}


def holey_batch(pad_token_id: int) -> dict[str, torch.Tensor]:
    """
    `PROMPTS` with zeros in the mask after real tokens, as Transformers' model testers build masks: the first row
    right-padded, the second with a hole inside the prompt.
    """
    width = max(len(prompt) for prompt in PROMPTS) + 2
    input_ids = torch.full((len(PROMPTS), width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    first, second = PROMPTS
    input_ids[0, : len(first)], attention_mask[0, : len(first)] = torch.tensor(first), 1
    hole = width - len(second)
    input_ids[1, :3], input_ids[1, 3 + hole :] = torch.tensor(second[:3]), torch.tensor(second[3:])
    attention_mask[1, :3], attention_mask[1, 3 + hole :] = 1, 1
    return {"input_ids": input_ids, "attention_mask": attention_mask}


# How an exact verdict's detail starts where lookahead decoded the model in chain steps.
CHAIN_STEPS = "In chain steps"


@dataclass
class Verdict:
    """
    What lookahead did on one architecture: `exact`, `refused` (with the message) or `failed` (with what); or
    `plain greedy fails` where Transformers' own greedy decoding of the model raises.
    """

    status: str
    detail: str = ""


def verdict(model: torch.nn.Module, settings: tuple[dict, ...]) -> Verdict:
    """
    Plain greedy against lookahead with each of `settings` on `PROMPTS` one at a time, as a left-padded batch and as
    a right-padded and holey one (`holey_batch`):
    `exact` if every output is `torch.equal`, `refused` if lookahead raised a `ValueError` naming the model's class
    before the call's own prefill, else `failed`.
    """
    from transformers_lookahead import enable_lookahead

    model = enable_lookahead(model)
    strengthen_positions(model)
    pad = model.generation_config.pad_token_id
    pad = 0 if pad is None or isinstance(pad, list) else pad
    common = {"max_new_tokens": NEW_TOKENS, "do_sample": False, "pad_token_id": pad}
    inputs = [{"input_ids": torch.tensor([prompt])} for prompt in PROMPTS]
    inputs += [left_padded_batch(pad), holey_batch(pad)]
    shapes = []

    def record(module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        shapes.append(None if ids is None else tuple(ids.shape))

    model.register_forward_pre_hook(record, with_kwargs=True)
    for index, kwargs in enumerate(inputs):
        try:
            with torch.no_grad():
                expected = model.generate(**kwargs, **common)
        except Exception as error:  # noqa: BLE001 - what plain greedy cannot decode, lookahead is not asked to
            return Verdict("plain greedy fails", f"{type(error).__name__}: {error}")
        for setting in settings:
            shapes.clear()
            try:
                with torch.no_grad():
                    out = model.generate(**kwargs, **common, **setting)
            except ValueError as error:
                # Named by its class, or by the class of the part that decodes (a multimodal model's language model).
                named = any(
                    type(module).__name__ in str(error)
                    for module in model.modules()
                    if isinstance(module, transformers.PreTrainedModel)
                )
                if tuple(kwargs["input_ids"].shape) in shapes or not named:
                    return Verdict("failed", f"refused after the prefill or without naming the model: {error}")
                return Verdict("refused", str(error))
            except Exception as error:  # noqa: BLE001 - every other error is this architecture's failure
                return Verdict("failed", f"{type(error).__name__}: {error}")
            if not torch.equal(out, expected):
                return Verdict("failed", f"output differs from plain greedy (input {index}, {setting})")
    chain = model.lookahead_state.step_check.chain_reason(model)
    return Verdict("exact", "" if chain is None else f"{CHAIN_STEPS}: {chain}")


def zoo_verdict(architecture: Architecture, settings: tuple[dict, ...], state_factory) -> Verdict:
    """
    `verdict` of the architecture built tiny; where the tiny build fails, or plain greedy fails on it, built again
    with all its layers (hybrid configs that place their attention layers by period need them). `not built` where
    Transformers cannot build or decode even that.
    """
    from transformers_lookahead import enable_lookahead

    result = Verdict("not built")
    for layers in (True, False):
        try:
            model = enable_lookahead(build(architecture, layers), state_factory())
            # Checked as users have the model (what its first lookahead call would check), before `verdict`
            # strengthens its positions: that scaling, a test's device, also scales the last bits the check tolerates.
            model.lookahead_state.step_check.check(model)
        except Exception as error:  # noqa: BLE001 - a config this Transformers cannot build is reported with its error
            result = Verdict("not built", f"{type(error).__name__}: {error}")
            continue
        result = verdict(model, settings)
        if result.status != "plain greedy fails":
            return result
        result = Verdict("not built", f"plain greedy fails: {result.detail}")
    return result
