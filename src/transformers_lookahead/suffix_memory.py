"""The suffix memory: token sequences of earlier calls, indexed so that the end of a new sequence finds what followed."""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

if TYPE_CHECKING:
    from transformers import PreTrainedModel

MEMORY_FORMAT = "transformers_lookahead.suffix_memory"
MEMORY_VERSION = "1"


@dataclass(frozen=True)
class MemoryMatch:
    """
    What the memory proposes after a sequence: the continuations of the longest suffix it has seen before.

    Args:
        length (`int`): how many of the sequence's last tokens matched (the longer, the more specific).
        continuations (`tuple[tuple[int, ...], ...]`): what followed each remembered occurrence, most recent first.
    """

    length: int
    continuations: tuple[tuple[int, ...], ...]


def vocabulary_key(model: PreTrainedModel) -> str:
    """What a memory's token ids mean: the model type and vocabulary size of the model that wrote them."""
    config = model.config.get_text_config(decoder=True)
    return f"{config.model_type}/{config.vocab_size}"


class SuffixMemory:
    """
    Prompts and outputs of earlier calls of one model (`documents`), with an index from every k-gram (k = 1 to
    `max_match`) to where it recently ended, so that the last tokens of a sequence find what followed them before.

    A lookup takes the longest suffix of the sequence that the memory has seen, and returns the tokens that followed
    its most recent `max_occurrences` occurrences, as deep as the match is specific (`depth_per_match` tokens per
    matched token): the candidate tree of SuffixDecoding (Oliaro et al., 2025), over a bounded index instead of a
    suffix tree.

    Bounded: once the documents hold more than `max_tokens` tokens, the oldest documents are evicted whole, index
    entries included. Each k-gram keeps its `max_occurrences` most recent ends. Safe to share between threads.

    Args:
        vocabulary (`str`): what the token ids mean (see `vocabulary_key`); a saved memory loads only into a model
            with the same key.
        max_tokens (`int`): the most tokens kept.
        max_match (`int`): the longest suffix looked up.
        max_occurrences (`int`): the most recent occurrences kept per k-gram, and the most continuations proposed.
        depth_per_match (`int`): tokens proposed per matched token.
    """

    def __init__(
        self,
        vocabulary: str,
        max_tokens: int,
        max_match: int = 4,
        max_occurrences: int = 8,
        depth_per_match: int = 4,
    ):
        self.vocabulary = vocabulary
        self.max_tokens = max_tokens
        self.max_match = max_match
        self.max_occurrences = max_occurrences
        self.depth_per_match = depth_per_match
        self._lock = threading.Lock()
        # document id -> tokens, oldest first (the eviction order).
        self._documents: OrderedDict[int, tuple[int, ...]] = OrderedDict()
        self._next_id = 0
        self._size = 0
        # k-gram -> recent (document id, index of the token after the k-gram), oldest first.
        self._index: dict[tuple[int, ...], list[tuple[int, int]]] = {}

    def __len__(self) -> int:
        """The number of tokens kept."""
        return self._size

    @property
    def num_documents(self) -> int:
        return len(self._documents)

    def documents(self) -> list[tuple[int, ...]]:
        """The token sequences kept, oldest first."""
        with self._lock:
            return list(self._documents.values())

    def resize(self, max_tokens: int) -> None:
        """Keeps at most `max_tokens` tokens from now on, evicting the oldest documents if there are more."""
        with self._lock:
            self.max_tokens = max_tokens
            self._evict()

    def add(self, documents: Sequence[Sequence[int]]) -> None:
        """Remembers token sequences (a prompt and its output, one per sequence); longer ones keep their last `max_tokens`."""
        with self._lock:
            for document in documents:
                self._add(tuple(document[-self.max_tokens :]))
            self._evict()

    def match(self, tokens: Sequence[int], max_depth: int) -> MemoryMatch | None:
        """The continuations (at most `max_depth` tokens) of the longest suffix of `tokens` seen before, or `None`."""
        if max_depth < 1:
            return None
        with self._lock:
            for length in range(min(self.max_match, len(tokens)), 0, -1):
                occurrences = self._index.get(tuple(tokens[-length:]))
                if not occurrences:
                    continue
                depth = min(max_depth, self.depth_per_match * length)
                continuations = tuple(
                    continuation
                    for document, start in reversed(occurrences)
                    if (continuation := self._documents[document][start : start + depth])
                )
                if continuations:
                    return MemoryMatch(length, continuations)
            return None

    def save(self, path: str | os.PathLike) -> None:
        """Writes the documents to a safetensors file at `path`, whole or not at all (loading rebuilds the index)."""
        documents = self.documents()
        tokens = torch.tensor([token for document in documents for token in document], dtype=torch.int64, device="cpu")
        lengths = torch.tensor([len(document) for document in documents], dtype=torch.int64, device="cpu")
        metadata = {
            "format": MEMORY_FORMAT,
            "version": MEMORY_VERSION,
            "vocabulary": self.vocabulary,
            "max_tokens": str(self.max_tokens),
        }
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        save_file({"tokens": tokens, "lengths": lengths}, str(temporary), metadata=metadata)
        os.replace(temporary, path)

    def load(self, path: str | os.PathLike) -> None:
        """
        Replaces what the memory holds with a file written by `save` (keeping `max_tokens`, the newest documents if
        the file holds more). A file that is not such a memory, or one of another vocabulary, is refused and the
        memory stays as it was.

        Raises:
            `ValueError` naming the file and what is wrong with it.
        """
        documents = read_memory_file(path, self.vocabulary)
        loaded = SuffixMemory(
            self.vocabulary, self.max_tokens, self.max_match, self.max_occurrences, self.depth_per_match
        )
        loaded.add(documents)
        with self._lock:
            self._documents, self._index = loaded._documents, loaded._index
            self._next_id, self._size = loaded._next_id, loaded._size

    def _add(self, document: tuple[int, ...]) -> None:
        if not document:
            return
        identifier = self._next_id
        self._next_id += 1
        self._documents[identifier] = document
        self._size += len(document)
        for end in range(1, len(document)):
            for length in range(1, min(self.max_match, end) + 1):
                occurrences = self._index.setdefault(document[end - length : end], [])
                occurrences.append((identifier, end))
                if len(occurrences) > self.max_occurrences:
                    del occurrences[0]

    def _evict(self) -> None:
        while self._size > self.max_tokens and self._documents:
            identifier, document = self._documents.popitem(last=False)
            self._size -= len(document)
            for end in range(1, len(document)):
                for length in range(1, min(self.max_match, end) + 1):
                    key = document[end - length : end]
                    occurrences = self._index.get(key)
                    if occurrences is None:
                        continue
                    remaining = [occurrence for occurrence in occurrences if occurrence[0] != identifier]
                    if remaining:
                        self._index[key] = remaining
                    else:
                        del self._index[key]


def read_memory_file(path: str | os.PathLike, vocabulary: str) -> list[tuple[int, ...]]:
    """
    The documents of a memory file written by `SuffixMemory.save`, checked to be of `vocabulary` (`vocabulary_key`).

    Raises:
        `ValueError` naming the file and what is wrong with it.
    """

    def refuse(reason: str) -> ValueError:
        return ValueError(f"Cannot load the lookahead memory file {str(path)!r}: {reason}. Nothing was loaded.")

    try:
        with safe_open(str(path), framework="pt") as file:
            metadata = file.metadata() or {}
            tensors = {name: file.get_tensor(name) for name in file.keys()}
    except FileNotFoundError:
        raise refuse("no such file") from None
    except (SafetensorError, OSError, ValueError) as error:
        raise refuse(f"it is not a safetensors file ({error})") from None
    if metadata.get("format") != MEMORY_FORMAT:
        raise refuse(f"it is not a lookahead memory (format {metadata.get('format')!r})")
    if metadata.get("version") != MEMORY_VERSION:
        raise refuse(f"it has version {metadata.get('version')!r}, this package reads version {MEMORY_VERSION!r}")
    if metadata.get("vocabulary") != vocabulary:
        raise refuse(
            f"it was written by a model with vocabulary {metadata.get('vocabulary')!r}, this one is {vocabulary!r} "
            "(token ids of another vocabulary would only propose wrong candidates)"
        )
    tokens, lengths = tensors.get("tokens"), tensors.get("lengths")
    if tokens is None or lengths is None or tokens.dim() != 1 or lengths.dim() != 1:
        raise refuse("it lacks its 1-D `tokens` and `lengths` tensors")
    if tokens.dtype != torch.int64 or lengths.dtype != torch.int64:
        raise refuse("its tensors are not int64")
    if bool((lengths < 1).any()) or int(lengths.sum()) != tokens.numel():
        raise refuse("its document lengths do not add up to its tokens")
    vocab_size = int(vocabulary.rsplit("/", 1)[-1])
    if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= vocab_size):
        raise refuse(f"it holds token ids outside the vocabulary (0 to {vocab_size - 1})")
    values = tokens.tolist()
    documents, start = [], 0
    for length in lengths.tolist():
        documents.append(tuple(values[start : start + length]))
        start += length
    return documents
