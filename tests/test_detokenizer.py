"""Token ids to text as they arrive: the text so far is always what ``decode`` gives."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer

from service.detokenizer import IncrementalDetokenizer
from tests.generative_models import TEXTS, byte_level_bpe, metaspace_bpe
from tests.hf_folders import tokenizer as wordpiece

TOKENIZERS = {"byte-level BPE": byte_level_bpe, "WordPiece": wordpiece}


def id_sequences(tokenizer: Tokenizer) -> list[list[int]]:
    """The test texts' own ids, and random ids (which split characters anywhere)."""
    chooser = random.Random(0)
    size = tokenizer.get_vocab_size()
    texts = [tokenizer.encode(text, add_special_tokens=False).ids for text in TEXTS]
    noise = [[chooser.randrange(size) for _ in range(40)] for _ in range(60)]
    return texts + noise


@pytest.mark.parametrize("name", TOKENIZERS)
def test_the_text_equals_decode_at_every_step(name: str) -> None:
    tokenizer = TOKENIZERS[name]()
    for ids in id_sequences(tokenizer):
        stream = IncrementalDetokenizer(tokenizer)
        pieces = []
        for count, token in enumerate(ids, start=1):
            pieces.append(stream.push(token))
            whole = tokenizer.decode(ids[:count])
            assert "".join(pieces) == stream.text
            if not whole.endswith("\ufffd"):
                assert stream.text == whole, ids[:count]
            else:
                # A character is under way: what was given is the text before it.
                assert whole.startswith(stream.text)
        pieces.append(stream.finish())
        assert "".join(pieces) == tokenizer.decode(ids)
        assert stream.token_ids == ids


def test_a_character_split_over_tokens_comes_out_whole() -> None:
    tokenizer = byte_level_bpe()
    ids = tokenizer.encode("🙂", add_special_tokens=False).ids
    assert len(ids) > 1
    stream = IncrementalDetokenizer(tokenizer)
    deltas = [stream.push(token) for token in ids]
    assert deltas == [""] * (len(ids) - 1) + ["🙂"]


def test_an_unfinished_character_is_given_as_decode_renders_it_at_the_end() -> None:
    tokenizer = byte_level_bpe()
    ids = tokenizer.encode("ok 🙂", add_special_tokens=False).ids[:-1]
    stream = IncrementalDetokenizer(tokenizer)
    text = "".join(stream.push(token) for token in ids)
    assert text == "ok "
    assert stream.finish() == tokenizer.decode(ids)[len("ok ") :]
    assert stream.text == tokenizer.decode(ids)


def test_special_tokens_are_skipped_unless_asked_for() -> None:
    tokenizer = byte_level_bpe()
    end = tokenizer.token_to_id("<|endoftext|>")
    ids = [*tokenizer.encode("the fox", add_special_tokens=False).ids, end]
    skipping = IncrementalDetokenizer(tokenizer)
    keeping = IncrementalDetokenizer(tokenizer, skip_special_tokens=False)
    assert "".join(skipping.push(token) for token in ids) == "the fox"
    assert "".join(keeping.push(token) for token in ids) == "the fox<|endoftext|>"


def test_with_the_prompt_as_context_the_first_word_keeps_its_space() -> None:
    tokenizer = metaspace_bpe()
    prompt = tokenizer.encode("the quick", add_special_tokens=False).ids
    completion = tokenizer.encode("the quick brown fox", add_special_tokens=False).ids[
        len(prompt) :
    ]
    assert tokenizer.decode(completion) == "brown fox"
    stream = IncrementalDetokenizer(tokenizer, prompt_ids=prompt)
    text = "".join(stream.push(token) for token in completion) + stream.finish()
    assert text == " brown fox"
