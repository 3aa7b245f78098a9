"""Prompts to token ids before any rank starts: text through the tokenizer (and the chat template),
image placeholders expanded per picture, and every prompt checked against the model."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from fd_core.errors import CheckpointError, ConfigError
from fd_core.runtime.chat import expand_placeholders, load_chat_template, render_chat, user_message
from fd_core.runtime.tokenizer import TOKENIZER_FILES, Tokenizer, has_tokenizer, load_tokenizer

if TYPE_CHECKING:
    from fd_core.config import ModelConfig
    from fd_core.models import Architecture
    from fd_core.runner import RunConfig
    from fd_core.runtime.engine import Request


def tokenizer_for(checkpoint: str | None, arch_name: str) -> Tokenizer:
    """The checkpoint's tokenizer; a preset (random weights) has none."""
    if checkpoint is None:
        raise ConfigError(
            f"text prompts need a tokenizer, and the {arch_name} preset has none (a checkpoint directory holds "
            f"{' or '.join(TOKENIZER_FILES)}); pass --checkpoint DIR, or token ids with --prompt-ids"
        )
    return load_tokenizer(checkpoint)


def chat_prompt(tokenizer: Tokenizer, checkpoint: str | Path, text: str, images: int = 0) -> list[int]:
    """The ids of one user message rendered through the checkpoint's chat template (with a generation prompt)."""
    template = load_chat_template(checkpoint)
    if template is None:
        raise CheckpointError(
            f"{checkpoint} has no chat template (looked for chat_template.jinja, chat_template.json and "
            f"tokenizer_config.json's chat_template); drop --chat to send the prompt as it is"
        )
    rendered = render_chat(template, [user_message(text, images)], tokenizer.special_tokens())
    # The template already holds every special token the model expects (as transformers encodes it).
    return tokenizer.encode(rendered, add_special_tokens=False)


def text_prompts(
    texts: Sequence[str], tokenizer: Tokenizer, checkpoint: str | Path, chat: bool, arch: "Architecture", config: "ModelConfig",
    image_shapes: Sequence[tuple[int, int, int]] = (),
) -> list[list[int]]:
    """Token ids of each text prompt; each image placeholder expanded to its picture's number of tokens."""
    prompts = [chat_prompt(tokenizer, checkpoint, t, len(image_shapes)) if chat else tokenizer.encode(t) for t in texts]
    if image_shapes and arch.image_tokens is not None:
        token_id = int(config.extra["image_token_id"])
        counts = [arch.image_tokens(config, shape) for shape in image_shapes]
        prompts = [expand_placeholders(ids, token_id, counts) for ids in prompts]
    return prompts


def check_prompts(
    prompts: Sequence[Sequence[int]], max_new_tokens: int, arch: "Architecture", config: "ModelConfig",
    image_shapes: Sequence[tuple[int, int, int]] = (),
) -> None:
    """Every prompt non-empty, inside the vocabulary, within the context with the new tokens, and fitting the pictures."""
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
                f"{which} has {len(ids)} tokens and {max_new_tokens} new tokens are asked for: {len(ids) + max_new_tokens} "
                f"exceed the model's context of {config.max_position_embeddings} (max_position_embeddings of {arch.name}); "
                f"shorten the prompt or ask for fewer tokens"
            )
        if image_shapes and not arch.multimodal:
            raise ConfigError(f"{arch.name} takes no image; drop --image or choose a VL model")
        if arch.check_prompt is not None:
            arch.check_prompt(config, list(ids), list(image_shapes))


def plan_request(run: "RunConfig", arch: "Architecture", config: "ModelConfig", image_shapes: Sequence[tuple[int, int, int]]) -> tuple["Request", Tokenizer | None]:
    """What `fd run` asked for as a checked Request (prompts as ids), and the tokenizer when there is one."""
    from fd_core.runtime.engine import Request
    from fd_core.runtime.generation_config import GenerationDefaults
    from fd_core.runtime.sampling import SamplingParams

    if run.prompts and run.id_prompts:
        raise ConfigError("pass text prompts (--prompt, --prompts) or token ids (--prompt-ids), not both")
    tokenizer = None
    if run.prompts:
        tokenizer = tokenizer_for(run.checkpoint, arch.name)
        prompts = text_prompts(run.prompts, tokenizer, run.checkpoint or "", run.chat, arch, config, image_shapes)
    else:
        if run.chat:
            raise ConfigError("--chat applies the chat template to text; pass the message with --prompt")
        prompts = [list(p) for p in (run.id_prompts or (run.prompt_ids,))]
        if run.checkpoint is not None and has_tokenizer(run.checkpoint):
            tokenizer = load_tokenizer(run.checkpoint)  # the output still gets its text
        elif run.stop:
            raise ConfigError("--stop strings are matched in the text, and without a tokenizer there is none; drop --stop")
    check_prompts(prompts, run.steps, arch, config, image_shapes)
    defaults = GenerationDefaults.read(run.checkpoint, _raw_config(run.checkpoint))
    given: dict[str, Any] = {"temperature": run.temperature, "top_p": run.top_p, "top_k": run.top_k}
    # Token ids in, token ids out: exactly --max-new-tokens, as before text came in (a benchmark's and the
    # reference tests' mode); text prompts end at an end-of-sequence id.
    sampling = SamplingParams(max_new_tokens=run.steps, seed=run.seed, stop=run.stop, ignore_eos=not run.prompts,
                              **{k: v for k, v in given.items() if v is not None})
    sampling = sampling.with_defaults(defaults.sampling, [k for k, v in given.items() if v is not None])
    eos = list(defaults.eos_ids)
    if tokenizer is not None and tokenizer.role_id("eos_token") is not None and tokenizer.role_id("eos_token") not in eos:
        eos.append(int(tokenizer.role_id("eos_token")))  # type: ignore[arg-type]
    request = Request(tuple(tuple(p) for p in prompts), sampling, tuple(eos), tuple(run.images))
    return request, tokenizer


def _raw_config(checkpoint: str | None) -> dict[str, Any]:
    from fd_core.runtime.tokenizer import read_json

    return read_json(Path(checkpoint) / "config.json") if checkpoint is not None else {}
