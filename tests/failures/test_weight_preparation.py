"""Weight preparation and quantization gone wrong: a preparation function that cannot serve its op is refused when the
plugin loads, one that returns the wrong values stops the run in one line naming the plugin, and an unknown
quantization is refused before anything starts."""

from __future__ import annotations

from conftest import assert_one_line_error, run_fd

MISNAMED = """
from fd_core import hookimpl


@hookimpl
def fd_register_kernels(register):
    register("matmul", lambda x, weight, transpose_weight: x, prepare=lambda w, t: w)
"""

SHORT = """
from fd_core import hookimpl, native_ops


@hookimpl
def fd_register_kernels(register):
    register("quant_matmul", native_ops.quant_matmul, prepare=lambda weight, scales, bits: weight)
"""


def test_a_prepare_function_that_does_not_take_the_ops_arguments_is_refused_at_load(distribution) -> None:
    site = distribution("bad-prepare", {"bad_prepare": MISNAMED}, {"fd.plugins": {"bad-prepare": "bad_prepare"}})
    done = run_fd(["run", "--steps", "1"], path=site, traced=True)
    assert_one_line_error(
        done,
        "plugin 'bad-prepare': its prepare function for 'matmul' takes (w, t), but it is called as "
        "prepare(weight, transpose_weight) (the op's arguments after x); give it exactly those arguments",
    )
    assert done.paddle_imported is False


def test_a_prepare_function_returning_too_few_values_stops_the_run_naming_the_plugin(distribution) -> None:
    site = distribution("short-prepare", {"short_prepare": SHORT}, {"fd.plugins": {"short-prepare": "short_prepare"}})
    done = run_fd(["run", "--tp", "1", "--steps", "1", "--quantization", "wint8"], path=site)
    assert_one_line_error(
        done,
        "plugin 'short-prepare': its prepare function for 'quant_matmul' returned 1 value(s) for weight, scales; "
        "return a tuple of one value for each, in that order",
        exact=False,
    )


def test_an_unknown_quantization_is_refused_before_anything_starts() -> None:
    done = run_fd(["run", "--quantization", "int4"], traced=True)
    assert done.returncode == 2 and "argument --quantization: invalid choice: 'int4' (choose from" in done.stderr
    assert done.paddle_imported is False


RAISING = """
from fd_core import hookimpl, native_ops


def pack(weight, transpose_weight):
    raise ValueError("tile size 128 does not divide 27")


@hookimpl
def fd_register_kernels(register):
    register("matmul", native_ops.matmul, prepare=pack)
"""

UNQUANTIZABLE = """
from fd_core import Architecture, hookimpl
from fd_models.ernie4_5.plugin import ARCHITECTURE
from dataclasses import replace


@hookimpl
def fd_register_models(register):
    register(replace(ARCHITECTURE, name="plain_ernie", aliases=(), quantizable=False))


@hookimpl
def fd_clear_graphs(model):
    return None
"""


def test_a_prepare_function_that_raises_is_named(distribution) -> None:
    site = distribution("raising-prepare", {"raising_prepare": RAISING},
                        {"fd.plugins": {"raising-prepare": "raising_prepare"}})
    done = run_fd(["run", "--tp", "1", "--steps", "1"], path=site)
    assert_one_line_error(
        done,
        "plugin 'raising-prepare': its prepare function for 'matmul' raised ValueError: tile size 128 does not divide "
        "27; fix the plugin, or uninstall it",
    )


def test_quantization_is_refused_for_an_architecture_that_does_not_quantize(distribution) -> None:
    site = distribution("plain-ernie", {"plain_ernie": UNQUANTIZABLE}, {"fd.models": {"plain-ernie": "plain_ernie"}})
    done = run_fd(["run", "--model", "plain_ernie", "--quantization", "wint8", "--steps", "1"], path=site,
                  traced=True)
    assert_one_line_error(
        done,
        "plain_ernie (from plugin 'plain-ernie') does not quantize its weights (its Architecture is not "
        "quantizable=True); run it without --quantization",
    )
    assert done.paddle_imported is False
