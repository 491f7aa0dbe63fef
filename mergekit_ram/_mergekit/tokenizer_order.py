"""A union tokenizer's order in a `ramplus` merge (`hooks` wraps `mergekit.tokenizer.build.build_union_tokenizer`).

mergekit 0.1.5 numbers the tokens a union adds in the order each tokenizer's `get_vocab()` lists them, a hash map's
for a fast tokenizer: another in each process. A merge run twice, and `verify` rebuilding it, then gave two added
tokens each other's embedding and `lm_head` rows. Here each tokenizer lists its tokens by id.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from mergekit_ram import session


def union_in_order(original: Callable[..., Any]) -> Callable[..., Any]:
    """mergekit's union tokenizer numbers the tokens the base lacks in the order the tokenizers list them, and a
    fast tokenizer's `get_vocab()` lists them in a hash map's order, another in each process: two runs of one merge
    then give two new tokens each other's ids (rows of the embeddings and lm_head, and tokenizer.json), and `verify`
    rebuilds another order than the one written. In a `ramplus` merge each tokenizer lists its tokens by id, the
    base's first and the others by model: the same merge writes the same bytes."""

    def build_union_tokenizer(base_tok: Any, tokenizers: dict, *args: Any, **kwargs: Any) -> Any:
        current = session.current()
        if current is None:  # another method's merge: mergekit's own order
            return original(base_tok, tokenizers, *args, **kwargs)
        if current.vocabulary is not None:  # verify of another method's merge: the order its tokenizer holds
            base_tok = published_base(base_tok, tokenizers, current.vocabulary)
            return original(base_tok, *as_published(base_tok, tokenizers, current.vocabulary), *args, **kwargs)
        first, *rest = tokenizers.items()
        ordered = dict([first, *sorted(rest, key=lambda item: str(item[0]))])
        return original(base_tok, {model: ByRank(tok, by_id) for model, tok in ordered.items()}, *args, **kwargs)

    return build_union_tokenizer


def published_base(base_tok: Any, tokenizers: dict, vocabulary: Mapping[str, int]) -> Any:
    """The tokenizer the union starts from: without a `base_model`, mergekit starts from the first of a set of
    models (its process's hash order), and the tokens of that one keep their ids. The largest tokenizer whose every
    token has its published id (by model name among equals) starts it again as the merge did, or to the same ids."""

    def agrees(tok: Any) -> bool:
        return all(vocabulary.get(token) == index for token, index in tok.get_vocab().items())

    agreeing = sorted(
        ((len(tok.get_vocab()), str(model), tok) for model, tok in tokenizers.items() if agrees(tok)),
        key=lambda item: (-item[0], item[1]),
    )
    if not agreeing or (agrees(base_tok) and len(base_tok.get_vocab()) >= agreeing[0][0]):
        return base_tok
    return agreeing[0][2]


def as_published(base_tok: Any, tokenizers: dict, vocabulary: Mapping[str, int]) -> tuple[dict]:
    """`tokenizers` listing their tokens, and listed, so that mergekit numbers the tokens a union adds as the
    published tokenizer (`vocabulary`: token -> id) numbers them: each tokenizer's tokens by their published id
    (those it lacks after, by their own), the tokenizers by the first published id of the tokens the base lacks."""
    known = base_tok.get_vocab()
    unknown = 1 + max(vocabulary.values(), default=0)

    def rank(item: tuple[str, int]) -> tuple[int, int, str]:
        return (vocabulary.get(item[0], unknown), item[1], item[0])

    def first_new(tok: Any) -> int:
        return min((vocabulary.get(t, unknown) for t in tok.get_vocab() if t not in known), default=unknown)

    listed = {model: ByRank(tok, rank) for model, tok in tokenizers.items()}
    return (dict(sorted(listed.items(), key=lambda item: (first_new(item[1]), str(item[0])))),)


def by_id(item: tuple[str, int]) -> tuple[int, str]:
    """A (token, id) pair's rank when a tokenizer is listed by id (ramplus's own union order)."""
    return (item[1], item[0])


class ByRank:
    """A tokenizer whose vocabulary and added tokens are listed by `rank` of (token, id)."""

    def __init__(self, tokenizer: Any, rank: Callable[[tuple[str, int]], Any]):
        self._tokenizer, self._rank = tokenizer, rank

    def get_vocab(self) -> dict[str, int]:
        return dict(sorted(self._tokenizer.get_vocab().items(), key=self._rank))

    @property
    def added_tokens_decoder(self) -> dict[int, Any]:
        found = self._tokenizer.added_tokens_decoder
        return dict(sorted(found.items(), key=lambda item: self._rank((getattr(item[1], "content", ""), item[0]))))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tokenizer, name)
