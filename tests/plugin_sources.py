"""Sources of deliberately broken plugins, shared by the in-process tests and the CLI failure tests."""

MISSPELLED_HOOK = """
from fd_core import hookimpl

@hookimpl
def fd_clear_grpah_opt_backend(model):
    return True
"""

UNKNOWN_ARGUMENT = """
from fd_core import hookimpl

@hookimpl
def fd_graph_eligibility(model_config, paralel_config):
    return None
"""

NOT_A_GENERATOR = """
from fd_core import hookimpl

@hookimpl(wrapper=True)
def fd_all_reduce(tensor, group):
    return tensor
"""

NO_CLEAR_HOOK = """
from fd_core import Architecture, hookimpl

@hookimpl
def fd_register_models(register):
    register(Architecture(name="mini_vl", build=lambda config, backend: None, preset={}, graph_capable=True))
"""

# A request gate (fd_check_request) as a vendor would write one; FDTEST_GATE_LOG names a file each call appends to.
REQUEST_GATE = """
import json
import os
import sys

from fd_core import hookimpl

@hookimpl
def fd_check_request(request, model_config, parallel_config, stream):
    log = os.environ.get("FDTEST_GATE_LOG")
    if log:
        with open(log, "a") as f:
            f.write(json.dumps({
                "pid": os.getpid(), "paddle_imported": "paddle" in sys.modules, "prompts": len(request.prompts),
                "images": len(request.images), "temperature": request.sampling.temperature,
                "max_new_tokens": request.sampling.max_new_tokens, "architecture": model_config.architecture,
                "tp": parallel_config.tp_size, "stream": stream,
            }) + "\\n")
    if request.sampling.temperature > 0:
        return "cannot sample with a temperature here; use greedy decoding"
    if stream:
        return "no streaming on this device"
    if request.sampling.max_new_tokens > 64:
        return f"at most 64 new tokens, {request.sampling.max_new_tokens} asked for"
    return None
"""

# A gate that takes fewer arguments than the spec (pluggy passes what it names) and answers what it is told to.
ANSWERING_GATE = """
import os

from fd_core import hookimpl

ANSWER = None

@hookimpl
def fd_check_request(request):
    if ANSWER == "raise":
        raise RuntimeError("the gate broke")
    return ANSWER
"""

# A platform whose one device (per rank) is as small as FDTEST_TINY_FREE bytes: the memory plan's refusals and its cache
# sizing.
TINY_DEVICE = """
import os

from fd_core import Detection, DeviceMemory, hookimpl

@hookimpl
def fd_platform_detect():
    free = int(os.environ.get("FDTEST_TINY_FREE", str(2**30)))
    return Detection(detected=True, priority=-1, reason="an emulated device of few bytes", device="cpu", dist_backend="gloo",
                     max_ranks=2, device_memory=(DeviceMemory(total=free, free=free),) * 2)

@hookimpl
def fd_all_reduce(tensor, group):
    import paddle.distributed as dist

    dist.all_reduce(tensor, group=group)
    return tensor
"""
