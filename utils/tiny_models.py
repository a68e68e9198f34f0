"""
Tiny random models of several architectures, built from configs (no downloads): what the tests, `make gpu-check`
and the registry document run on.
"""

from __future__ import annotations

import torch
import transformers

from utils.transformers_compatibility import model_from_config

VOCAB = 96
# A large init spread makes tiny random models produce varied text; the default 0.02 repeats one token and hides
# most bugs of a speculative decoder.
INIT_RANGE = 0.3

_COMMON = {"vocab_size": VOCAB, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": None}
_DECODER = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "initializer_range": INIT_RANGE,
}

TINY_CONFIGS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", _DECODER),
    "mistral": ("MistralConfig", "MistralForCausalLM", _DECODER),  # sliding_window=4096: sliding cache layers
    "mistral_window8": ("MistralConfig", "MistralForCausalLM", {**_DECODER, "sliding_window": 8}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", _DECODER),
    "qwen2_hybrid": (
        "Qwen2Config",
        "Qwen2ForCausalLM",
        {**_DECODER, "num_hidden_layers": 3, "use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1},
    ),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {**_DECODER, "head_dim": 8}),
    "gemma3": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        {
            **_DECODER,
            "head_dim": 8,
            "num_hidden_layers": 3,
            "sliding_window": 8,
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
            # With tied embeddings scaled by sqrt(hidden_size), a tiny Gemma repeats one token.
            "tie_word_embeddings": False,
        },
    ),
    "gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        {
            **_DECODER,
            "head_dim": 8,
            "num_hidden_layers": 3,
            "sliding_window": 8,
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
            "tie_word_embeddings": False,
        },
    ),
    "cohere2": (
        "Cohere2Config",
        "Cohere2ForCausalLM",
        {
            **_DECODER,
            "num_hidden_layers": 3,
            "sliding_window": 8,
            "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
            "tie_word_embeddings": False,
        },
    ),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", _DECODER),
    "stablelm": ("StableLmConfig", "StableLmForCausalLM", _DECODER),
    "gpt2": (
        "GPT2Config",
        "GPT2LMHeadModel",
        {"n_embd": 32, "n_layer": 2, "n_head": 4, "n_positions": 512, "initializer_range": INIT_RANGE},
    ),
    "gpt_neox": (
        "GPTNeoXConfig",
        "GPTNeoXForCausalLM",
        {
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "max_position_embeddings": 512,
            "initializer_range": INIT_RANGE,
        },
    ),
    "opt": (
        "OPTConfig",
        "OPTForCausalLM",
        {
            "hidden_size": 32,
            "ffn_dim": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "word_embed_proj_dim": 32,
            "max_position_embeddings": 512,
            "init_std": INIT_RANGE,
        },
    ),
}


# Families without an sdpa path in Transformers (Gemma 2 caps its attention logits).
EAGER_ONLY = ("gemma2",)


def tiny_model(name: str, attn_implementation: str | None = None, seed: int = 0, **config_overrides):
    """
    A tiny fp32 random model of architecture `name` (a key of `TINY_CONFIGS`), in eval mode; `sdpa` attention unless
    told otherwise or the family has none. `config_overrides` replace entries of its config.
    """
    if attn_implementation is None:
        attn_implementation = "eager" if name in EAGER_ONLY else "sdpa"
    config_class, model_class, kwargs = TINY_CONFIGS[name]
    config = getattr(transformers, config_class)(**_COMMON, **{**kwargs, **config_overrides})
    torch.manual_seed(seed)
    model = model_from_config(getattr(transformers, model_class), config, attn_implementation)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.eval()


def random_prompt(length: int, seed: int = 0) -> torch.LongTensor:
    """A prompt of `length` tokens, avoiding the special ids 0 and 1, with some repeats for the pool to find."""
    generator = torch.Generator().manual_seed(seed)
    base = torch.randint(2, VOCAB, (max(length // 2, 1),), generator=generator)
    return torch.cat([base, base])[:length][None] if length > 1 else base[:length][None]


def left_padded(prompts: list[torch.LongTensor], pad_id: int = 0) -> dict[str, torch.Tensor]:
    """What a tokenizer with `padding_side="left"` returns for these `(1, length)` prompts: ids and attention mask."""
    length = max(prompt.shape[-1] for prompt in prompts)
    input_ids = torch.full((len(prompts), length), pad_id, dtype=torch.long, device=prompts[0].device)
    attention_mask = torch.zeros_like(input_ids)
    for row, prompt in enumerate(prompts):
        input_ids[row, length - prompt.shape[-1] :] = prompt.flatten()
        attention_mask[row, length - prompt.shape[-1] :] = 1
    return {"input_ids": input_ids, "attention_mask": attention_mask}
