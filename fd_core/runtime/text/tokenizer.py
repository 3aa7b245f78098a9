"""A checkpoint's tokenizer: `tokenizer.json` (the `tokenizers` library) or SentencePiece `tokenizer.model`,
with the special and added tokens its JSON files declare, as transformers loads them."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

from fd_core.errors import CheckpointError, in_terms
from fd_core.runtime.files import read_text, regular_file

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")
# The special-token roles transformers passes to a chat template, by their tokenizer_config.json keys.
SPECIAL_ROLES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


JsonReader = Callable[[Path], dict[str, Any]]


# Largest JSON file fd reads beside the weights (tokenizer.json itself is read by its library).
MAX_JSON_BYTES = 64 << 20


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object file, or {} when it is absent; a malformed or special (FIFO, device) one is a one-line
    CheckpointError."""
    if not os.path.lexists(path):
        return {}
    text = read_text(path, str(path), MAX_JSON_BYTES)
    try:
        data = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise CheckpointError(
            f"{path}: not a readable JSON file ({exc.__class__.__name__}: {exc}); fix or re-download it"
        ) from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _content(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or {"content": ...}."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _describe(value: Any) -> str:
    """A JSON value for a message: its type and, shortened, the value."""
    text = json.dumps(value, ensure_ascii=False, default=str)
    return f"{type(value).__name__} {text if len(text) <= 40 else text[:37] + '...'}"


def flag(data: Mapping[str, Any], key: str, default: bool, where: str) -> bool:
    """A true/false setting of a checkpoint's JSON file: a JSON boolean (or null: the default); the string "false" is
    refused, not read as true."""
    value = data.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise CheckpointError(f"{where}: {key} must be true or false, got {_describe(value)}; fix the file")
    return value


def _token_list(data: Mapping[str, Any], key: str, where: str) -> list[Any]:
    """A list of tokens (strings or {"content": ...}); a string where the list belongs is refused (it is not a list of
    its letters)."""
    value = data.get(key)
    if value is None:
        return []
    if not isinstance(value, list) or any(_content(v) is None for v in value):
        raise CheckpointError(
            f"{where}: {key} must be a list of token strings (or {{\"content\": ...}} objects), "
            f"got {_describe(value)}; write it as [\"<token>\", ...]"
        )
    return value


class Tokenizer:
    """Text to ids and back, the special tokens by role, and which ids are special (skipped when decoding)."""

    def __init__(self, directory: Path, config: Mapping[str, Any], special_map: Mapping[str, Any]) -> None:
        self.directory = directory
        self.config = dict(config)
        # Roles (bos_token, eos_token, ...) as strings; special_tokens_map.json overrides tokenizer_config.json.
        self.roles: dict[str, str] = {}
        sources = (
            (config, f"{directory}/tokenizer_config.json"), (special_map, f"{directory}/special_tokens_map.json")
        )
        for source, where in sources:
            for role in SPECIAL_ROLES:
                value = source.get(role)
                token = _content(value)
                if value is not None and token is None:
                    raise CheckpointError(
                        f"{where}: {role} must be a token string (or {{\"content\": ...}}), got {_describe(value)}; "
                        f"fix the file"
                    )
                if token:  # an empty role names no token
                    self.roles[role] = token
        extra = [item for source, where in sources for item in _token_list(source, "additional_special_tokens", where)]
        extras = config.get("extra_special_tokens")
        if isinstance(extras, Mapping):
            extras = list(extras.values())
        if extras is not None:
            extra += _token_list({"extra_special_tokens": extras}, "extra_special_tokens", sources[0][1])
        self.extra_special = [t for t in (_content(v) for v in extra) if t]
        self.clean_up_spaces = flag(config, "clean_up_tokenization_spaces", False, sources[0][1])
        self._bytes: dict[int, bytes | None] = {}  # token_bytes' answers so far

    # -- the backend's part ----------------------------------------------------------------
    def _encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def _decode(self, ids: Sequence[int], skip_special_tokens: bool) -> str:
        raise NotImplementedError

    def token_to_id(self, token: str) -> int | None:
        """The id of a token string (a vocabulary piece or an added token), None if it has none."""
        raise NotImplementedError

    def id_to_token(self, token_id: int) -> str | None:
        """The token string of an id, None outside the vocabulary."""
        raise NotImplementedError

    @property
    def special_ids(self) -> frozenset[int]:
        """Ids decoding skips by default: every special token's."""
        raise NotImplementedError

    def _token_bytes(self, token_id: int) -> bytes | None:
        """token_bytes without the cache."""
        if self.id_to_token(token_id) is None:
            return None
        return self._decode([token_id], False).encode("utf-8")

    # -- shared ----------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; `add_special_tokens` adds what the tokenizer adds around a sequence (a BOS, say)."""
        ids = self._encode(text)
        return self._with_specials(ids) if add_special_tokens else ids

    def _with_specials(self, ids: list[int]) -> list[int]:
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """The text of `ids`; special tokens are left out unless `skip_special_tokens` is False."""
        text = self._decode([int(i) for i in ids], skip_special_tokens)
        return clean_up_tokenization(text) if self.clean_up_spaces else text

    def token_bytes(self, token_id: int) -> bytes | None:
        """The bytes one token contributes to the text, as OpenAI's logprobs report them: a byte-level or byte-fallback
        token that holds part of a character gives just its bytes (the text of several such tokens is their bytes
        joined), a word-start piece its leading space, a special token its own text; None outside the vocabulary."""
        if token_id not in self._bytes:
            self._bytes[token_id] = self._token_bytes(int(token_id))
        return self._bytes[token_id]

    def special_tokens(self) -> dict[str, str]:
        """bos_token, eos_token, ... as a chat template receives them."""
        return dict(self.roles)

    def role_id(self, role: str) -> int | None:
        """The id of the token in `role` (eos_token, say), if the tokenizer has one."""
        token = self.roles.get(role)
        return None if token is None else self.token_to_id(token)


def clean_up_tokenization(text: str) -> str:
    """transformers' clean-up of spaces before punctuation and contractions (when the config asks for it)."""
    for before, after in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                          (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(before, after)
    return text


class JsonTokenizer(Tokenizer):
    """A `tokenizer.json` through the `tokenizers` library (byte-level BPE for Qwen3-VL, and any other model it
    holds)."""

    def __init__(
        self,
        directory: Path,
        config: Mapping[str, Any],
        special_map: Mapping[str, Any],
        added: Mapping[int, Mapping[str, Any]],
    ) -> None:
        super().__init__(directory, config, special_map)
        from tokenizers import AddedToken
        from tokenizers import Tokenizer as Backend

        path = directory / "tokenizer.json"
        try:
            self.backend = Backend.from_file(str(path))
        except Exception as exc:  # the library raises plain Exception for a malformed file
            raise CheckpointError(f"{path}: not a tokenizer the tokenizers library reads ({exc})") from None
        # Added tokens the JSON files declare but tokenizer.json lacks, as transformers adds them: in id order,
        # in one call (the library rebuilds its matcher on every call, so one call per token is quadratic),
        # then the special ones marked special (which leaves them where they are).
        missing = [AddedToken(entry["content"], special=entry["special"], lstrip=entry["lstrip"],
                              rstrip=entry["rstrip"], normalized=entry["normalized"], single_word=entry["single_word"])
                   for _, entry in sorted(added.items()) if self.backend.token_to_id(entry["content"]) is None]
        if missing:
            self.backend.add_tokens(missing)
            self.backend.add_special_tokens([t for t in missing if t.special])
        for token_id, entry in sorted(added.items()):
            content = entry["content"]
            if self.backend.token_to_id(content) != token_id:
                raise CheckpointError(
                    f"{directory}: added token {content!r} is declared as id {token_id} but tokenizer.json gives it "
                    f"{self.backend.token_to_id(content)}; the tokenizer files disagree"
                )
        specials = [self.backend.token_to_id(t) for t in (*self.roles.values(), *self.extra_special)]
        decoder = self.backend.get_added_tokens_decoder()
        specials += [i for i, token in decoder.items() if token.special]
        self._special = frozenset(i for i in specials if i is not None)
        self._added = frozenset(decoder)
        self._kinds: frozenset[str] | None = None

    def _encode(self, text: str) -> list[int]:
        return list(self.backend.encode(text, add_special_tokens=False).ids)

    def _token_bytes(self, token_id: int) -> bytes | None:
        piece = self.id_to_token(token_id)
        if piece is None:
            return None
        if token_id in self._added:
            return piece.encode("utf-8")
        kinds = self._decoder_kinds
        if "ByteLevel" in kinds and all(ch in BYTE_LEVEL for ch in piece):
            return bytes(BYTE_LEVEL[ch] for ch in piece)
        byte = BYTE_PIECE.fullmatch(piece)
        if byte and "ByteFallback" in kinds:
            return bytes([int(byte.group(1), 16)])
        if "Metaspace" in kinds or "Replace" in kinds:  # SentencePiece-style pieces: "▁" is a space
            return piece.replace(SPACE, " ").encode("utf-8")
        return super()._token_bytes(token_id)

    @property
    def _decoder_kinds(self) -> frozenset[str]:
        """The types of tokenizer.json's decoder and of the decoders it chains ("ByteLevel", "Metaspace", ...)."""
        if self._kinds is None:
            decoder = self.backend.decoder
            found: set[str] = set()

            def walk(node: Any) -> None:
                if isinstance(node, dict):
                    if isinstance(node.get("type"), str):
                        found.add(node["type"])
                    for value in node.values():
                        walk(value)
                elif isinstance(node, list):
                    for value in node:
                        walk(value)

            if decoder is not None:
                walk(json.loads(decoder.__getstate__()))
            self._kinds = frozenset(found)
        return self._kinds

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # tokenizer.json's own post-processor adds what the model expects around a sequence.
        return list(self.backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def _decode(self, ids: Sequence[int], skip_special_tokens: bool) -> str:
        if skip_special_tokens:
            ids = [i for i in ids if i not in self._special]
        return self.backend.decode(list(ids), skip_special_tokens=False)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    @property
    def special_ids(self) -> frozenset[int]:
        return self._special


SPACE = "\u2581"  # SentencePiece's word-start mark
BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # a byte-fallback piece


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's printable character for each byte (GPT-2's bytes_to_unicode), inverted: character -> byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
    chars = list(printable)
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


BYTE_LEVEL = _byte_level_alphabet()


def _utf8(data: bytes | bytearray) -> str:
    """Byte pieces as text; bytes that are not valid UTF-8 become one U+FFFD each (the byte-fallback rule)."""
    try:
        return bytes(data).decode("utf-8")
    except UnicodeDecodeError:
        return "\ufffd" * len(data)


class SentencePieceTokenizer(Tokenizer):
    """A SentencePiece `tokenizer.model` (ERNIE-4.5) with added tokens split out before the model sees the text."""

    def __init__(
        self,
        directory: Path,
        config: Mapping[str, Any],
        special_map: Mapping[str, Any],
        added: Mapping[int, Mapping[str, Any]],
    ) -> None:
        super().__init__(directory, config, special_map)
        import sentencepiece

        path = directory / "tokenizer.model"
        self.sp = sentencepiece.SentencePieceProcessor()
        try:
            self.sp.Load(str(path))
        except (OSError, RuntimeError) as exc:
            raise CheckpointError(f"{path}: not a SentencePiece model ({exc})") from None
        self.size = self.sp.GetPieceSize()
        # Added tokens: declared ones with their ids; special roles and extras that are vocabulary pieces.
        self.added: dict[str, int] = {entry["content"]: token_id for token_id, entry in added.items()}
        special = {entry["content"] for entry in added.values() if entry["special"]}
        for token in (*self.roles.values(), *self.extra_special):
            special.add(token)
            if token not in self.added:
                piece = self.sp.PieceToId(token)
                if self.sp.IdToPiece(piece) == token:
                    self.added[token] = piece
        self._by_id = {i: t for t, i in self.added.items()}
        self._special = frozenset(i for t, i in self.added.items() if t in special)
        # Longest first, so that a token containing another is matched whole (as transformers' trie does).
        names = sorted(self.added, key=len, reverse=True)
        self._split = re.compile("(" + "|".join(map(re.escape, names)) + ")") if names else None
        where = f"{directory}/tokenizer_config.json"
        self.add_bos = flag(config, "add_bos_token", False, where)
        self.add_eos = flag(config, "add_eos_token", False, where)

    def _encode(self, text: str) -> list[int]:
        ids: list[int] = []
        pieces = self._split.split(text) if self._split else [text]
        for index, piece in enumerate(pieces):
            if index % 2:  # a captured added token
                ids.append(self.added[piece])
            elif piece:
                ids += self.sp.EncodeAsIds(piece)
        return ids

    def _with_specials(self, ids: list[int]) -> list[int]:
        bos, eos = self.role_id("bos_token"), self.role_id("eos_token")
        return (
            ([bos] if self.add_bos and bos is not None else [])
            + ids
            + ([eos] if self.add_eos and eos is not None else [])
        )

    def _decode(self, ids: Sequence[int], skip_special_tokens: bool) -> str:
        # As transformers decodes a SentencePiece model: pieces with "▁" as spaces, runs of byte pieces
        # (<0xNN>) as UTF-8, added tokens as their text, then one leading space of the whole dropped.
        parts: list[str] = []
        pending = bytearray()
        for token_id in ids:
            piece = self.id_to_token(token_id)
            if piece is None or (skip_special_tokens and token_id in self._special):
                continue
            if token_id not in self._by_id and self.sp.IsByte(token_id):
                pending.append(int(piece[3:5], 16))
                continue
            parts.append(_utf8(pending))
            pending.clear()
            parts.append(piece if token_id in self._by_id else piece.replace(SPACE, " "))
        parts.append(_utf8(pending))
        text = "".join(parts)
        return text[1:] if text.startswith(" ") else text

    def _token_bytes(self, token_id: int) -> bytes | None:
        piece = self.id_to_token(token_id)
        if piece is None:
            return None
        if token_id in self._by_id:
            return piece.encode("utf-8")
        if self.sp.IsByte(token_id):
            return bytes([int(piece[3:5], 16)])
        return piece.replace(SPACE, " ").encode("utf-8")

    def token_to_id(self, token: str) -> int | None:
        if token in self.added:
            return self.added[token]
        piece = self.sp.PieceToId(token)
        return piece if self.sp.IdToPiece(piece) == token else None

    def id_to_token(self, token_id: int) -> str | None:
        if token_id in self._by_id:
            return self._by_id[token_id]
        return self.sp.IdToPiece(token_id) if 0 <= token_id < self.size else None

    @property
    def special_ids(self) -> frozenset[int]:
        return self._special


# An added token's true/false settings in tokenizer_config.json, with transformers' defaults.
ADDED_TOKEN_FLAGS = {"special": True, "lstrip": False, "rstrip": False, "normalized": False, "single_word": False}


def _added_tokens(directory: Path, config: Mapping[str, Any], read: JsonReader) -> dict[int, dict[str, Any]]:
    """Added tokens by id: tokenizer_config.json's `added_tokens_decoder`, then added_tokens.json (content -> id).

    Each entry is checked by type (a non-empty content, true/false flags), so that a malformed file is one line
    naming the entry rather than a token that matches everywhere (an empty one) or a flag read backwards ("false")."""
    where = f"{directory}/tokenizer_config.json"
    added: dict[int, dict[str, Any]] = {}
    decoder = config.get("added_tokens_decoder")
    if decoder is None:
        decoder = {}
    if not isinstance(decoder, Mapping):
        raise CheckpointError(
            f"{where}: added_tokens_decoder must be an object of token id -> token, got {_describe(decoder)}; "
            f"fix the file"
        )
    for key, entry in decoder.items():
        content = _content(entry)
        if content is None or not str(key).isdigit():
            raise CheckpointError(f"{where}: added_tokens_decoder entry {key!r} is malformed")
        if not content:
            raise CheckpointError(
                f"{where}: added_tokens_decoder entry {key!r} is an empty token, which would match between every "
                f"character; remove it"
            )
        fields = entry if isinstance(entry, Mapping) else {}
        flags = {
            name: flag(fields, name, default, f"{where}: added_tokens_decoder entry {key!r}")
            for name, default in ADDED_TOKEN_FLAGS.items()
        }
        added[int(key)] = {**flags, "content": content}
    for content, token_id in read(directory / "added_tokens.json").items():
        if not isinstance(token_id, int) or isinstance(token_id, bool) or token_id < 0:
            raise CheckpointError(f"{directory}/added_tokens.json: {content!r} maps to {token_id!r}, not a token id")
        if not content:
            raise CheckpointError(
                f"{directory}/added_tokens.json: an empty token (id {token_id}) would match between every character; "
                f"remove it"
            )
        added.setdefault(token_id, {**ADDED_TOKEN_FLAGS, "special": False, "content": content})
    return added


def has_tokenizer(directory: str | Path) -> bool:
    """Whether the directory holds a tokenizer fd can read (a special file by that name is refused when it is
    loaded)."""
    return any(os.path.lexists(Path(directory) / name) for name in TOKENIZER_FILES)


def load_tokenizer(directory: str | Path, read: JsonReader = read_json) -> Tokenizer:
    """The tokenizer of a checkpoint directory: tokenizer.json if present, else tokenizer.model.

    `read` reads its JSON files (a Checkpoint passes its own, which reads each file once).
    """
    path = Path(directory)
    if not has_tokenizer(path):
        looked = f"has no tokenizer (looked for {' and '.join(TOKENIZER_FILES)})"
        # Over HTTP the client is told what to send, not where the server keeps its checkpoint.
        raise CheckpointError(in_terms(
            f"{path} {looked}; pass token ids with --prompt-ids, which needs none",
            f"{path} {looked}; pass token ids as the prompt, which needs none",
            http="this model has no tokenizer, so it reads no text; send the prompt as token ids "
                 "(\"prompt\": [1, 2, 3]) to /v1/completions",
        ))
    name = next(n for n in TOKENIZER_FILES if os.path.lexists(path / n))
    regular_file(path / name, str(path / name))
    config = read(path / "tokenizer_config.json")
    special_map = read(path / "special_tokens_map.json")
    added = _added_tokens(path, config, read)
    if name == "tokenizer.json":
        return JsonTokenizer(path, config, special_map, added)
    return SentencePieceTokenizer(path, config, special_map, added)
