"""`fd serve`: an OpenAI-compatible HTTP server over the Python API's LLM (one plan, one set of ranks, one engine).

The layer above the runtime, beside the CLI: it imports fd_core.runtime, never the other way. FastAPI and
uvicorn come with the `serve` extra and are imported only by `fd_core.serve.app` and the modules it is built
from, never by this package itself.
"""
