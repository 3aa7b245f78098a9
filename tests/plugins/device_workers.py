"""Run on real gloo ranks: the device plugins' all-reduce calls, as far as a CPU process group takes them."""

from __future__ import annotations

from typing import Any


def all_reduce_on_rank(platform_module: str) -> dict[str, Any]:
    """Call `platform_module.fd_all_reduce` on this rank's tensor; the sum or the error the process group gave."""
    import importlib

    import paddle

    from fd_core.runtime.ranks.spawn import init_rank

    rank, world = init_rank()
    module = importlib.import_module(platform_module)
    tensor = paddle.to_tensor([1.0, 2.0, 3.0]) * (rank + 1)
    try:
        out = module.fd_all_reduce(tensor, None)
    except Exception as exc:  # noqa: BLE001 - what the real process group said is the result
        return {"rank": rank, "error": f"{type(exc).__name__}: {exc}"}
    return {"rank": rank, "sum": out.numpy().tolist(), "same_object": out is tensor}
