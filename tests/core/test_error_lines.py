"""An exception as one line: the informative line of Paddle's multi-line messages (a static-graph failure opens with
"In transformed code:"), and the likely cause of a dtype failure (a kernel's dtype, a claimed dtype) attached."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from fd_core.error_lines import add_hint, error_line, informative_line
from fd_core.errors import setting

# Paddle 3.3.1's message for a kernel failing inside paddle.jit.to_static (fd's cpu graph backend), as captured.
DY2STATIC = """In transformed code:

    File "/work/main/fd_models/layers/norm.py", line 27, in forward
\treturn self.rms_norm(x, self.weight, self.eps)
    File "/tmp/wd/site/wrongdtype.py", line 15, in rms
            return paddle.matmul(out, paddle.ones([3, 3]))
            ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~ <--- HERE

    File "/venv/lib/python3.11/site-packages/paddle/base/dygraph/generated_tensor_methods_patch.py", line 19, in _matmul
\treturn _C_ops.matmul(*args, **kwargs)

    ValueError: (InvalidArgument) In operator matmul, the [2] dimension of Input(X) must be equal to the [0] dimension \
of Input(Y).
  [Hint: Expected K_lhs == K_rhs, but received K_lhs:64 != K_rhs:3.] (at /paddle/paddle/phi/infermeta/binary.cc:3087)

"""
# Paddle's C++ report (FLAGS_call_stack_level=2): the summary's line is the error.
CPP = """

--------------------------------------
C++ Traceback (most recent call last):
--------------------------------------
0   paddle::pybind::eager_api_matmul(_object*, _object*, _object*)
1   phi::MatmulKernel<float, phi::CPUContext>(...)

----------------------
Error Message Summary:
----------------------
InvalidArgumentError: The shape of input x is wrong.
  [Hint: Expected x == y.] (at /paddle/paddle/phi/kernels/impl/matmul_kernel_impl.h:100)
"""


def test_a_static_graph_failure_keeps_the_error_not_its_first_line() -> None:
    assert error_line(ValueError(DY2STATIC)) == (
        "ValueError: (InvalidArgument) In operator matmul, the [2] dimension of Input(X) must be equal to the [0] "
        "dimension of Input(Y)."
    )
    assert error_line(RuntimeError(CPP)) == "InvalidArgumentError: The shape of input x is wrong."
    # A report without an exception line: its last line that is not furniture (positions, markers, hints).
    assert informative_line('In transformed code:\n    File "x.py", line 1, in f\n    the compiler gave up\n') == (
        "the compiler gave up")


def test_a_real_paddle_static_graph_failure_is_one_informative_line() -> None:
    paddle = pytest.importorskip("paddle")

    def fails(x: Any) -> Any:
        raise ValueError("the kernel cannot run here")

    with pytest.raises(Exception) as caught:
        paddle.jit.to_static(fails, full_graph=True)(paddle.ones([2, 3]))
    assert str(caught.value).strip().splitlines()[0] == "In transformed code:"  # Paddle's own first line
    assert error_line(caught.value) == "ValueError: the kernel cannot run here"


def test_other_messages_keep_their_first_line_and_a_hint_follows() -> None:
    assert error_line(RuntimeError("(NotFound) no kernel.\n  [Hint: Expected x.] (at y.cc:1)")) == (
        "RuntimeError: (NotFound) no kernel.")
    assert error_line(RuntimeError("ValueError: told as text")) == "RuntimeError: ValueError: told as text"
    assert error_line(KeyError("k")) == "KeyError: 'k'" and error_line(RuntimeError()) == "RuntimeError"
    failed = ValueError(DY2STATIC)
    add_hint(failed, "run fd check cpu")
    assert error_line(failed).endswith("Input(Y).; run fd check cpu")


def test_a_dtype_failure_names_the_kernels_and_the_fix() -> None:
    """Real Paddle errors of both kinds, read against the cpu platform's Backend: a tensor of another dtype (a kernel
    that returned it), and a dtype Paddle has no kernel for that the platform claims."""
    paddle = pytest.importorskip("paddle")
    from fd_core.config import ParallelConfig
    from fd_core.host.backend import load_backend
    from fd_core.host.failure_hints import dtype_hint
    from fd_core.host.loading import load_plugins

    plugins = load_plugins({"FD_PLATFORM": "cpu"})
    record = plugins.record("cpu")
    assert record.detection is not None
    # The mutant of failure-modes round 4: the cpu platform claiming bfloat16, which Paddle's CPU matmul cannot run.
    record.detection = dataclasses.replace(record.detection, dtypes=("bfloat16", "float32"))
    backend = load_backend(ParallelConfig(), plugins=plugins)
    with pytest.raises(Exception) as mixed:
        paddle.matmul(paddle.ones([2, 4]), paddle.ones([4, 3], dtype="float64"))
    hint = dtype_hint(mixed.value, backend, "float32")
    assert hint is not None and hint.startswith("a float64 tensor reached a Paddle op in a float32 run: likely a kernel "
                                                "returning another dtype than it was given (kernels of plugins in use: ")
    assert "from 'cpu')" in hint and hint.endswith("; run fd check cpu")
    with pytest.raises(Exception) as missing:
        paddle.matmul(paddle.ones([2, 4], dtype="bfloat16"), paddle.ones([4, 3], dtype="bfloat16"))
    assert dtype_hint(missing.value, backend, "bfloat16") == (
        f"Paddle has no bfloat16 matmul here, yet platform 'cpu' claims bfloat16 (Detection.dtypes=('bfloat16', "
        f"'float32')); pass {setting('dtype', 'float32')}, or run fd check cpu and drop from its Detection.dtypes "
        f"what it cannot run")
    assert dtype_hint(RuntimeError("(InvalidArgument) shapes differ"), backend, "float32") is None
