"""The runtime behind `fd run` and the Python API: tokenizers, chat templates, sampling, batched generation
and the LLM session. The contract modules of fd_core never import it."""

from fd_core.runtime.engine.loop import Completion
from fd_core.runtime.engine.sampling import SamplingParams, TokenLogprob
from fd_core.runtime.engine.scheduler import Piece, Submission
from fd_core.runtime.handoff import Handoff
from fd_core.runtime.llm import LLM
from fd_core.runtime.text.tokenizer import Tokenizer, load_tokenizer

__all__ = ["LLM", "Completion", "Handoff", "Piece", "SamplingParams", "Submission", "TokenLogprob", "Tokenizer",
           "load_tokenizer"]
