"""
The decoding methods the tools compare, in one registry: each method's name and the `generate()` keyword arguments
that run it. A tool picks its methods by name (`methods`), under these names in its results.
"""

from __future__ import annotations

from utils.transformers_compatibility import compile_config

# A static cache sized once for every prompt, so that compiled forwards keep one cache shape across calls.
STATIC_CACHE = {"cache_implementation": "static", "max_cache_len": 1024}
# Plain `generate` compiles its forward on accelerators only unless told otherwise; this compiles on any device.
COMPILED = {"compile_config": compile_config(mode="default")}

METHODS = {
    "greedy": {},
    "prompt_lookup": {"prompt_lookup_num_tokens": 10},
    "lookahead_15_5_15": {"lookahead_window": 15, "lookahead_ngram": 5, "lookahead_guess": 15},
    "lookahead_7_5_7": {"lookahead_window": 7, "lookahead_ngram": 5, "lookahead_guess": 7},
    "lookahead_auto": {"lookahead_window": "auto"},
    "greedy_static": STATIC_CACHE,
    "greedy_static_compiled": {**STATIC_CACHE, **COMPILED},
    "lookahead_auto_static": {**STATIC_CACHE, "lookahead_window": "auto"},
    "lookahead_auto_static_compiled": {**STATIC_CACHE, "lookahead_window": "auto", **COMPILED},
}


def methods(*names: str, without_memory: bool = False) -> dict[str, dict]:
    """
    The named methods' keyword arguments, in the order named.

    Args:
        names (`str`): names of `METHODS`.
        without_memory (`bool`, *optional*, defaults to `False`): run `"auto"` without the suffix memory (the fixed
            shapes never use it), as a tool that repeats a prompt must (the repeat would otherwise recall the whole
            text from the first run).
    """
    unknown = [name for name in names if name not in METHODS]
    if unknown:
        raise ValueError(f"Unknown methods {unknown}; the methods are {list(METHODS)}.")
    chosen = {name: dict(METHODS[name]) for name in names}
    if without_memory:
        for kwargs in chosen.values():
            if kwargs.get("lookahead_window") == "auto":
                kwargs["lookahead_memory"] = False
    return chosen
