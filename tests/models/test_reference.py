"""The independent oracle: checkpoints written by Hugging Face transformers, run by `fd`, give the reference's output.

Each case builds a tiny random model with the reference implementation (transformers on a CPU build
of torch, from the `test` extra), saves it with `save_pretrained` (and its image processor's
`preprocessor_config.json`) as published checkpoints are saved, and compares greedy tokens and
first-step logits with what fd produces from that directory: in this process through the runner
at tp=1 (what `fd run --tp 1` runs), and through the `fd run` command at tp=1 and over two gloo
ranks, graphs on and off. Pictures are PNG files that both sides resize. The seeds are checked to
keep every step's top-2 logits apart, so a token match is not luck of a near-tie; the reference
runs the whole sequence each step, with no cache, so it shares no shortcut with fd.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the reference oracle needs torch's CPU build: pip install -e '.[test]'")
transformers = pytest.importorskip("transformers", reason="the reference oracle needs transformers: pip install -e '.[test]'")

from fd_models.presets import (  # noqa: E402
    TINY_ERNIE_VL,
    TINY_ERNIE_VL_PREPROCESSOR,
    TINY_QWEN3_VL,
    TINY_QWEN3_VL_PREPROCESSOR,
    TINY_TEXT,
)

STEPS = 20
# float32 on both sides; the kernels differ, so logits agree to rounding, not bit for bit.
LOGIT_TOL = 2e-4
# The smallest gap between a step's best and second-best logit that makes a greedy match meaningful.
MIN_MARGIN = 20 * LOGIT_TOL
PROMPT = [5, 17, 42, 99, 7, 300]
# Pictures as PNG files. 37x53 is resized to 32x48 by both processors (multiples of patch 8 x merge 2):
# a 4x6 grid of patches, merged 2x2 into 2x3 = 6 image tokens (non-square on purpose, so that the
# M-RoPE decode offset is not zero). 40x40 becomes 32x32: 4 tokens.
PICTURES = {"wide": (37, 53), "square": (40, 40)}


def _image_prompt(preset: dict[str, Any], *tokens: int) -> list[int]:
    """A prompt with one placeholder run of each length, each between the model's image start and end tokens."""
    start = preset.get("vision_start_token_id", preset.get("image_start_token_id"))
    end = preset.get("vision_end_token_id", preset.get("image_end_token_id"))
    prompt = [5, 17]
    for count in tokens:
        prompt += [start, *[preset["image_token_id"]] * count, end, 42]
    return prompt + [99]


@dataclass
class Case:
    """A saved reference checkpoint and what the reference generated from it."""

    name: str
    directory: Path
    prompt: list[int]
    tokens: list[int]
    first_logits: np.ndarray
    margin: float
    images: tuple[Path, ...] = ()
    # How far the reference's first-step logits move when the picture changes: the image path is really compared.
    image_effect: float = 0.0


# model_type -> (transformers config class, model class)
_CLASSES = {
    "ernie4_5": ("Ernie4_5Config", "Ernie4_5ForCausalLM"),
    "qwen3_vl": ("Qwen3VLConfig", "Qwen3VLForConditionalGeneration"),
    "ernie4_5_vl_moe": ("Ernie4_5_VLMoeConfig", "Ernie4_5_VLMoeForConditionalGeneration"),
}


def _hf_model(preset: dict[str, Any], seed: int) -> Any:
    torch.manual_seed(seed)
    config_cls, model_cls = (getattr(transformers, n) for n in _CLASSES[preset["model_type"]])
    model = model_cls(config_cls(**{k: v for k, v in preset.items() if k not in ("architectures", "model_type")})).eval()
    with torch.no_grad():  # the reference initialises the experts' score-correction bias to zero; exercise it
        for name, param in model.named_parameters():
            if "e_score_correction_bias" in name:
                param.copy_(torch.randn_like(param) * 0.05)
    return model


def _processor(model: Any) -> Any:
    """The reference's image processor (its PIL path, which needs no torchvision) with the tiny preset's settings."""
    if model.config.model_type == "qwen3_vl":
        cls, settings = transformers.Qwen2VLImageProcessorPil, TINY_QWEN3_VL_PREPROCESSOR
    else:
        cls, settings = transformers.Ernie4_5_VLMoeImageProcessorPil, TINY_ERNIE_VL_PREPROCESSOR
    return cls(**{k: v for k, v in settings.items() if k != "image_processor_type"})


def _image_inputs(model: Any, images: tuple[Path, ...]) -> dict[str, Any]:
    """pixel_values and grids from the PNG files, as the published image processor makes them."""
    from PIL import Image

    pixels = _processor(model)(images=[Image.open(path) for path in images], return_tensors="pt")
    return {"pixel_values": pixels["pixel_values"], "image_grid_thw": pixels["image_grid_thw"]}


def _token_types(model: Any, ids: Any) -> dict[str, Any]:
    """What the processor gives besides the pixels: image tokens for M-RoPE, and for ERNIE's experts the start/end tokens too."""
    config = model.config
    image = (ids == config.image_token_id).int()
    if config.model_type == "qwen3_vl":
        return {"mm_token_type_ids": image}
    vision = image | (ids == config.image_start_token_id).int() | (ids == config.image_end_token_id).int()
    return {"mm_token_type_ids": image, "moe_mm_token_type_ids": vision}


def _reference(model: Any, prompt: list[int], images: tuple[Path, ...] = ()) -> tuple[list[int], np.ndarray, float]:
    """Greedy tokens, first-step logits and the smallest top-2 margin over every step.

    Each step runs the whole sequence again (no cache, no stop at end-of-sequence): the reference's
    plainest path, independent of how either side caches.
    """
    extra = _image_inputs(model, images) if images else {}
    ids, steps = list(prompt), []
    with torch.no_grad():
        for _ in range(STEPS):
            tensor = torch.tensor([ids])
            if images:
                extra.update(_token_types(model, tensor))
            logits = model(tensor, **extra).logits[0, -1].float().numpy()
            steps.append(logits)
            ids.append(int(logits.argmax()))
    top2 = np.sort(np.stack(steps), axis=-1)[:, -2:]
    return ids[len(prompt):], steps[0], float((top2[:, 1] - top2[:, 0]).min())


def _save(model: Any, directory: Path, **kwargs: Any) -> Path:
    model.save_pretrained(str(directory), **kwargs)
    if hasattr(model.config, "vision_config"):
        _processor(model).save_pretrained(str(directory))  # preprocessor_config.json, as published checkpoints carry it
    return directory


@pytest.fixture(scope="module")
def cases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Case]:
    """Reference checkpoints: ERNIE-4.5 (float32, bfloat16, sharded, with biases) and Qwen3-VL (text only, tied, with an image)."""
    from PIL import Image

    root = tmp_path_factory.mktemp("reference")
    torch.set_num_threads(1)
    out: dict[str, Case] = {}

    ernie = _hf_model(TINY_TEXT, seed=0)
    tokens, logits, margin = _reference(ernie, PROMPT, None)
    out["ernie"] = Case("ernie", _save(ernie, root / "ernie"), PROMPT, tokens, logits, margin)
    out["ernie-sharded"] = Case("ernie-sharded", _save(ernie, root / "ernie-sharded", max_shard_size="40KB"), PROMPT, tokens, logits, margin)

    # bfloat16 as published: the reference runs the bf16 weights widened to float32, as fd computes on cpu.
    bf16_dir = _save(ernie.to(torch.bfloat16), root / "ernie-bf16")
    widened = transformers.Ernie4_5ForCausalLM.from_pretrained(str(bf16_dir), dtype=torch.float32).eval()
    out["ernie-bf16"] = Case("ernie-bf16", bf16_dir, PROMPT, *_reference(widened, PROMPT))

    biased = _hf_model({**TINY_TEXT, "use_bias": True}, seed=0)
    out["ernie-bias"] = Case("ernie-bias", _save(biased, root / "ernie-bias"), PROMPT, *_reference(biased, PROMPT))

    tied = _hf_model({**TINY_QWEN3_VL, "tie_word_embeddings": True}, seed=5)
    out["qwen3_vl-tied"] = Case("qwen3_vl-tied", _save(tied, root / "qwen3_vl-tied"), PROMPT, *_reference(tied, PROMPT))

    pictures = {}
    for seed, (name, (height, width)) in enumerate([*PICTURES.items(), ("other", PICTURES["wide"])]):
        pictures[name] = root / f"{name}.png"
        pixels = np.random.default_rng(seed + 1).integers(0, 256, (height, width, 3)).astype(np.uint8)  # seeds clear of ties
        Image.fromarray(pixels).save(pictures[name])
    for name, preset, seed in (("qwen3_vl", TINY_QWEN3_VL, 5), ("ernie_vl", TINY_ERNIE_VL, 0)):
        model = _hf_model(preset, seed)
        directory = _save(model, root / name)
        out[f"{name}-text"] = Case(f"{name}-text", directory, PROMPT, *_reference(model, PROMPT))
        one = (pictures["wide"],)
        case = Case(f"{name}-image", directory, _image_prompt(preset, 6), *_reference(model, _image_prompt(preset, 6), one), images=one)
        case.image_effect = float(np.abs(_reference(model, case.prompt, (pictures["other"],))[1] - case.first_logits).max())
        out[case.name] = case
        two = (pictures["wide"], pictures["square"])
        prompt = _image_prompt(preset, 6, 4)
        out[f"{name}-two-images"] = Case(f"{name}-two-images", directory, prompt, *_reference(model, prompt, two), images=two)
    return out


ALL = ["ernie", "ernie-sharded", "ernie-bf16", "ernie-bias", "qwen3_vl-text", "qwen3_vl-tied", "qwen3_vl-image",
       "qwen3_vl-two-images", "ernie_vl-text", "ernie_vl-image", "ernie_vl-two-images"]
IMAGES = [name for name in ALL if name.endswith("-image")]  # one picture, which another picture must change
# `fd run` as a command: through two gloo ranks, graphs on (`--graph on`: at tp=2 the cpu platform's
# auto skips capture, as the default ERNIE run shows), one per model and path (the sharded and bf16
# files differ only in how they are read), the image cases with graphs off too; and the image paths
# at tp=1 from the command line as well.
CLI_RUNS = [
    ("ernie", 2, "auto"), ("ernie", 2, "on"), ("ernie-bf16", 2, "on"), ("qwen3_vl-text", 2, "on"), ("qwen3_vl-image", 2, "on"),
    ("qwen3_vl-image", 2, "off"), ("ernie_vl-text", 2, "on"), ("ernie_vl-image", 2, "on"), ("ernie_vl-image", 2, "off"),
    ("qwen3_vl-two-images", 2, "on"), ("ernie_vl-two-images", 1, "auto"), ("qwen3_vl-image", 1, "off"),
]


def test_reference_cases_are_saved_as_published(cases: dict[str, Case]) -> None:
    """The fixtures are what the tests claim: transformers' layout, a shard index, bfloat16 storage."""
    from safetensors import safe_open

    ernie = cases["ernie"].directory
    with safe_open(str(ernie / "model.safetensors"), framework="np") as f:
        assert f.get_slice("model.layers.0.self_attn.k_proj.weight").get_shape() == [32, 64]  # [out, in]
        assert "lm_head.weight" not in f.keys()  # tied
    index = json.loads((cases["ernie-sharded"].directory / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    with safe_open(str(cases["ernie-bf16"].directory / "model.safetensors"), framework="np") as f:
        assert f.get_slice("model.norm.weight").get_dtype() == "BF16"
    qwen = json.loads((cases["qwen3_vl-text"].directory / "config.json").read_text())
    assert "text_config" in qwen and "rope_theta" in qwen["text_config"]["rope_parameters"]
    with safe_open(str(cases["ernie-bias"].directory / "model.safetensors"), framework="np") as f:
        assert "model.layers.0.mlp.down_proj.bias" in f.keys()
    assert json.loads((cases["qwen3_vl-tied"].directory / "config.json").read_text())["tie_word_embeddings"] is True


@pytest.mark.parametrize("name", ALL)
def test_seed_keeps_every_step_clear_of_a_tie(cases: dict[str, Case], name: str) -> None:
    assert cases[name].margin > MIN_MARGIN, f"{name}: top-2 logits {cases[name].margin:.2e} apart; choose another seed"


def _fd_rank_result(case: Case, graph: str) -> tuple[list[int], np.ndarray, bool]:
    """What `fd run --tp 1` computes, through its plan, rank worker and engine in this process: tokens,
    first-step logits (the model's prefill on the planned pictures), whether a graph was captured."""
    from fd_core.host.loading import load_plugins
    from fd_core.kvcache import KVBatch
    from fd_core.runtime.plan import RunConfig, plan_run
    from fd_core.runtime.session import Session

    run = RunConfig(model=None, tp=1, steps=STEPS, prompt_ids=tuple(case.prompt), checkpoint=str(case.directory),
                    images=tuple(map(str, case.images)), graph=graph, progress=False)
    plugins = load_plugins({})
    plan = plan_run(run, plugins)
    with Session(plan, plugins) as session:  # what `fd run --tp 1` runs
        assert session.worker is not None
        runner = session.worker.runner
        model, decision = runner.model, runner.decision
        assert model is not None and decision is not None
        tokens = session.generate(plan.request)[0].token_ids
        # The prompt prefilled again into the engine's cache (nothing runs there now): its first-step logits.
        at = KVBatch.contiguous(1, 0, len(case.prompt), runner.block_size, -(-len(case.prompt) // runner.block_size))
        logits = model.prefill(np.asarray([case.prompt]), list(plan.request.images) or None, at).numpy()[0]
    return tokens, logits, decision.allowed


@pytest.mark.parametrize("name", ALL)
def test_tp1_matches_the_reference(cases: dict[str, Case], name: str) -> None:
    case = cases[name]
    tokens, logits, _ = _fd_rank_result(case, "off")
    scale = max(1.0, float(np.abs(case.first_logits).max()))
    assert np.abs(logits - case.first_logits).max() <= LOGIT_TOL * scale
    assert tokens == case.tokens


@pytest.mark.parametrize("name", ["ernie", "qwen3_vl-image", "ernie_vl-image"])
def test_tp1_with_a_captured_decode_matches_the_reference(cases: dict[str, Case], name: str) -> None:
    tokens, _, captured = _fd_rank_result(cases[name], "auto")
    assert captured
    assert tokens == cases[name].tokens


@pytest.mark.parametrize("name", IMAGES)
def test_the_image_changes_the_reference_output(cases: dict[str, Case], name: str) -> None:
    """Otherwise an image case would compare only the text path."""
    assert cases[name].image_effect > 100 * LOGIT_TOL


@pytest.fixture(scope="module")
def cli_runs(cases: dict[str, Case]) -> dict[tuple[str, int, str], subprocess.CompletedProcess[str]]:
    """`fd run --json` on each CLI_RUNS case, two at a time (four ranks on a 2-core machine is enough)."""
    done: dict[tuple[str, int, str], subprocess.CompletedProcess[str]] = {}
    for start in range(0, len(CLI_RUNS), 2):
        procs: dict[tuple[str, int, str], subprocess.Popen[str]] = {}
        for name, tp, graph in CLI_RUNS[start : start + 2]:
            case = cases[name]
            args = [sys.executable, "-m", "fd_core.cli", "run", "--tp", str(tp), "--checkpoint", str(case.directory), "--graph", graph,
                    "--steps", str(STEPS), "--prompt-ids", ",".join(map(str, case.prompt)), "--json"]
            for path in case.images:
                args += ["--image", str(path)]
            procs[(name, tp, graph)] = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for key, proc in procs.items():
            out, err = proc.communicate(timeout=300)
            done[key] = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    return done


@pytest.mark.parametrize(("name", "tp", "graph"), CLI_RUNS)
def test_fd_run_matches_the_reference(cases: dict[str, Case], cli_runs: dict[tuple[str, int, str], Any], name: str, tp: int, graph: str) -> None:
    run = cli_runs[(name, tp, graph)]
    assert run.returncode == 0, run.stderr
    result = json.loads(run.stdout)
    # auto captures at tp=1 and skips at tp=2 (no gain on cpu); on captures; off never does.
    assert result["tp"] == tp and result["graph"]["allowed"] is (graph == "on" or (graph == "auto" and tp == 1))
    assert result["tokens"] == cases[name].tokens


@pytest.mark.parametrize(("model", "seed"), [("ernie4_5", 4), ("qwen3_vl", 1)])
def test_save_random_writes_what_transformers_loads(tmp_path: Path, model: str, seed: int) -> None:
    """`fd save-random` writes the published layout: transformers reads it and generates fd's tokens."""
    from fd_core.host.loading import load_plugins
    from fd_core.runtime.job import run_plan
    from fd_core.runtime.plan import RunConfig, plan_run
    from fd_core.runtime.save_random import save_random_checkpoint

    directory = save_random_checkpoint(model, str(tmp_path / model), seed=seed, dtype="bfloat16")
    config = json.loads((directory / "config.json").read_text())
    reference = getattr(transformers, config["architectures"][0]).from_pretrained(str(directory), dtype=torch.float32).eval()
    tokens, _, margin = _reference(reference, PROMPT, None)
    assert margin > MIN_MARGIN, f"{model}: top-2 logits {margin:.2e} apart; choose another seed"
    plugins = load_plugins()
    ours = run_plan(plan_run(RunConfig(model=None, tp=1, steps=STEPS, prompt_ids=tuple(PROMPT), checkpoint=str(directory), progress=False),
                             plugins), plugins)[0]
    assert ours["tokens"] == tokens


# Logprobs: fd's log-softmax (float64 on the host from the float32 logits) against the reference's, computed by torch
# in float64 from its own float32 logits, for the tokens fd generated (greedy, and sampled with a temperature and
# filters, which must not change the logprobs: they are the raw logits'); both sides float32, so ~1e-4.
LOGPROB_TOL = 1e-4
LOGPROB_CASES = ["ernie", "ernie-bf16", "qwen3_vl-text", "qwen3_vl-image"]


def _reference_logprobs(directory: Path, ids: list[int], start: int, images: tuple[Path, ...] = ()) -> np.ndarray:
    """The reference's log_softmax at every position from `start` - 1 on (the distributions ids[start:] were chosen
    from): the saved checkpoint loaded again by transformers, one pass over the whole sequence."""
    config = json.loads((directory / "config.json").read_text())
    model = getattr(transformers, config["architectures"][0]).from_pretrained(str(directory), dtype=torch.float32).eval()
    extra = _image_inputs(model, images) if images else {}
    tensor = torch.tensor([ids])
    if images:
        extra.update(_token_types(model, tensor))
    with torch.no_grad():
        logits = model(tensor, **extra).logits[0, start - 1 : len(ids) - 1].float()
    return torch.log_softmax(logits.double(), dim=-1).numpy()


@pytest.mark.parametrize("name", LOGPROB_CASES)
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_logprobs_match_the_reference_log_softmax(cases: dict[str, Case], name: str, sampled: bool) -> None:
    from fd_core.runtime import LLM, SamplingParams

    case, k = cases[name], 5
    settings = SamplingParams(max_new_tokens=12, ignore_eos=True, logprobs=k,
                              **(dict(temperature=0.7, top_k=3, top_p=0.9, seed=2) if sampled else {}))
    with LLM(case.directory, tp=1, graph="off") as llm:
        completion = llm.generate([case.prompt], settings, images=[str(p) for p in case.images])[0]
    if not sampled:
        assert completion.token_ids == case.tokens[:12]
    assert completion.logprobs is not None and len(completion.logprobs) == len(completion.token_ids)
    reference = _reference_logprobs(case.directory, case.prompt + completion.token_ids, len(case.prompt), case.images)
    for step, (logprob, row) in enumerate(zip(completion.logprobs, reference, strict=True)):
        assert logprob.token == completion.token_ids[step]
        assert abs(logprob.logprob - row[logprob.token]) <= LOGPROB_TOL, (step, logprob.logprob, row[logprob.token])
        assert [abs(v - row[t]) <= LOGPROB_TOL for t, v in logprob.top] == [True] * k, (step, logprob.top)
        # The reference's k most likely, in its order, where its k + 1 most likely are clear of each other; where two
        # are within the tolerance, any that are as likely as its k-th within it.
        expected = [int(t) for t in np.argsort(-row, kind="stable")[: k + 1]]
        ours = [t for t, _ in logprob.top]
        if all(row[expected[i]] - row[expected[i + 1]] > 2 * LOGPROB_TOL for i in range(k)):
            assert ours == expected[:k], (step, ours, expected)
        else:
            assert all(row[t] >= row[expected[k - 1]] - 2 * LOGPROB_TOL for t in ours), (step, ours, expected)
        assert [v for _, v in logprob.top] == sorted((v for _, v in logprob.top), reverse=True)


@pytest.mark.parametrize("name", ["ernie", "qwen3_vl-text"])
def test_prompt_logprobs_match_the_reference_log_softmax(cases: dict[str, Case], name: str) -> None:
    """What /v1/completions' echo shows: each prompt token's logprob given the tokens before it, against the
    reference's log_softmax over the prompt in one pass."""
    from fd_core.runtime import LLM, SamplingParams

    case, k = cases[name], 4
    with LLM(case.directory, tp=1, graph="off") as llm:
        completion = llm.generate([case.prompt], SamplingParams(max_new_tokens=2, prompt_logprobs=k))[0]
    assert completion.token_ids == case.tokens[:2]  # scoring the prompt changes no token
    scored = completion.prompt_logprobs
    assert scored is not None and len(scored) == len(case.prompt) and scored[0] is None
    reference = _reference_logprobs(case.directory, case.prompt, 1)
    for position, (logprob, row) in enumerate(zip(scored[1:], reference, strict=True), start=1):
        assert logprob is not None and logprob.token == case.prompt[position]
        assert abs(logprob.logprob - row[logprob.token]) <= LOGPROB_TOL, (position, logprob.logprob, row[logprob.token])
        assert [abs(v - row[t]) <= LOGPROB_TOL for t, v in logprob.top] == [True] * k, (position, logprob.top)


class _OpenAIPenalties:
    """OpenAI's presence and frequency penalties as a transformers logits processor, written from OpenAI's formula
    (logit - count * frequency - (count > 0) * presence, over the generated tokens only), one token at a time."""

    def __init__(self, presence: float, frequency: float, prompt_length: int) -> None:
        self.presence, self.frequency, self.prompt_length = presence, frequency, prompt_length

    def __call__(self, input_ids: Any, scores: Any) -> Any:
        scores = scores.clone()
        for row, ids in enumerate(input_ids.tolist()):
            generated = ids[self.prompt_length:]
            for token in set(generated):
                scores[row, token] -= generated.count(token) * self.frequency + self.presence
        return scores


EOS = 2  # the tiny checkpoints' eos_token_id (transformers' default generation_config)
# fd's SamplingParams fields, and the reference's generate() arguments for the same processing. transformers adds a
# sequence bias before its repetition penalty and fd after, so no setting combines the two.
PENALTIES = {
    "repetition 1.3": ({"repetition_penalty": 1.3}, {"repetition_penalty": 1.3}),
    "repetition 0.7": ({"repetition_penalty": 0.7}, {"repetition_penalty": 0.7}),
    "presence and frequency": ({"presence_penalty": 1.5, "frequency_penalty": 0.6}, {"openai": (1.5, 0.6)}),
    "repetition with presence": ({"repetition_penalty": 1.2, "presence_penalty": 2.0}, {"repetition_penalty": 1.2, "openai": (2.0, 0.0)}),
    "logit bias": ({"logit_bias": {7: 4.0, 84: -100.0}}, {"sequence_bias": {(7,): 4.0, (84,): -100.0}}),
    "min tokens against a biased eos": ({"logit_bias": {EOS: 60.0}, "min_tokens": 5}, {"sequence_bias": {(EOS,): 60.0}, "min_new_tokens": 5}),
}


def _reference_processed(case: Case, setting: str) -> list[int]:
    """The reference's greedy tokens under PENALTIES[setting], its processed top-2 checked apart at every step."""
    model = transformers.Ernie4_5ForCausalLM.from_pretrained(str(case.directory), dtype=torch.float32).eval()
    extra = dict(PENALTIES[setting][1])
    if "openai" in extra:
        extra["logits_processor"] = transformers.LogitsProcessorList([_OpenAIPenalties(*extra.pop("openai"), len(case.prompt))])
    ids = torch.tensor([case.prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=STEPS, do_sample=False,
                         output_scores=True, return_dict_in_generate=True, **extra)
    for step, scores in enumerate(out.scores):
        top = torch.topk(scores[0].float(), 2).values
        assert float(top[0] - top[1]) > MIN_MARGIN, f"{setting}: step {step}'s top-2 are {float(top[0] - top[1]):.2e} apart"
    return out.sequences[0, len(case.prompt):].tolist()


@pytest.mark.parametrize("setting", list(PENALTIES))
def test_penalties_bias_and_min_tokens_match_the_reference_generate(cases: dict[str, Case], setting: str) -> None:
    """Greedy tokens with the logits processing of SamplingParams equal transformers' generate() with its own
    processors (presence and frequency, which transformers lacks, as a processor written from OpenAI's formula), and
    the reference's processed top-2 stay apart at every step, so a match is not a near-tie's luck."""
    from fd_core.runtime import LLM, SamplingParams

    ours = PENALTIES[setting][0]
    case = cases["ernie"]
    expected = _reference_processed(case, setting)
    with LLM(case.directory, tp=1, graph="off") as llm:
        completion = llm.generate([case.prompt], SamplingParams(max_new_tokens=STEPS, **ours))[0]
    assert completion.token_ids == expected
    if "min_tokens" in ours:
        assert expected[-1] == EOS and len(expected) == ours["min_tokens"] + 1 and completion.finish_reason == "eos"


def test_fd_run_applies_the_penalties_on_every_rank(cases: dict[str, Case]) -> None:
    """`fd run` over two gloo ranks with a captured decode, its penalty flags given: the reference's tokens (each
    rank processes its own copy of the logits, and every rank must choose the same token)."""
    case = cases["ernie"]
    expected = _reference_processed(case, "repetition with presence")
    assert EOS not in expected  # fd run on token ids generates exactly --steps tokens
    run = subprocess.run([sys.executable, "-m", "fd_core.cli", "run", "--tp", "2", "--checkpoint", str(case.directory),
                          "--graph", "on", "--steps", str(STEPS), "--prompt-ids", ",".join(map(str, case.prompt)),
                          "--repetition-penalty", "1.2", "--presence-penalty", "2", "--json"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["tokens"] == expected


@pytest.mark.parametrize(("temperature", "min_p"), [(0.7, 0.05), (1.3, 0.3), (1.0, 0.9)])
def test_min_p_keeps_exactly_the_tokens_the_reference_warper_keeps(temperature: float, min_p: float) -> None:
    """fd's min_p (a threshold on the logits) against transformers' MinPLogitsWarper (on the probabilities after its
    TemperatureLogitsWarper): the same tokens survive."""
    from fd_core.runtime.engine.sampling import SamplingParams, process_logits

    rows = (np.random.default_rng(4).standard_normal((8, 500)) * 3).astype(np.float32)
    params = [SamplingParams(temperature=temperature, min_p=min_p)] * len(rows)
    ours = process_logits(rows, params, [[]] * len(rows), [[]] * len(rows), [()] * len(rows), lambda *a: None)
    warped = transformers.TemperatureLogitsWarper(temperature)(None, torch.tensor(rows))
    reference = transformers.MinPLogitsWarper(min_p)(None, warped)
    kept = np.isfinite(ours)
    assert (kept == torch.isfinite(reference).numpy()).all()
    assert 1 <= kept.sum(axis=1).min() and kept.sum() < kept.size  # something dropped, the likeliest kept


def test_min_p_one_samples_the_greedy_tokens(cases: dict[str, Case]) -> None:
    """min_p 1 leaves only the likeliest token, so sampling at any temperature gives the reference's greedy tokens."""
    from fd_core.runtime import LLM, SamplingParams

    case = cases["ernie"]
    settings = SamplingParams(max_new_tokens=STEPS, temperature=1.5, min_p=1.0, seed=3, ignore_eos=True)
    with LLM(case.directory, tp=1, graph="off") as llm:
        assert llm.generate([case.prompt], settings)[0].token_ids == case.tokens
