"""What to generate, built once before any rank starts, for `fd run` and the Python API alike: text
through the tokenizer (and the chat template), image placeholders expanded per picture, every prompt
checked against the model, the checkpoint's sampling defaults and end-of-sequence ids."""

from __future__ import annotations

import functools
import threading
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

from fd_core.config import DEFAULT_GRAMMAR_TIMEOUT_S
from fd_core.errors import CheckpointError, ConfigError, FdError, in_terms, package_failure, setting
from fd_core.runtime.engine.sampling import SamplingParams
from fd_core.runtime.images import check_picture
from fd_core.runtime.text.chat import expand_placeholders, render_chat, user_message
from fd_core.runtime.text.generation_config import GenerationDefaults
from fd_core.runtime.text.tokenizer import TOKENIZER_FILES, Tokenizer

if TYPE_CHECKING:
    from fd_core.config import ModelConfig, ParallelConfig
    from fd_core.host.backend import Backend
    from fd_core.models import Architecture
    from fd_core.runtime.checkpoint import Checkpoint
    from fd_core.runtime.memory import MemoryPlan

# The sampling fields a checkpoint's generation_config.json may give defaults for.
SAMPLING_DEFAULTS = ("temperature", "top_p", "top_k")


@dataclass(frozen=True)
class Request:
    """Prompts as token ids, how to sample and stop, and the pictures every prompt holds (decoded arrays [C, H, W])."""

    prompts: tuple[tuple[int, ...], ...]
    sampling: SamplingParams = SamplingParams()
    eos_ids: tuple[int, ...] = ()
    images: tuple[Any, ...] = ()

    @classmethod
    def greedy(cls, prompts: Sequence[Sequence[int]], max_new_tokens: int, images: Sequence[Any] = ()) -> "Request":
        """Token ids in, exactly `max_new_tokens` greedy ids out (no end-of-sequence stop): the reference tests'
        mode."""
        return cls(
            tuple(tuple(int(t) for t in p) for p in prompts),
            SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True),
            (),
            tuple(images),
        )


def tokenizer_for(checkpoint: "Checkpoint | None", arch_name: str) -> Tokenizer:
    """The checkpoint's tokenizer; a preset (random weights) has none."""
    if checkpoint is None:
        raise ConfigError(
            f"text prompts need a tokenizer, and the {arch_name} preset has none (a checkpoint directory holds "
            f"{' or '.join(TOKENIZER_FILES)}); "
            + in_terms("pass --checkpoint DIR, or token ids with --prompt-ids",
                       "pass a checkpoint directory with its tokenizer, or token ids as the prompt",
                       http="send the prompt as token ids (\"prompt\": [1, 2, 3]) to /v1/completions")
        )
    return checkpoint.tokenizer()


def render_messages(
    tokenizer: Tokenizer, checkpoint: "Checkpoint", messages: Sequence[Mapping[str, Any]], instead: str,
    tools: Sequence[Mapping[str, Any]] | None = None, check_text: Callable[[str], None] | None = None,
) -> list[int]:
    """The ids of a conversation rendered through the checkpoint's chat template (with a generation prompt and the
    `tools` offered); `instead` is what to do when the checkpoint has no template. `check_text` sees the rendered text
    before the tokenizer does (check_text_length: one too long for the context is refused untokenized)."""
    template = checkpoint.chat_template()
    if template is None:
        looked = ("(looked for chat_template.jinja, chat_template.json and tokenizer_config.json's chat_template); "
                  f"{instead}")
        # A client is not told where the server keeps its checkpoint, nor which files it looked in.
        raise CheckpointError(in_terms(f"{checkpoint.directory} has no chat template {looked}",
                                       f"{checkpoint.directory} has no chat template {looked}",
                                       http=f"this model has no chat template; {instead}"))
    rendered = render_chat(template, messages, tokenizer.special_tokens(), source=checkpoint.chat_template_file(),
                           tools=tools)
    if check_text is not None:
        check_text(rendered)
    # The template already holds every special token the model expects (as transformers encodes it).
    return tokenizer.encode(rendered, add_special_tokens=False)


def chat_prompt(
    tokenizer: Tokenizer, checkpoint: "Checkpoint", text: str, images: int = 0,
    check_text: Callable[[str], None] | None = None,
) -> list[int]:
    """The ids of one user message rendered through the checkpoint's chat template (with a generation prompt)."""
    fix = in_terms("drop --chat to send the prompt as it is", "pass chat=False to send the prompt as it is")
    return render_messages(tokenizer, checkpoint, [user_message(text, images)], fix, check_text=check_text)


def messages_prompt(
    messages: Sequence[Mapping[str, Any]], checkpoint: "Checkpoint | None", arch: "Architecture", config: "ModelConfig",
    images: Sequence[Any] = (), tools: Sequence[Mapping[str, Any]] | None = None,
) -> list[int]:
    """Chat messages ({"role", "content"} mappings) as prompt ids, with the `tools` offered (OpenAI's function
    definitions, as the template takes them), each picture's placeholder expanded to its number of tokens."""
    if checkpoint is None or not checkpoint.has_tokenizer():
        raise ConfigError(
            "chat messages are rendered through a checkpoint's chat template and tokenizer, and this model has none; "
            + in_terms("pass token ids with --prompt-ids", "pass token ids as the prompt",
                       http="send the prompt as token ids (\"prompt\": [1, 2, 3]) to /v1/completions")
        )
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str) or "content" not in message:
            raise ConfigError(
                f"message {index + 1} must be a mapping with a 'role' string and a 'content', got {message!r:.80}"
            )
    tokenizer = checkpoint.tokenizer()

    def fits(text: str) -> None:
        check_text_length(text, tokenizer, "the conversation with its chat template", arch, config)

    instead = in_terms("send the prompt as text or token ids instead", "send the prompt as text or token ids instead",
                       http="send the prompt as text or token ids to /v1/completions instead")
    ids = render_messages(tokenizer, checkpoint, messages, instead, tools, check_text=fits)
    if images and arch.image_tokens is not None:
        pictures = [check_picture(p, f"images[{index}]") for index, p in enumerate(images)]
        shapes = [(int(p.shape[0]), int(p.shape[1]), int(p.shape[2])) for p in pictures]
        ids = expand_placeholders(ids, int(config.extra["image_token_id"]), image_token_counts(arch, config, shapes))
    return ids


def _check_utf8(text: str, which: str) -> None:
    """Text a tokenizer can take: a command line that is not UTF-8 arrives with its bytes as lone surrogates."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        char = ord(text[exc.start])
        what = f"the byte {char - 0xDC00:#04x}" if 0xDC80 <= char <= 0xDCFF else f"the lone surrogate U+{char:04X}"
        raise ConfigError(
            f"{which} is not valid UTF-8 text ({what} at character {exc.start}); pass the text encoded as UTF-8"
        ) from None


# The tokens of a text cover its bytes, and no token covers more than its tokenizer's longest token: a text longer
# than the context times that many bytes cannot fit, whatever its tokenization, and is refused before the tokenizer
# sees it (tokenizing megabytes takes seconds, holding the GIL, and gigabytes). Per tokenizer, computed once: (the
# vocabulary size it was computed for, its longest token in bytes, whether it normalizes text).
_TEXT_BOUNDS: "weakref.WeakKeyDictionary[Tokenizer, tuple[int, int, bool]]" = weakref.WeakKeyDictionary()
_TEXT_BOUNDS_LOCK = threading.Lock()
# Text a tokenizer that keeps every byte of its input gives back unchanged (byte-level BPE does). One that changes
# any of these normalizes: SentencePiece's nmt_nfkc drops control and zero-width characters and collapses whitespace,
# NFC and NFKC compose characters, StripAccents drops combining marks.
NORMALIZATION_PROBES = ("a  b\n\n\tc", "x\x01\x7fy", "p\u200bq\ufeffr", "e\u0301", "\u1100\u1161\u11a8", "\ufb01",
                        "s\u3000t")
# What a normalizing tokenizer may drop is not counted for it: only letters, digits and underscores (what \w matches)
# are. The ASCII bytes that are none of these:
ASCII_NON_WORD = bytes(b for b in range(128) if not (chr(b).isalnum() or b == ord("_")))
# Canonical composition turns at most 3 bytes of input into 1 of text (Hangul jamo: 3 characters of 3 bytes into one
# syllable of 3): a normalizing tokenizer's token may cover 3 times its own bytes.
COMPOSITION = 3


def text_bound(tokenizer: Tokenizer, vocab_size: int) -> tuple[int, bool]:
    """(the longest token of ids 0..vocab_size - 1 in bytes, through Tokenizer.token_bytes; whether the tokenizer
    normalizes text), computed once per tokenizer. Ids the model does not have are left out: a prompt holding one is
    refused anyway (outside the vocabulary)."""
    with _TEXT_BOUNDS_LOCK:
        known = _TEXT_BOUNDS.get(tokenizer)
        if known is None or known[0] != vocab_size:
            longest = max((len(tokenizer.token_bytes(i) or b"") for i in range(vocab_size)), default=0)
            normalizes = any(
                tokenizer.decode(tokenizer.encode(p, add_special_tokens=False), skip_special_tokens=False) != p
                for p in NORMALIZATION_PROBES
            )
            known = _TEXT_BOUNDS[tokenizer] = (vocab_size, longest, normalizes)
    return known[1], known[2]


@functools.cache
def _word_characters() -> Any:
    """For every code point, whether it is a letter, a digit or an underscore (a numpy bool array, built once)."""
    import numpy as np

    table = np.fromiter((chr(c).isalnum() for c in range(0x110000)), dtype=bool, count=0x110000)
    table[ord("_")] = True
    return table


def word_bytes(text: str) -> int:
    """The UTF-8 bytes of the letters, digits and underscores of `text`, in C's time rather than a regex's (16 MB in
    a few hundredths of a second, a third of a second if it is not ASCII)."""
    if text.isascii():
        return len(text.encode("ascii").translate(None, ASCII_NON_WORD))
    import numpy as np

    codes = np.frombuffer(text.encode("utf-32-le", errors="surrogatepass"), dtype="<u4")
    kept = codes[_word_characters()[codes]]
    # A code point's UTF-8 length: 1 byte, one more from U+0080, U+0800 and U+10000 on.
    return int(kept.size + sum(np.count_nonzero(kept >= bound) for bound in (0x80, 0x800, 0x10000)))


def check_text_length(text: str, tokenizer: Tokenizer, which: str, arch: "Architecture", config: "ModelConfig") -> None:
    """Refuse, without tokenizing it, a text that cannot fit the model's context whatever its tokenization: more
    bytes than the context times the tokenizer's longest token (for a tokenizer that normalizes text, its letters and
    digits alone against 3 times that). A text within the bound is left to check_prompts, once tokenized."""
    longest, normalizes = text_bound(tokenizer, config.vocab_size)
    context = config.max_position_embeddings
    per_token = longest * (COMPOSITION if normalizes else 1)
    if per_token <= 0 or len(text) * 4 <= context * per_token:  # a character is at most 4 bytes of UTF-8
        return
    size = len(text.encode("utf-8", errors="surrogatepass"))
    if size > context * per_token and normalizes:
        size = word_bytes(text)
    if size <= context * per_token:
        return
    least = -(-size // per_token)
    if normalizes:
        what = (f"holds {size} bytes of letters and digits: at least {least} tokens at {per_token} bytes a token "
                f"({COMPOSITION} times its tokenizer's longest token, as the tokenizer normalizes text)")
    else:
        what = f"is {size} bytes: at least {least} tokens at {per_token} bytes a token (its tokenizer's longest)"
    raise ConfigError(
        f"{which} {what}, more than the model's context of {context} (max_position_embeddings of {arch.name}); "
        f"shorten the prompt"
    )


def image_token_counts(
    arch: "Architecture", config: "ModelConfig", shapes: Sequence[tuple[int, int, int]]
) -> list[int]:
    """The placeholder tokens each picture takes (`arch.image_tokens`); a picture the model's processor refuses (its
    ValueError says why: an aspect ratio above 200, say) is one line naming the picture, another exception the
    package's."""
    assert arch.image_tokens is not None
    counts = []
    for index, shape in enumerate(shapes):
        try:
            counts.append(arch.image_tokens(config, shape))
        except FdError:
            raise
        except ValueError as exc:
            which = f"picture {index + 1}" if len(shapes) > 1 else "the picture"
            raise ConfigError(f"{which}: {' '.join(str(exc).split())}") from None
        except Exception as exc:  # noqa: BLE001 - the package's own bug: one line naming it, the traceback in a file
            raise package_failure(arch.package, "image_tokens", exc, ConfigError) from None
    return counts


def text_prompts(
    texts: Sequence[str], tokenizer: Tokenizer, checkpoint: "Checkpoint", chat: bool, arch: "Architecture",
    config: "ModelConfig", image_shapes: Sequence[tuple[int, int, int]] = (),
) -> list[list[int]]:
    """Token ids of each text prompt; each image placeholder expanded to its picture's number of tokens. A text too
    long for the context whatever its tokenization is refused before the tokenizer sees it (check_text_length)."""
    labels = [f"prompt {index + 1}" if len(texts) > 1 else "the prompt" for index in range(len(texts))]
    for text, which in zip(texts, labels, strict=True):
        _check_utf8(text, which)
        if not chat:  # every prompt checked before any is tokenized
            check_text_length(text, tokenizer, which, arch, config)
    prompts = []
    for text, which in zip(texts, labels, strict=True):
        if chat:
            def fits(rendered: str, which: str = which) -> None:
                check_text_length(rendered, tokenizer, f"{which} with its chat template", arch, config)

            prompts.append(chat_prompt(tokenizer, checkpoint, text, len(image_shapes), check_text=fits))
        else:
            prompts.append(tokenizer.encode(text))
    if image_shapes and arch.image_tokens is not None:
        token_id = int(config.extra["image_token_id"])
        counts = image_token_counts(arch, config, image_shapes)
        prompts = [expand_placeholders(ids, token_id, counts) for ids in prompts]
    return prompts


def check_prompts(
    prompts: Sequence[Sequence[int]], max_new_tokens: int, arch: "Architecture", config: "ModelConfig",
    image_shapes: Sequence[tuple[int, int, int]] = (),
) -> None:
    """Every prompt non-empty, inside the vocabulary, within the context with the new tokens, and fitting the
    pictures."""
    for index, ids in enumerate(prompts):
        which = f"prompt {index + 1}" if len(prompts) > 1 else "the prompt"
        if not ids:
            raise ConfigError(f"{which} is empty; pass at least one token")
        bad = [t for t in ids if not 0 <= t < config.vocab_size]
        if bad:
            owner = f"prompt {index + 1}" if len(prompts) > 1 else "prompt"
            raise ConfigError(f"{owner} token id {bad[0]} is outside the vocabulary 0..{config.vocab_size - 1}")
        if len(ids) + max_new_tokens > config.max_position_embeddings:
            raise ConfigError(
                f"{which} has {len(ids)} tokens and {max_new_tokens} new tokens are asked for: "
                f"{len(ids) + max_new_tokens} exceed the model's context of {config.max_position_embeddings} "
                f"(max_position_embeddings of {arch.name}); shorten the prompt or ask for fewer tokens"
            )
        if image_shapes and not arch.multimodal:
            raise ConfigError(f"{arch.name} takes no image; drop {setting('images')} or choose a VL model")
        if arch.check_prompt is not None:
            arch.check_prompt(config, list(ids), list(image_shapes))


def build_request(
    prompts: Sequence[str] | Sequence[Sequence[int]], sampling: SamplingParams, *, arch: "Architecture",
    config: "ModelConfig", checkpoint: "Checkpoint | None", chat: bool = False, images: Sequence[Any] = (),
    given: Sequence[str] = SAMPLING_DEFAULTS, memory: "MemoryPlan | None" = None, backend: "Backend | None" = None,
    parallel: "ParallelConfig | None" = None, stream: bool = False,
    grammar_timeout: float = DEFAULT_GRAMMAR_TIMEOUT_S,
) -> Request:
    """Text prompts (all str) or token-id prompts as a checked Request, with the checkpoint's defaults for the
    sampling fields not in `given` and its end-of-sequence ids. `images` are decoded pictures [C, H, W].

    With `memory` (the plan's), a request whose longest sequence needs more KV cache than the capacity is
    refused; with `backend`, every plugin's fd_check_request may refuse it (`parallel` is the run's layout,
    `stream` whether its text is streamed to the caller as it is produced). Both before any rank sees it. A grammar
    (SamplingParams.grammar) is compiled for the model's tokens and refused past `grammar_timeout` seconds."""
    images = [check_picture(p, f"images[{index}]") for index, p in enumerate(images)]
    shapes = [(int(p.shape[0]), int(p.shape[1]), int(p.shape[2])) for p in images]
    texts = [p for p in prompts if isinstance(p, str)]
    if texts:
        tokenizer = tokenizer_for(checkpoint, arch.name)
        assert checkpoint is not None
        ids = text_prompts(texts, tokenizer, checkpoint, chat, arch, config, shapes)
    else:
        ids = [[int(t) for t in p] for p in prompts]
    if sampling.prompt_logprobs is not None and images:
        raise ConfigError("prompt_logprobs scores text prompts only (a prompt with pictures is prefilled whole); drop "
                          "prompt_logprobs, or the pictures")
    check_prompts(ids, sampling.max_new_tokens, arch, config, shapes)
    outside = [token for token, _ in sampling.bias if token >= config.vocab_size]
    if outside:
        raise ConfigError(f"logit_bias names token id {outside[0]}, outside the vocabulary 0..{config.vocab_size - 1}")
    if sampling.grammar is not None and (checkpoint is None or not checkpoint.has_tokenizer()):
        raise ConfigError("structured output (a grammar) constrains text, and without the checkpoint's tokenizer "
                          "there is none; use a checkpoint with a tokenizer, or drop the grammar")
    defaults = checkpoint.generation_defaults() if checkpoint is not None else GenerationDefaults()
    try:
        sampling = sampling.with_defaults(defaults.sampling, given)
    except ConfigError as exc:  # a default of the checkpoint's out of range: name the file it came from
        assert checkpoint is not None
        raise CheckpointError(
            f"{checkpoint.directory}/generation_config.json: its default {exc}; fix the file, or pass the setting"
        ) from None
    eos = list(defaults.eos_ids)
    held = checkpoint.tokenizer_if_any() if checkpoint is not None else None
    tokenizer_eos = held.role_id("eos_token") if held is not None else None
    if tokenizer_eos is not None and tokenizer_eos not in eos:
        eos.append(tokenizer_eos)
    if sampling.grammar is not None:
        # Compiled for the model's tokens here, under its budget, as the engine will: a grammar that fails there (one
        # that admits nothing, or is past llguidance's limits) is refused before any rank works on it.
        from fd_core.runtime.text.grammar import check_followable, grammars_for

        assert checkpoint is not None
        grammars = grammars_for(checkpoint.tokenizer(), config.vocab_size, eos or None)
        check_followable(sampling.grammar, grammars, grammar_timeout)
    request = Request(tuple(tuple(p) for p in ids), sampling, tuple(eos), tuple(images))
    if memory is not None:
        memory.check_request(request.prompts, sampling.max_new_tokens, config.max_position_embeddings, arch.name)
    if backend is not None:
        backend.check_request(request, config, parallel, stream)
    return request
