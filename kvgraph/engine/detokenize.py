"""Incremental detokenization: the text a request's output adds with each token, at a cost per token
that does not grow with the output's length."""

from __future__ import annotations

INCOMPLETE = "\ufffd"  # what a decoder shows for a UTF-8 sequence cut short


class IncrementalDetokenizer:
    """Text deltas of one growing token sequence, decoding only a short window per token.

    The text of ``ids[prefix:read]`` has been emitted already; decoding ``ids[prefix:]`` and
    taking what follows that text gives the new characters (the window starts a few tokens back
    so that tokenizers whose pieces depend on their left neighbour, such as SentencePiece's
    leading spaces, decode as in the whole text). A delta that ends in an incomplete UTF-8
    sequence is held until a later token completes it, or until the sequence is final.

    Args:
        tokenizer: anything with ``decode(ids, skip_special_tokens=True) -> str``.
    """

    def __init__(self, tokenizer: object) -> None:
        self.tokenizer = tokenizer
        self.prefix = 0
        self.read = 0

    def delta(self, ids: list[int], final: bool = False) -> str:
        """The characters ``ids`` (all tokens so far) adds to what earlier calls returned."""
        decode = self.tokenizer.decode
        before = decode(ids[self.prefix : self.read], skip_special_tokens=True)
        after = decode(ids[self.prefix :], skip_special_tokens=True)
        if len(after) <= len(before) or (after.endswith(INCOMPLETE) and not final):
            if final:
                self.prefix = self.read = len(ids)
            return ""
        self.prefix, self.read = self.read, len(ids)
        return after[len(before) :]
