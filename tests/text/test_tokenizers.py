"""Tokenizers read from checkpoint files: encoding and decoding equal transformers' on the same files
(byte-level BPE and SentencePiece, non-ASCII included), special tokens, and streamed decoding."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fd_core.errors import CheckpointError
from fd_core.runtime import load_tokenizer
from fd_core.runtime.text.streaming import StreamDecoder, TextState, held_back
from kit import SAMPLES, tokenizer_dirs, transformers_tokenizer  # noqa: F401 - fixtures

KINDS = ["bpe", "sp"]
WITH_SPECIALS = {"bpe": "<|im_start|>user\nCafé 🙂<|im_end|>\n", "sp": "<s>Hello <|begin_of_sentence|>мир</s>"}


@pytest.mark.parametrize("kind", KINDS)
def test_encode_and_decode_equal_transformers(
    tokenizer_dirs: dict[str, Path], transformers_tokenizer, kind: str,
) -> None:
    ours, reference = load_tokenizer(tokenizer_dirs[kind]), transformers_tokenizer(tokenizer_dirs[kind])
    for text in [*SAMPLES, WITH_SPECIALS[kind]]:
        ids = ours.encode(text)
        assert ids == reference(text)["input_ids"], text
        assert (ours.encode(text, add_special_tokens=False)
                == reference(text, add_special_tokens=False)["input_ids"]), text
        for skip in (True, False):
            assert (ours.decode(ids, skip_special_tokens=skip)
                    == reference.decode(ids, skip_special_tokens=skip)), (text, skip)


@pytest.mark.parametrize("kind", KINDS)
def test_special_tokens_are_whole_and_skipped(tokenizer_dirs: dict[str, Path], kind: str) -> None:
    tokenizer = load_tokenizer(tokenizer_dirs[kind])
    text = WITH_SPECIALS[kind]
    ids = tokenizer.encode(text, add_special_tokens=False)
    special = [t for t in ids if t in tokenizer.special_ids]
    assert len(special) == {"bpe": 2, "sp": 3}[kind] and all(tokenizer.id_to_token(t) in text for t in special)
    assert not any(tokenizer.id_to_token(t) in tokenizer.decode(ids) for t in special)


def test_bos_added_when_the_config_says(tmp_path: Path, transformers_tokenizer) -> None:
    import kit

    kit.sentencepiece_tokenizer(tmp_path, add_bos=True)
    ours = load_tokenizer(tmp_path)
    assert ours.encode("Hello")[0] == 1 and ours.encode("Hello", add_special_tokens=False)[0] != 1
    assert ours.encode("Hello") == transformers_tokenizer(tmp_path)("Hello")["input_ids"]


@pytest.mark.parametrize("kind", KINDS)
def test_streamed_text_equals_decoding_the_whole(tokenizer_dirs: dict[str, Path], kind: str) -> None:
    tokenizer = load_tokenizer(tokenizer_dirs[kind])
    for text in [*SAMPLES, WITH_SPECIALS[kind]]:
        ids = tokenizer.encode(text)
        stream = StreamDecoder(tokenizer)
        pieces = [stream.push(t) for t in ids]
        pieces.append(stream.flush())
        assert "".join(pieces) == tokenizer.decode(ids), text
        assert not any("\ufffd" in p for p in pieces), (text, pieces)


@pytest.mark.parametrize("kind", KINDS)
def test_token_bytes_joined_are_the_text_transformers_decodes(
    tokenizer_dirs: dict[str, Path], transformers_tokenizer, kind: str,
) -> None:
    """What logprobs report per token: the bytes of a character split across byte tokens come apart, and joined they
    are the text (SentencePiece's word-start space included: the decoded text drops the first)."""
    ours, reference = load_tokenizer(tokenizer_dirs[kind]), transformers_tokenizer(tokenizer_dirs[kind])
    for text in [*SAMPLES, WITH_SPECIALS[kind]]:
        ids = ours.encode(text)
        joined = b"".join(ours.token_bytes(t) or b"?" for t in ids).decode("utf-8")
        decoded = reference.decode(ids, skip_special_tokens=False)
        assert (joined[1:] if kind == "sp" and joined.startswith(" ") and not decoded.startswith(" ") else joined) \
            == decoded, text
    assert ours.token_bytes(10**6) is None  # outside the vocabulary
    if kind == "bpe":
        first, second = ours.encode("Ω")  # unseen in training: one byte-level token per UTF-8 byte
        assert (ours.token_bytes(first), ours.token_bytes(second)) == (b"\xce", b"\xa9")
        assert ours.token_bytes(ours.encode(" world")[0]).startswith(b" ")


def test_a_character_split_across_byte_tokens_waits_until_complete(tokenizer_dirs: dict[str, Path]) -> None:
    tokenizer = load_tokenizer(tokenizer_dirs["bpe"])
    ids = tokenizer.encode("Ω")  # unseen in training: two byte-level tokens for its two UTF-8 bytes
    assert len(ids) == 2 and tokenizer.decode(ids[:1]) == "\ufffd"
    stream = StreamDecoder(tokenizer)
    assert stream.push(ids[0]) == "" and stream.push(ids[1]) == "Ω"


def test_stop_strings_cut_the_text_and_hold_back_a_possible_start(tokenizer_dirs: dict[str, Path]) -> None:
    tokenizer = load_tokenizer(tokenizer_dirs["bpe"])
    ids = tokenizer.encode("Hello world, hello there!")
    state = TextState(StreamDecoder(tokenizer), ("o t",))
    shown = "".join(state.push(t) for t in ids if not state.stopped) + state.finish()
    assert state.stopped and state.text == "Hello world, hell" and shown == state.text
    assert (held_back("abc hel", ("hello",)) == 3 and held_back("abc", ("hello",)) == 0
            and held_back("ab h", ("x", "h!")) == 1)


def test_added_tokens_from_the_json_files(tmp_path: Path, tokenizer_dirs: dict[str, Path]) -> None:
    import shutil

    shutil.copytree(tokenizer_dirs["sp"], tmp_path / "sp")
    (tmp_path / "sp" / "added_tokens.json").write_text(json.dumps({"<|IMAGE_PLACEHOLDER|>": 420}))
    tokenizer = load_tokenizer(tmp_path / "sp")
    assert tokenizer.encode("a<|IMAGE_PLACEHOLDER|>b", add_special_tokens=False)[1] == 420
    assert (tokenizer.token_to_id("<|IMAGE_PLACEHOLDER|>") == 420
            and tokenizer.id_to_token(420) == "<|IMAGE_PLACEHOLDER|>")


def test_no_tokenizer_says_which_files_and_the_way_around(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError) as caught:
        load_tokenizer(tmp_path)
    message = str(caught.value)
    assert ("tokenizer.json" in message and "tokenizer.model" in message and "token ids as the prompt" in message
            and "\n" not in message)


def test_a_malformed_tokenizer_file_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="tokenizer.json: not a tokenizer"):
        load_tokenizer(tmp_path)
