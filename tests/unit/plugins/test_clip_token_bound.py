"""sdk.protocol.tokens.clip_tokens against a real CLIP tokenizer (the tiny one the tests
build, in the diffusers layout): never more tokens than the tokenizer makes, whatever the
text, so the broker's refusal of a long prompt is never wrong; exact for prompts of words
the vocabulary holds whole, so it refuses what the real tokenizer would refuse."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from plugins.tiny import _PROMPT_WORDS  # noqa: PLC2701 - the words the tiny vocabulary holds
from sdk.protocol.tokens import clip_tokens

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tokenizer(sd15_weights):
    from transformers import CLIPTokenizer

    return CLIPTokenizer.from_pretrained(sd15_weights / "tokenizer")


def _count(tokenizer, text: str) -> int:
    return len(tokenizer(text, truncation=False).input_ids) - 2  # start and end tokens


pieces = st.sampled_from(_PROMPT_WORDS) | st.text(max_size=6) | st.sampled_from(
    [" ", "  ", "\n", "\t", ",", ".", "!?", "'s", "'ll", "&amp;", "&eacute;", "&#x41;", "&nbsp;",
     "\x00", "\x01", "\u200b", "\ufeff", "\u0301", "e\u0301", "İ", "ß", "ﬁ", "½", "²", "٣",
     "中文", "日本語", "한국어", "क्षत्रिय", "😀", "👍🏽", "<|endoftext|>", "4k", "8k", "1024"])


@settings(max_examples=600, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(parts=st.lists(pieces, max_size=30))
def test_the_bound_never_exceeds_what_the_tokenizer_counts(tokenizer, parts):
    text = "".join(parts)
    assert clip_tokens(text) <= _count(tokenizer, text), text


@settings(max_examples=200, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(words=st.lists(st.sampled_from([w for w in _PROMPT_WORDS if w.isalpha()]), max_size=90),
       sep=st.sampled_from([" ", "  ", "\n", " , "]))
def test_the_bound_is_exact_for_words_the_vocabulary_holds(tokenizer, words, sep):
    text = sep.join(words)
    punctuation = text.count(",")
    assert clip_tokens(text) == _count(tokenizer, text) - punctuation


def test_the_manifest_rule_refuses_what_the_plugin_would(sd15_weights):
    """A prompt of 76 vocabulary words is refused by the manifest (the broker at submit)
    and would be by the plugin; 75 pass both."""
    from plugins import builtin_plugin_dir
    from sdk.protocol.manifest import load_manifest
    from sdk.protocol.schema import InputError
    from transformers import CLIPTokenizer

    tok = CLIPTokenizer.from_pretrained(sd15_weights / "tokenizer")
    manifest = load_manifest(builtin_plugin_dir("sd15"))
    fits, too_long = " ".join(["castle"] * 75), " ".join(["castle"] * 76)
    assert manifest.validate_inputs({"prompt": fits})["prompt"] == fits
    assert _count(tok, fits) == 75 and _count(tok, too_long) == 76
    with pytest.raises(InputError, match="at least 76 tokens"):
        manifest.validate_inputs({"prompt": too_long})
