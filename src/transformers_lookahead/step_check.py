"""
Whether a model computes a lookahead step as plain decoding computes the same tokens: a few-token check of the model
itself, run once per model before its first lookahead call, instead of a list of architectures that would be out of
date with the next Transformers release.
"""

from __future__ import annotations

import weakref

import torch
from transformers import Cache, DynamicCache, GenerationMixin, PreTrainedModel
from transformers.utils import logging

from .chain_steps import LONGEST_CHAIN_CHECKED, ChainCommitter, ChainLayout, chain_only_reason, committer_for
from .compatibility import RECURRENT_LAYERS, DynamicLayer, is_shared_layer
from .step_forward import StepForward, cache_argument
from .step_layout import RowStep, StepLayout, generate_position_shift
from .token_tree import TokenTree

logger = logging.get_logger(__name__)

# How far a step's logits may be from one-token passes', as a share of the logits' spread: a pass over several tokens
# sums in another order (last bits: about 3e-7 in fp32 on tiny Llama, Qwen3, Gemma 3, DeepSeek-V3, OLMo 2 and Phi-3;
# more in half precision); a token at a wrong position or seeing a key the mask hides moves the logits by a large
# share of their spread, and a model that loops over its layers (HRM, 1e-3) amplifies the last bits until greedy
# tokens differ.
TOLERANCE = {torch.float32: 1e-5, torch.float64: 1e-12}
HALF_PRECISION_TOLERANCE = 0.05
PREFIX_LENGTH = 5
# The widest window a model declares that `StepCheck` still checks with a step as wide (one pass of that many tokens).
LONGEST_WINDOW_CHECKED = 1024
REMEDY = "Lookahead decoding is not available for this model; remove the `lookahead_*` settings to decode as usual."


class UnevenCacheError(RuntimeError):
    """A model's cache does not hold one entry per token fed (`step_failure`)."""


class StepCheck:
    """
    Checks, once per model, that it computes a lookahead step as plain decoding does, and remembers the verdicts.
    Steps fed after a short prefix are compared with the same tokens fed one per pass (`step_failure`): a chain of two
    tokens; two branches `b` and `c d` after a shared token, `c d` not seeing `b`; and, where the config declares a
    window, a token that many hidden places into a step. For left-padded batches the model's own greedy decoding of
    a padded row must be the row's alone (`padding_failure`). A model failing either may still compute chain steps
    exactly (`chain_failure`, with and without left padding), which `generate` then takes. The verdicts are about the
    model's structure, so they hold whatever dtype, device or backend it moves to.
    """

    def __init__(self):
        self._verdicts: weakref.WeakKeyDictionary[PreTrainedModel, dict[str, str | None]] = weakref.WeakKeyDictionary()

    def check(self, model: PreTrainedModel, padded: bool = True) -> None:
        """
        Checks `model` now, if not yet (its first lookahead call does), and keeps the verdicts. `padded`: also for
        left-padded batches.
        """
        verdicts = self._verdicts.setdefault(model, {})
        training = model.training
        # Dropout would make every comparison fail: the check is of the model as it decodes.
        model.eval()
        try:
            if "steps" not in verdicts:
                layers = chain_only_reason(type(model).__name__, DynamicCache(config=model.config))
                verdicts["steps"] = layers or step_failure(model)
            if padded and verdicts["steps"] is None and "padding" not in verdicts:
                # A model numbering positions by cache slot decodes a padded row otherwise than the row alone, and
                # so do its steps, numbered alike.
                by_slot = generate_position_shift(model) is None
                verdicts["padding"] = None if by_slot else padding_failure(model)
            if (verdicts["steps"] or verdicts.get("padding")) is not None and "chain" not in verdicts:
                verdicts["chain"] = chain_failure(model)
            chain_steps = "chain" in verdicts and verdicts["chain"] is None
            if padded and chain_steps and "padded_chain" not in verdicts:
                verdicts["padded_chain"] = chain_failure(model, padding=3)
        finally:
            model.train(training)

    def chain_reason(self, model: PreTrainedModel) -> str | None:
        """
        Why `model` decodes in chain steps (what full steps fail on: any batch, else left-padded ones), or `None`
        (full steps, refused, or not checked yet).
        """
        verdicts = self._verdicts.get(model, {})
        reason = verdicts.get("steps") or verdicts.get("padding")
        return reason if reason is not None and verdicts.get("chain") is None else None

    def refuse_if_failing(self, model: PreTrainedModel, padded: bool = False, chain_steps: bool = False) -> bool:
        """
        Args:
            padded (`bool`, *optional*): whether the call's batch has left padding (then the padding check counts).
            chain_steps (`bool`, *optional*): whether the caller can decode in chain steps (`generate` can,
                continuous batching cannot).

        Returns:
            `bool`: whether the model decodes in chain steps only (said once in the log).

        Raises:
            `ValueError` naming the model's class and what it does not compute as plain decoding does.
        """
        self.check(model, padded)
        verdicts = self._verdicts[model]
        reason = verdicts["steps"]
        remedy = REMEDY
        if reason is None:
            if not padded or verdicts["padding"] is None:
                return False
            reason, remedy = (
                verdicts["padding"],
                "Decode the rows one at a time, or remove the `lookahead_*` settings.",
            )
        if verdicts["chain"] is not None:
            raise ValueError(f"{reason} {verdicts['chain']} {remedy}")
        if padded and verdicts["padded_chain"] is not None:
            raise ValueError(
                f"{reason} {verdicts['padded_chain']} Decode the rows one at a time, or remove the `lookahead_*` "
                "settings."
            )
        if not chain_steps:
            raise ValueError(
                f"{reason} `generate` decodes it in chain steps (one candidate continuation, no window), which "
                "continuous batching does not lay out: remove the `lookahead_*` settings to batch it continuously."
            )
        logger.warning_once(
            f"{reason} Lookahead decodes it in chain steps: the pending tokens and one candidate continuation at "
            "consecutive positions, no window, fed as plain decoding feeds several tokens."
        )
        return True


def step_failure(model: PreTrainedModel) -> str | None:
    """
    Why `model` cannot decode full lookahead steps exactly (`StepCheck`), a sentence naming its class, or `None` when
    it can.
    """
    name = type(model).__name__
    ids = _ordinary_ids(model, PREFIX_LENGTH + 3)
    prefix, (a, b, c) = ids[:PREFIX_LENGTH], ids[PREFIX_LENGTH:]
    d, p = prefix[1], PREFIX_LENGTH
    causal = [[True] * (row + 1) + [False] * (3 - row) for row in range(4)]
    try:
        with torch.no_grad():
            plain_b = _one_token_passes(model, prefix, [a, b])
            plain_cd = _one_token_passes(model, prefix, [a, c, d])
            chain = _step(model, prefix, [a, b], [p, p + 1], [row[:2] for row in causal[:2]])
            # `b` and `c d` after `a`: `c` and `d` see `a` and each other, not `b`.
            branches_visible = [[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]]
            branches = _step(model, prefix, [a, b, c, d], [p, p + 1, p + 1, p + 2], branches_visible)
    except UnevenCacheError as error:
        return f"`{name}` cannot decode lookahead steps: {error}."
    except Exception as error:  # noqa: BLE001 - whatever the model raises on a step is the reason it is refused
        return f"`{name}` failed on a lookahead step's forward pass ({type(error).__name__}: {error})."
    if not _close(chain, plain_b, model.dtype):
        return (
            f"`{name}` computes a pass over several tokens otherwise than one token per pass (checked on a two-token "
            "step before decoding), so a step's tokens would not be plain greedy's."
        )
    if _close(branches, torch.cat([plain_b, plain_cd[1:]]), model.dtype):
        far = _farthest_window(model)
        if far is None:
            return None
        # After a prefix longer than the model's widest window, `c` behind as many hidden tokens: a model that applies
        # its windows by index in the pass (GPT-Neo's local attention), or selects keys among all those of the pass,
        # hides `a` from it, though `a` is one position back.
        long_prefix = [ids[index % len(ids)] for index in range(far + 2)]
        fillers, q = [b] * far, len(long_prefix)
        visible = [[1] + [0] * far + [0]]
        visible += [[1] + [int(j == i) for j in range(far)] + [0] for i in range(far)]
        visible += [[1] + [0] * far + [1]]
        with torch.no_grad():
            plain_c = _one_token_passes(model, long_prefix, [a, c])[1:]
            distant = _step(model, long_prefix, [a, *fillers, c], [q] + [q + 1] * (far + 1), visible)[-1:]
        if _close(distant, plain_c, model.dtype):
            return None
        return (
            f"`{name}` applies an attention window of its own inside the pass (by a token's place in the pass, or "
            f"by choosing among the pass's keys): a token {far + 1} places into a step no longer sees the keys one "
            "position back, so a step wider than its window would decode other tokens."
        )
    with torch.no_grad():
        # What the model makes of a hidden key and of a moved position, against the chain `a b c`.
        seen = _step(model, prefix, [a, b, c], [p, p + 1, p + 2], [row[:3] for row in causal[:3]])[2]
        hidden = _step(model, prefix, [a, b, c], [p, p + 1, p + 2], [[1, 0, 0], [1, 1, 0], [1, 0, 1]])[2]
        moved = _step(model, prefix, [a, b, c], [p, p + 1, p + 3], [row[:3] for row in causal[:3]])[2]
    ignored = []
    if _close(hidden, seen, model.dtype):
        ignored.append("the step's 4D attention mask (a token sees keys the mask hides)")
    if _close(moved, seen, model.dtype):
        ignored.append("the step's `position_ids` (it places tokens by their index in the cache)")
    cannot = f"`{name}` cannot hold a lookahead step's candidate continuations in one pass"
    if not ignored:
        return (
            f"{cannot}: its logits differ from one-token passes' given a position and a mask that one-token passes "
            "never see."
        )
    return (
        f"{cannot}: it ignores {' and '.join(ignored)}. A step places branches side by side at chosen positions, each "
        "hidden from the others by the mask."
    )


def token_count(cache: Cache) -> int:
    """
    The tokens `cache` holds, as its first layer with an entry per token counts them (a recurrent layer's own count is
    the model's to keep, and some models keep none).
    """
    for layer in cache.layers:
        if not is_shared_layer(layer) and (type(layer) not in RECURRENT_LAYERS or isinstance(layer, DynamicLayer)):
            return int(layer.get_seq_length())
    return int(cache.get_seq_length())


def chain_failure(model: PreTrainedModel, padding: int = 0) -> str | None:
    """
    Why `model` cannot decode chain steps exactly (`ChainLayout`), a sentence, or `None` when it can:
    `LONGEST_CHAIN_CHECKED` tokens after a prefix fed as one chain step against the same tokens fed one per pass
    (chain steps are no longer: a model may choose among a long pass's keys otherwise, as an attention indexer
    does; indexed layers' steps also stay within their `index_topk` keys, `ChainCommitter.room`, so every step
    `generate` takes is of the kind checked here). The prefix is longer than the widest window the config declares
    (if at most `LONGEST_WINDOW_CHECKED`), so that a model choosing among the pass's keys for its window (Doge)
    chooses otherwise than in one-token passes.
    Where the cache holds recurrent states, the step is then undone (`ChainCommitter.undo`) and its tokens fed again
    one per pass: a state the model keeps beyond the cache's would show there. With `padding`, the prefix is
    left-padded by that many slots and every pass given the padding mask and the positions `generate` gives it.
    """
    ids = _ordinary_ids(model, PREFIX_LENGTH + 3)
    prefix = ids[:PREFIX_LENGTH]
    tokens = chain_tokens(model, ids[PREFIX_LENGTH:])
    far = _farthest_window(model)
    if far is not None and not padding:
        prefix = [ids[index % PREFIX_LENGTH] for index in range(far + 2)]
    shift, start = generate_position_shift(model), len(prefix)
    try:
        with torch.no_grad():
            plain = _one_token_passes(model, prefix, tokens, padding)
            cache = _prefilled(model, prefix, padding)
            committer = committer_for(cache, owner=type(model).__name__)
            committer.start()
            committer.before_step(feeds_guesses=True)
            layout = ChainLayout.for_model(model)
            tree = TokenTree()
            for depth, token in enumerate(tokens[1:], start=1):
                tree.ensure_child(depth - 2, token, depth)
            row = layout.row(tokens[:1], start + (padding if shift is None else shift), None, tree)
            slot_valid = torch.tensor([[False] * padding + [True] * start], device=model.device) if padding else None
            chain = StepForward(model, cache)(layout.build(cache, [row], slot_valid))[0].float()
            held = token_count(cache) - padding
            again = None
            if isinstance(committer, ChainCommitter) and committer.states is not None and not padding:
                committer.undo(len(tokens))
                again = torch.stack([_plain_pass(model, [token], start + i, cache) for i, token in enumerate(tokens)])
    except Exception as error:  # noqa: BLE001 - whatever the model raises on a chain step is why it is refused
        if padding:
            return f"It fails on a chain step after left padding ({type(error).__name__}: {error})."
        return f"It also fails on a chain step ({type(error).__name__}: {error})."
    if padding:
        if _close(chain, plain, model.dtype):
            return None
        return (
            f"After left padding, a chain step of {len(tokens)} tokens gives other logits than as many one-token "
            "passes, so lookahead cannot give plain greedy's output for a left-padded batch."
        )
    if held != start + len(tokens):
        return f"Its cache also holds {held} entries after {start + len(tokens)} tokens in a chain step."
    if not _close(chain, plain, model.dtype):
        return (
            f"A chain step of {len(tokens)} tokens (the padding id among them) also gives other logits than "
            f"{len(tokens)} one-token passes."
        )
    if again is not None and not _close(again, plain, model.dtype):
        return (
            "Undoing a chain step (its recurrent states put back, its entries cropped) leaves the model otherwise "
            "than before it: it keeps state the cache does not hold."
        )
    return None


def chain_tokens(model: PreTrainedModel, ordinary: list[int]) -> list[int]:
    """
    The `LONGEST_CHAIN_CHECKED` tokens of a checked chain: `ordinary` tokens repeated, the padding id among them (a
    text may hold it, and a model that takes it for padding inside a pass decodes such a text otherwise).
    """
    tokens = [ordinary[index % len(ordinary)] for index in range(LONGEST_CHAIN_CHECKED)]
    pad = model.generation_config.pad_token_id
    if isinstance(pad, int) and 0 <= pad < model.config.get_text_config(decoder=True).vocab_size:
        tokens[2] = pad
    return tokens


def padding_failure(model: PreTrainedModel) -> str | None:
    """
    Why lookahead cannot decode `model` in a left-padded batch, or `None`: where the model's own greedy decoding of a
    left-padded row differs from the row alone (it treats padding as text somewhere), a lookahead step, which hides
    padding as a mask must, cannot give plain greedy's output.
    """
    row = _ordinary_ids(model, PREFIX_LENGTH + 1)
    pad = _pad_id(model)
    device, padding = model.device, 3
    outputs = []
    try:
        with torch.no_grad():
            for ids, mask in (
                (row, [1] * len(row)),
                ([pad] * padding + row, [0] * padding + [1] * len(row)),
            ):
                out = GenerationMixin.generate(
                    model,
                    input_ids=torch.tensor([ids], device=device),
                    attention_mask=torch.tensor([mask], device=device),
                    max_new_tokens=3,
                    do_sample=False,
                    pad_token_id=pad,
                    output_logits=True,
                    return_dict_in_generate=True,
                )
                outputs.append(torch.stack([logits[0].float() for logits in out.logits]))
    except Exception as error:  # noqa: BLE001 - a model plain greedy cannot decode padded is refused padded batches
        outputs = [error]
    if len(outputs) == 2 and outputs[0].shape == outputs[1].shape and _close(outputs[1], outputs[0], model.dtype):
        return None
    return (
        f"`{type(model).__name__}`'s own greedy decoding of a left-padded row differs from the row alone (the "
        "model treats padding as text), so a lookahead step, which hides padding, cannot give its output for a "
        "left-padded batch."
    )


def _farthest_window(model: PreTrainedModel) -> int | None:
    """
    The widest attention window or chunk the model's config declares (fields named for windows or chunks), if it is
    at most `LONGEST_WINDOW_CHECKED`: a step that wide is worth one pass to check; a wider window is left unchecked.
    """
    config = model.config.get_text_config(decoder=True)
    windows = [
        value
        for name, value in vars(config).items()
        if isinstance(value, int)
        and not isinstance(value, bool)
        and value > 0
        and ("window" in name or "chunk" in name)
    ]
    return max(windows) if windows and max(windows) <= LONGEST_WINDOW_CHECKED else None


def _plain_pass(
    model: PreTrainedModel, tokens: list[int], start: int, cache: DynamicCache, padding: int = 0
) -> torch.Tensor:
    """
    One pass of plain decoding over `tokens` from position `start`, after `padding` left-padding slots (fed with the
    first pass): the mask and position ids as `generate` prepares them (none for a model that numbers positions
    itself, shifted as its preparation shifts them: `generate_position_shift`). Returns the last token's logits.
    """
    kwargs = {cache_argument(model): cache, "use_cache": True}
    positions = list(range(start, start + len(tokens)))
    if padding:
        kwargs["attention_mask"] = torch.tensor([[0] * padding + [1] * (start + len(tokens))], device=model.device)
        if start == 0:
            tokens, positions = [_pad_id(model)] * padding + tokens, [1] * padding + positions
    shift = generate_position_shift(model)
    if shift is not None:
        kwargs["position_ids"] = torch.tensor([positions], device=model.device) + shift
    return model(input_ids=torch.tensor([tokens], device=model.device), **kwargs).logits[0, -1].float()


def _prefilled(model: PreTrainedModel, prefix: list[int], padding: int = 0) -> DynamicCache:
    cache = DynamicCache(config=model.config)
    _plain_pass(model, prefix, 0, cache, padding)
    return cache


def _one_token_passes(model: PreTrainedModel, prefix: list[int], tokens: list[int], padding: int = 0) -> torch.Tensor:
    """The logits after each of `tokens`, fed one per pass after `prefix`, as plain decoding feeds them."""
    cache = _prefilled(model, prefix, padding)
    start = len(prefix)
    return torch.stack([_plain_pass(model, [token], start + i, cache, padding) for i, token in enumerate(tokens)])


def _ordinary_ids(model: PreTrainedModel, count: int) -> list[int]:
    """`count` ordinary token ids from the middle of the vocabulary (the first are often padding or special)."""
    vocab = model.config.get_text_config(decoder=True).vocab_size
    return [vocab // 3 + offset for offset in range(count)]


def _pad_id(model: PreTrainedModel) -> int:
    pad = model.generation_config.pad_token_id
    return pad if isinstance(pad, int) else 0


def _step(
    model: PreTrainedModel, prefix: list[int], tokens: list[int], positions: list[int], visible: list[list[int]]
) -> torch.Tensor:
    """
    The logits of every token of one step after `prefix`, laid out and fed as lookahead steps are (`positions` from 0
    for the first token of the prefix, shifted as `generate` shifts them).
    """
    cache = _prefilled(model, prefix)
    device = model.device
    row = RowStep(
        tokens,
        torch.tensor(tokens, device=device),
        torch.tensor(positions, device=device) + (generate_position_shift(model) or 0),
        torch.tensor(visible, dtype=torch.bool, device=device),
        list(range(len(tokens))),
        1,
        False,
        1,
        1,
    )
    layout = StepLayout.for_model(model, cache, window=1, levels=1)
    logits = StepForward(model, cache)(layout.build(cache, [row]))[0].float()
    held = cache.get_seq_length()
    if held != len(prefix) + len(tokens):
        # Dropping a step's rejected tokens crops their entries by count: one entry per token, or nothing works.
        raise UnevenCacheError(
            f"its cache holds {held} entries after {len(prefix) + len(tokens)} tokens (its layers write more or "
            "fewer than one entry per token), so a step's rejected tokens cannot be dropped"
        )
    return logits


def _close(step: torch.Tensor, plain: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether a step's logits (in float32) are plain decoding's, within the tolerance of the model's `dtype`."""
    spread = float(plain.max() - plain.min()) or 1.0
    tolerance = TOLERANCE.get(dtype, HALF_PRECISION_TOLERANCE) * spread
    return step.shape == plain.shape and bool(((step - plain).abs() <= tolerance).all())
