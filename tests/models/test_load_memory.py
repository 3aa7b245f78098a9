"""What loading stages beside the parameters, measured as this process's resident set (Linux /proc): the peak
RSS target of issue 21 (weights + KV cache within 1.2x) is lost by whole-tensor temporaries here."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from paddle import nn

from fd_core import WeightSpec, hookimpl
from fd_core.errors import PluginError
from fd_core.runtime import weights
from fd_core.runtime.engine import runner as lifecycle
from fd_models.layers import params

MiB = 1 << 20


def _status(field: str) -> int:
    """A /proc/self/status size in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no {field} in /proc/self/status")


def _reset_peak() -> None:
    """Start VmHWM again from the current RSS (clear_refs 5), or skip where the kernel does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError as exc:
        pytest.skip(f"the peak RSS cannot be reset here ({exc})")


def _peak_above(run, field: str = "VmRSS") -> tuple[int, int]:
    """(how far VmHWM rose above the RSS before `run()`, how far `field` rose) in bytes."""
    _reset_peak()
    before, before_field = _status("VmRSS"), _status(field)
    run()
    return _status("VmHWM") - before, _status(field) - before_field


class _Big(nn.Layer):
    """One [rows, cols] matrix, and `layers` layers of a [layer_rows, cols] matrix and a [cols] vector (stored between
    the matrices, as a checkpoint stores a model's norms)."""

    def __init__(self, rows: int, cols: int, layers: int = 0, layer_rows: int = 0) -> None:
        super().__init__()
        self.matrix = nn.Layer()
        params.new_param(self.matrix, WeightSpec((rows, cols), 0, "float32"), 1)
        self.layers = nn.LayerList([nn.Layer() for _ in range(layers)])
        for layer in self.layers:
            layer.proj, layer.norm = nn.Layer(), nn.Layer()
            params.new_param(layer.proj, WeightSpec((layer_rows, cols), 0, "float32"), 1)
            params.new_param(layer.norm, WeightSpec((cols,), None, "float32"), 1)


def test_sampling_the_parameters_stages_no_whole_parameter() -> None:
    """The cleanup guard's sample of a 64 MiB parameter holds a few values, not a copy of it (a converted strided
    slice copied the whole embedding: 404 MiB at ERNIE-4.5-0.3B), and is the evenly spaced values it says."""
    layer = _Big(8192, 2048)
    values = np.random.default_rng(0).standard_normal((8192, 2048), dtype=np.float32)
    layer.matrix.weight.set_value(values)
    out: dict = {}
    rose, _ = _peak_above(lambda: out.update(lifecycle._sample(layer)))
    assert rose < 16 * MiB, f"sampling rose the peak RSS by {rose / MiB:.0f} MiB"
    np.testing.assert_array_equal(out["matrix.weight"], values.reshape(-1)[:: values.size // 64])


def test_a_cleanup_hook_that_changes_a_parameter_stops_the_load() -> None:
    """The sample sees a hook that rounds the live weights to bfloat16 in place (what the guard exists for)."""
    import paddle

    from fd_core.host.backend import load_backend
    from fd_core.host.loading import load_plugins
    from fd_core.runtime.plan import model_config_for

    class Rounds:
        @hookimpl
        def fd_clean_memory_fragments(self, state_dict):
            for param in self.model.parameters():
                paddle.assign(param.astype("bfloat16").astype("float32"), output=param)

    plugins = load_plugins({})
    rounds = Rounds()
    plugins.pm.register(rounds, name="rounds-live")
    spec = plugins.registry.get("ernie4_5")
    runner = lifecycle.ModelRunner(load_backend(plugins=plugins), spec, model_config_for(spec, None))
    runner.model = rounds.model = spec.build_model(runner.config, runner.backend)
    # Named for the plugin whose hook did it, not for the platform whose hook ran beside it.
    with pytest.raises(PluginError, match=r"^plugin 'rounds-live': fd_clean_memory_fragments changed the loaded parameter '"):
        runner.load()


def test_loading_a_checkpoint_stages_little_beside_the_parameters(tmp_path: Path) -> None:
    """A 128 MiB matrix stored as bfloat16 and 16 layers' matrices and vectors load into their parameters within a
    few pieces' worth of RSS, and the vectors' reads leave no file pages of the checkpoint resident (a mapped read did).

    A piece is staged about four times over (its read bytes, float32 array, paddle copy and the slice
    assignment's copy: some 35 MiB at 8 MiB pieces); the whole matrix staged, or 32 MiB pieces, rise above 64 MiB.
    """
    import paddle

    rows, cols, layers, layer_rows = 16384, 2048, 16, 512
    layer = _Big(rows, cols, layers, layer_rows)
    rng = np.random.default_rng(1)
    state = {name: rng.standard_normal(spec.shape, dtype=np.float32)
             for name, spec in params.weight_specs(layer).items()}
    weights.save_checkpoint(tmp_path / "ckpt", {}, state, "bfloat16")
    shards = weights.load_checkpoint(tmp_path / "ckpt", params.weight_specs(layer))
    rose, file_pages = _peak_above(lambda: params.load_weights(layer, shards), "RssFile")
    shards.close()
    # Parameters get their storage as they load (none from build), so the rise holds them too.
    held = sum(int(np.prod(p.shape)) * 4 for p in layer.parameters())
    rose -= held
    assert rose < 64 * MiB, f"loading rose the peak RSS by {rose / MiB:.0f} MiB beside a {rows * cols * 4 / MiB:.0f} MiB parameter"
    assert file_pages < 4 * MiB, f"{file_pages / MiB:.0f} MiB of the checkpoint stayed mapped"
    # What was loaded is the bfloat16 the file holds, widened as paddle widens it.
    for name, param in layer.named_parameters():
        want = paddle.to_tensor(state[name]).astype("bfloat16").astype("float32").numpy()
        np.testing.assert_array_equal(param.numpy(), want, err_msg=name)
