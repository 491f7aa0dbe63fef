"""A union tokenizer's order in a `ramplus` merge (`hooks` wraps `mergekit.tokenizer.build.build_union_tokenizer`).

mergekit 0.1.5 numbers the tokens a union adds in the order each tokenizer's `get_vocab()` lists them, a hash map's
for a fast tokenizer: another in each process. A merge run twice, and `verify` rebuilding it, then gave two added
tokens each other's embedding and `lm_head` rows. Here each tokenizer lists its tokens by id.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mergekit_ram import session


def union_in_order(original: Callable[..., Any]) -> Callable[..., Any]:
    """mergekit's union tokenizer numbers the tokens the base lacks in the order the tokenizers list them, and a
    fast tokenizer's `get_vocab()` lists them in a hash map's order, another in each process: two runs of one merge
    then give two new tokens each other's ids (rows of the embeddings and lm_head, and tokenizer.json), and `verify`
    rebuilds another order than the one written. In a `ramplus` merge each tokenizer lists its tokens by id, the
    base's first and the others by model: the same merge writes the same bytes."""

    def build_union_tokenizer(base_tok: Any, tokenizers: dict, *args: Any, **kwargs: Any) -> Any:
        if session.current() is None:  # another method's merge: mergekit's own order
            return original(base_tok, tokenizers, *args, **kwargs)
        first, *rest = tokenizers.items()
        ordered = dict([first, *sorted(rest, key=lambda item: str(item[0]))])
        return original(base_tok, {model: ById(tok) for model, tok in ordered.items()}, *args, **kwargs)

    return build_union_tokenizer


class ById:
    """A tokenizer whose vocabulary and added tokens are listed by id (what `build_union_tokenizer` reads)."""

    def __init__(self, tokenizer: Any):
        self._tokenizer = tokenizer

    def get_vocab(self) -> dict[str, int]:
        return dict(sorted(self._tokenizer.get_vocab().items(), key=lambda item: (item[1], item[0])))

    @property
    def added_tokens_decoder(self) -> dict[int, Any]:
        return dict(sorted(self._tokenizer.added_tokens_decoder.items()))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tokenizer, name)
