"""The request side of `fd serve` without a server: pictures from data URLs and from the
directories the server may read; and the response side's logprobs: each token's text, bytes and text offset."""

from __future__ import annotations

import base64
import io
import re
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("pydantic", reason="fd serve needs the serve extra (pip install -e '.[cpu,test]' brings it)")

from fd_core.runtime import TokenLogprob, load_tokenizer  # noqa: E402
from fd_core.serve.protocol import ApiError, TextOffsets, TokenText, read_image  # noqa: E402 - after the skip
from kit import tokenizer_dirs  # noqa: E402,F401 - a fixture


def png(path: Path | None = None) -> tuple[bytes, np.ndarray]:
    from PIL import Image

    pixels = (np.arange(4 * 6 * 3) * 7 % 256).astype("uint8").reshape(4, 6, 3)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    if path is not None:
        path.write_bytes(buffer.getvalue())
    return buffer.getvalue(), pixels.transpose(2, 0, 1).astype("float32") / 255.0


def test_a_data_url_is_decoded_to_the_pictures_pixels() -> None:
    data, want = png()
    got = read_image("data:image/png;base64," + base64.b64encode(data).decode(), ())
    assert got.shape == (3, 4, 6) and np.allclose(got, want)
    for bad, words in (("data:image/png,abc", "must be base64"), ("data:image/png;base64,!!!", "not a PNG or JPEG"),
                       ("data:image/png;base64," + base64.b64encode(b"not a picture").decode(), "not a PNG or JPEG")):
        with pytest.raises(ApiError, match=words) as refused:
            read_image(bad, ())
        assert refused.value.status == 400


def test_a_path_is_read_only_under_an_image_root(tmp_path: Path) -> None:
    root, outside = tmp_path / "pictures", tmp_path / "private"
    root.mkdir()
    outside.mkdir()
    _, want = png(root / "a.png")
    png(outside / "b.png")
    assert np.allclose(read_image(str(root / "a.png"), (root.resolve(),)), want)
    assert np.allclose(read_image(f"file://{root / 'a.png'}", (root.resolve(),)), want)
    for path in (str(outside / "b.png"), str(root / ".." / "private" / "b.png")):
        with pytest.raises(ApiError, match="outside the directories the server may read"):
            read_image(path, (root.resolve(),))
    with pytest.raises(ApiError, match=r"none \(start fd serve with --image-root DIR\)"):
        read_image(str(root / "a.png"), ())
    with pytest.raises(ApiError, match="is not a file the server can read"):
        read_image(str(root / "missing.png"), (root.resolve(),))


def encoded(kind: str) -> bytes:
    """A 4x6 picture in PIL's format `kind`."""
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (6, 4), (200, 100, 50)).save(buffer, format=kind)
    return buffer.getvalue()


@pytest.mark.parametrize("kind", ["GIF", "BMP", "TIFF", "WEBP"])
def test_only_png_and_jpeg_are_decoded_from_a_data_url_or_a_path(tmp_path: Path, kind: str) -> None:
    """Decided from the first bytes, before a decoder sees them: the name in the URL or the file's suffix says
    nothing."""
    data = encoded(kind)
    (tmp_path / "a.png").write_bytes(data)
    named = {"WEBP": "WebP"}.get(kind, kind)
    for url in ("data:image/png;base64," + base64.b64encode(data).decode(), str(tmp_path / "a.png")):
        with pytest.raises(ApiError, match=f"is a {named} picture; only PNG or JPEG are accepted") as refused:
            read_image(url, (tmp_path.resolve(),))
        assert refused.value.status == 400 and refused.value.param == "messages"
    for accepted in ("PNG", "JPEG"):
        (tmp_path / "b.png").write_bytes(encoded(accepted))
        url = "data:image/png;base64," + base64.b64encode(encoded(accepted)).decode()
        assert read_image(url, ()).shape == read_image(str(tmp_path / "b.png"), (tmp_path.resolve(),)).shape == (3, 4, 6)
    # A .npy array [3, H, W] from a path, as fd run --image takes it.
    np.save(tmp_path / "c.npy", np.full((3, 2, 5), 0.5, dtype="float32"))
    assert read_image(str(tmp_path / "c.npy"), (tmp_path.resolve(),)).shape == (3, 2, 5)


@pytest.mark.parametrize("path, words", [
    ("a\x00b.png", "contains a NUL byte"),
    ("x" * 5000, "is 5000 characters long, more than the 4096 a path may have"),
    ("y" * 300 + ".png", "cannot be read (File name too long)"),
], ids=["nul", "5000-characters", "a-300-character-name"])
def test_a_path_no_file_can_have_is_refused_in_one_line(tmp_path: Path, path: str, words: str) -> None:
    with pytest.raises(ApiError, match=re.escape(words)) as refused:
        read_image(path, (Path.cwd().resolve(),))
    assert refused.value.status == 400 and len(refused.value.message) < 400 and "\n" not in refused.value.message


# Characters that byte-level tokens split (Ω and the emoji are unseen in the tiny tokenizer's training), a special token
# the text skips, and words SentencePiece starts with its space mark.
LOGPROB_TEXTS = {"bpe": "Café Ωmega 🙂 and<|im_end|> 日本語", "sp": "Hello мир Ωmega 🙂 world"}


@pytest.mark.parametrize("kind", ["bpe", "sp"])
def test_text_offsets_are_where_each_token_starts_in_the_text(tokenizer_dirs: dict[str, Path], kind: str) -> None:
    """Against the tokenizer's own decoding of the ids before each token (where that ends on a whole character; a
    token that completes a character starts where the character does), streamed in chunks or whole."""
    tokenizer = load_tokenizer(tokenizer_dirs[kind])
    ids = tokenizer.encode(LOGPROB_TEXTS[kind], add_special_tokens=False)
    text = TokenText(tokenizer)
    whole = text.completion([TokenLogprob(t, -1.0) for t in ids], TextOffsets(text))
    split = 0
    for i, offset in enumerate(whole["text_offset"]):
        before = tokenizer.decode(ids[:i])
        if before.endswith("\ufffd"):  # inside a character: it starts where the character does
            split += 1
            before = before.rstrip("\ufffd")
        assert offset == len(before), (i, offset, before)
    assert split, "no character was split across tokens: the case that matters went untested"
    offsets = TextOffsets(text)
    chunks = [text.completion([TokenLogprob(t, -1.0)], offsets)["text_offset"] for t in ids]
    assert [o for chunk in chunks for o in chunk] == whole["text_offset"]
    # Each token's bytes; joined, the text (SentencePiece's first word-start space and the special token aside).
    joined = b"".join(bytes(e["bytes"]) for e in text.chat([TokenLogprob(t, -1.0) for t in ids])["content"]
                      if e["token"] != "<|im_end|>")
    assert joined.decode("utf-8").removeprefix(" " if kind == "sp" else "") == tokenizer.decode(ids)
    assert whole["tokens"] == [text.chat([TokenLogprob(t, -1.0)])["content"][0]["token"] for t in ids]
    assert "\ufffd" in whole["tokens"]  # half a character as text


def test_a_token_without_a_tokenizer_is_its_id() -> None:
    text = TokenText(None)
    shown = text.chat([TokenLogprob(7, -0.5, ((7, -0.5), (3, -2.0)))])["content"][0]
    assert shown == {"token": "token_id:7", "logprob": -0.5, "bytes": None, "top_logprobs": [
        {"token": "token_id:7", "logprob": -0.5, "bytes": None}, {"token": "token_id:3", "logprob": -2.0, "bytes": None}]}
    legacy = text.completion([TokenLogprob(7, -0.5, ((3, -0.25),))], TextOffsets(text))
    assert legacy == {"tokens": ["token_id:7"], "token_logprobs": [-0.5],
                      "top_logprobs": [{"token_id:3": -0.25, "token_id:7": -0.5}], "text_offset": [0]}


@pytest.mark.parametrize("key", ["١٢", "１２", "²", "1" * 10_000, "12345678901", "-1", "1e3", " 12", ""],
                         ids=["arabic-indic", "fullwidth", "superscript", "10000-digits", "11-digits", "negative",
                              "exponent", "space", "empty"])
def test_a_logit_bias_key_is_ascii_digits_or_a_400_naming_it(key: str) -> None:
    """int() takes other scripts' digits: "١٢" became token 12 in silence, "²" and 10,000 digits raised (a 500)."""
    from fd_core.serve.protocol import CompletionRequest

    with pytest.raises(ApiError) as refused:
        CompletionRequest(prompt="Hi", logit_bias={key: 1.0}).sampling(None)
    assert refused.value.status == 400 and refused.value.param == "logit_bias", refused.value.message
    assert refused.value.message.startswith("logit_bias key") and len(refused.value.message) < 200
    taken = CompletionRequest(prompt="Hi", logit_bias={"12": 1.5, "0042": -2}).sampling(None)
    assert taken.bias == ((12, 1.5), (42, -2.0))


def test_stop_strings_are_at_most_four_of_at_most_256_characters() -> None:
    """OpenAI's limit on their number; fd's on their length: each token's text is searched for the start of every stop
    string, at a cost of the square of its length."""
    from fd_core.serve.protocol import MAX_STOP_CHARS, MAX_STOPS, CompletionRequest

    assert (MAX_STOPS, MAX_STOP_CHARS) == (4, 256)
    widest = ["a" * 256, "b" * 256, "\n", "Ω" * 256]
    assert CompletionRequest(prompt="Hi", stop=widest).sampling(None).stop == tuple(widest)
    assert CompletionRequest(prompt="Hi", stop="x" * 256).sampling(None).stop == ("x" * 256,)
    for stop, words in (
        (["a", "b", "c", "d", "e"], "stop holds 5 strings, more than the 4 a request may send (OpenAI's limit); send at "
                                    "most 4"),
        (["a", "b" * 257], "stop[1] is 257 characters long, more than the 256 a stop string may have; send a shorter "
                           "one"),
        ("c" * 100_000, "stop is 100000 characters long, more than the 256 a stop string may have; send a shorter one"),
        (["a", ""], "stop[1] is empty; a stop string needs at least one character"),
    ):
        with pytest.raises(ApiError) as refused:
            CompletionRequest(prompt="Hi", stop=stop).sampling(None)
        assert (refused.value.status, refused.value.param, refused.value.message) == (400, "stop", words)


def test_a_sampling_error_names_the_clients_field_not_the_engines() -> None:
    """SamplingParams calls it max_new_tokens; the request sent max_tokens (or nothing: OpenAI's default 16)."""
    from fd_core.serve.protocol import CompletionRequest

    with pytest.raises(ApiError) as refused:
        CompletionRequest(prompt="Hi", min_tokens=30).sampling(None)
    assert (refused.value.param, refused.value.message) == ("min_tokens",
                                                            "min_tokens must be in 0..max_tokens (16), got 30")
