"""What of a document the encoder gets: no more than the model can read.

A document is stored whole, but the encoder reads at most ``document_max_len`` tokens
(512 for every profile we serve): sending it a 1 MiB text costs the wire, Triton's
tokenizer and the gateway's memory for nothing (measured before this cut: 40 such
documents took 57 s to upsert). :func:`cut_for_encoder` keeps a prefix that still holds
every token the model reads, so the embedding is the one of the whole text:

* every non-empty whitespace-separated word gives at least one token (WordPiece maps an
  unknown word to [UNK], SentencePiece splits it into pieces) and no token spans two
  words, so the first ``max_tokens + 1`` words give the model the same first
  ``max_tokens`` tokens as the whole text, and a text cut there is still reported as
  truncated by the tokenizer;
* at most ``max_tokens × MAX_CHARS_PER_TOKEN`` non-whitespace characters bound a text
  of few, huge words (a SentencePiece piece is at most 16 characters; a WordPiece word
  over 100 characters is one [UNK] either way). Whitespace is not counted: a run of it
  separates words and costs no token, so the words after it are still read.
"""

from __future__ import annotations

import re

from services.encoder.profiles import PROFILES

MAX_CHARS_PER_TOKEN = 64
MAX_DOCUMENT_TOKENS = max(p.document_max_len for p in PROFILES.values())
_WORD = re.compile(r"\S+")


def cut_for_encoder(text: str, max_tokens: int = MAX_DOCUMENT_TOKENS) -> tuple[str, bool]:
    """(the prefix of ``text`` the encoder needs, whether anything was cut)."""
    budget = max_tokens * MAX_CHARS_PER_TOKEN
    end = len(text)
    for n, match in enumerate(_WORD.finditer(text), start=1):
        size = match.end() - match.start()
        if size >= budget:
            end = match.start() + budget
            break
        budget -= size
        if n == max_tokens + 1:
            end = match.end()
            break
    return (text, False) if end >= len(text) else (text[:end], True)
