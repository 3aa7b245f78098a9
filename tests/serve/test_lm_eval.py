"""lm-evaluation-harness (the test extra's `lm_eval`) against a real `fd serve` on the tiny preset, as an evaluation
user runs it: `local-completions` with its remote tokenizer (fd serve's /tokenizer_info and /tokenize, no tokenizer
path on the client) for a multiple-choice task scored by log-likelihood and a generate-until task, and
`local-chat-completions` for the generate-until task through the chat template. Both tasks read small local data
files. The oracle is the Python API on the same checkpoint: each choice's log-likelihood summed from
`prompt_logprobs`, and the greedy text of each prompt."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Iterator

import pytest

from fd_core.runtime import LLM, SamplingParams

lm_eval = pytest.importorskip("lm_eval", reason="lm-evaluation-harness comes with the test extra (pip install -e "
                                                "'.[cpu,test]')")

from serving import Served, finish, start_server  # noqa: E402

CHOICE = [
    {"question": "The quick brown fox", "choices": ["jumps", "sleeps", "runs"], "answer": 0},
    {"question": "Hello, world! How are", "choices": ["you", "they"], "answer": 1},
    {"question": "Numbers like 1, 2,", "choices": ["3", "ten", "many"], "answer": 2},
]
GENERATE = [{"question": "Once upon a time", "answer": " there"},
            {"question": "The server keeps the model", "answer": " loaded"}]
MAX_GEN_TOKS = 6
TASKS = {
    "fd_choice": """task: fd_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
""",
    "fd_generate": """task: fd_generate
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: """ + str(MAX_GEN_TOKS) + """
  do_sample: false
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
""",
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from fd_core.serve.tiny import write_tiny_checkpoint

    return write_tiny_checkpoint(tmp_path_factory.mktemp("lm-eval") / "tiny")


@pytest.fixture(scope="module")
def served(checkpoint: Path) -> Iterator[Served]:
    server = start_server(["--checkpoint", str(checkpoint), "--tp", "1", "--name", "tiny"])
    yield server
    finish(server)


@pytest.fixture(scope="module")
def tasks(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("lm-eval-tasks")
    for name, rows in (("fd_choice", CHOICE), ("fd_generate", GENERATE)):
        data = root / f"{name}.jsonl"
        data.write_text("".join(json.dumps(row) + "\n" for row in rows))
        (root / f"{name}.yaml").write_text(TASKS[name].format(data=data))
    return root


def _evaluate(model: str, url: str, tasks: Path, names: list[str], monkeypatch: pytest.MonkeyPatch,
              **options: Any) -> dict[str, Any]:
    """simple_evaluate as `lm_eval --model MODEL --include_path TASKS --log_samples` runs it, offline."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    arguments = ",".join(f"{k}={v}" for k, v in {"base_url": url, "model": "tiny", "num_concurrent": 1,
                                                 "max_retries": 1, **options}.items())
    return simple_evaluate(model=model, model_args=arguments, tasks=names, log_samples=True,
                           task_manager=TaskManager(include_path=str(tasks)),
                           apply_chat_template=model == "local-chat-completions")


def test_local_completions_scores_choices_and_generates_as_the_python_api(
    served: Served, checkpoint: Path, tasks: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    results = _evaluate("local-completions", f"{served.url}/v1/completions", tasks, ["fd_choice", "fd_generate"],
                        monkeypatch, tokenizer_backend="remote", tokenized_requests=True)
    with LLM(str(checkpoint), tp=1, graph="off") as llm:
        tokenizer = llm.tokenizer
        assert tokenizer is not None
        # lm-eval scores each choice as the context's ids then the continuation's (" " + the choice), each tokenized
        # on its own; its log-likelihood is the sum of the continuation tokens' logprobs given what precedes them.
        want_scores, got_scores = [], []
        for doc, sample in zip(CHOICE, sorted(results["samples"]["fd_choice"], key=lambda s: s["doc_id"]),
                               strict=True):
            for choice, response in zip(doc["choices"], sample["resps"], strict=True):
                context, continuation = tokenizer.encode(doc["question"]), tokenizer.encode(" " + choice)
                done = llm.generate([context + continuation], SamplingParams(max_new_tokens=1, prompt_logprobs=0))[0]
                want_scores.append(sum(p.logprob for p in done.prompt_logprobs[len(context):]))
                got_scores.append(float(response[0][0]))
        texts = [c.text for c in llm.generate([d["question"] for d in GENERATE],
                                              SamplingParams(max_new_tokens=MAX_GEN_TOKS, stop=["\n"]))]
    assert all(math.isclose(g, w, rel_tol=1e-5, abs_tol=1e-4) for g, w in zip(got_scores, want_scores, strict=True)), (
        got_scores, want_scores)
    # The reported accuracy is the share of documents whose answer scored highest, from the same numbers.
    best = [max(range(len(d["choices"])), key=lambda i, k=k: want_scores[k + i])
            for d, k in zip(CHOICE, [0, 3, 5], strict=True)]
    want_acc = sum(b == d["answer"] for b, d in zip(best, CHOICE, strict=True)) / len(CHOICE)
    assert results["results"]["fd_choice"]["acc,none"] == pytest.approx(want_acc)
    generated = [s["resps"][0][0] for s in sorted(results["samples"]["fd_generate"], key=lambda s: s["doc_id"])]
    assert generated == texts and all(texts)


def test_local_chat_completions_generates_as_the_python_api_with_the_chat_template(
    served: Served, checkpoint: Path, tasks: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    results = _evaluate("local-chat-completions", f"{served.url}/v1/chat/completions", tasks, ["fd_generate"],
                        monkeypatch)
    with LLM(str(checkpoint), tp=1, graph="off") as llm:
        texts = [c.text for c in llm.generate([d["question"] for d in GENERATE],
                                              SamplingParams(max_new_tokens=MAX_GEN_TOKS, stop=["\n"]), chat=True)]
    generated = [s["resps"][0][0] for s in sorted(results["samples"]["fd_generate"], key=lambda s: s["doc_id"])]
    assert generated == texts and all(texts)
