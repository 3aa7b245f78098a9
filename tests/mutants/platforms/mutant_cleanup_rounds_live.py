"""Cleanup "compacts" every live parameter it can find to bfloat16 precision, in place (values change a little)."""

import gc

from mutant_control import FD_CAPABILITIES, fd_all_reduce, fd_graph_backend, fd_graph_eligibility, fd_platform_detect  # noqa: F401

from fd_core import hookimpl

EXPECT = "cleanup or native_path"


@hookimpl
def fd_clean_memory_fragments(state_dict):
    import paddle

    for obj in gc.get_objects():
        if (isinstance(obj, paddle.Tensor) and not obj.stop_gradient and obj.dtype == paddle.float32
                and obj._is_initialized()):
            paddle.assign(obj.astype("bfloat16").astype("float32"), output=obj)
    gc.collect()
