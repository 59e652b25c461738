"""Token counts the broker can make without a model's tokenizer files: lower bounds.

A plugin whose text encoder reads at most N tokens refuses a longer prompt (it is refused,
not cut). The broker has no vocabulary (the weights are the provider's), but every CLIP
tokenizer splits text the same way before its byte-pair merges, and each piece becomes at
least one token whatever the vocabulary. So the number of pieces that surely survive is a
lower bound on the token count of *any* CLIP vocabulary, the real one or the tiny one the
tests build: a prompt whose bound is above N is refused at submit, never wrongly, and one
just under it may still be refused by the provider, whose tokenizer gives the exact count.

The CLIP tokenizer (transformers, fast and slow) lower-cases, normalises to NFC, and splits
with ``'s|'t|'re|'ve|'m|'ll|'d|[\\p{L}]+|[\\p{N}]|[^\\s\\p{L}\\p{N}]+``; the slow one without
ftfy first drops control characters and spaces out CJK ideographs, and with ftfy it undoes
HTML entities. The bound takes the form of the text that gives the fewest pieces under
all of them: entities undone, control and format characters dropped, NFC; then it counts
runs of letters (combining marks kept with them) and single digits, and nothing for
punctuation, which every variant keeps but which a bound can do without. (ftfy also
repairs mojibake, which could in principle merge two letter runs; it is not a dependency
of the plugins, and such text is rare.)
"""
from __future__ import annotations

import html
import unicodedata


def clip_tokens(text: str | None) -> int:
    """At least how many tokens (start and end tokens not counted) a CLIP tokenizer makes
    of ``text``, whatever its vocabulary."""
    if not text:
        return 0
    text = html.unescape(html.unescape(text))
    if not text.isascii():
        text = unicodedata.normalize("NFC", "".join(
            c for c in text if c in "\t\n\r" or not unicodedata.category(c).startswith("C")))
    count, in_letters = 0, False
    for c in text:
        if c.isascii():
            if c.isalpha():
                count += not in_letters
                in_letters = True
            elif c.isdigit():
                count += 1
                in_letters = False
            else:
                in_letters = False
            continue
        cat = unicodedata.category(c)
        if cat[0] == "L" or (cat[0] == "M" and in_letters):
            count += not in_letters
            in_letters = True
        elif cat[0] == "N":
            count += 1
            in_letters = False
        else:
            in_letters = False
    return count
