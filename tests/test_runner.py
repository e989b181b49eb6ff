from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
import numpy.typing as npt
import pytest
import torch
from torch._dynamo.utils import counters

from service.config import CompileMode, Precision
from service.engine.outputs import OutputMismatchError
from service.engine.runner import TorchRunner, batch_sizes_to_warm, resolve_device
from service.errors import InferenceError, ModelLoadError
from service.manifest import TensorSpec
from service.tensors import NamedArrays
from tests.torch_models import (
    FEATURES,
    AffineModel,
    DoubledRowsModel,
    ThreadRecorder,
    TupleModel,
)

CPU = torch.device("cpu")
X = TensorSpec(name="x", dtype="float32", shape=(-1, FEATURES))
Y = TensorSpec(name="y", dtype="float32", shape=(-1, FEATURES))

MakeRunner = Callable[..., TorchRunner]


def rows(count: int, start: int = 0) -> npt.NDArray[np.float32]:
    """``count`` rows of distinct quarters: 2x + 1 is exact in fp32 for them."""
    values = np.arange(start, start + count * FEATURES, dtype=np.float32) / 4 - 8
    return values.reshape(count, FEATURES)


def named(array: npt.NDArray[np.float32]) -> NamedArrays:
    """``array`` as the runner's one input, ``x``."""
    return NamedArrays({"x": array})


def answered(output: NamedArrays | InferenceError) -> NamedArrays:
    """``output``, which must be rows, not an error."""
    assert isinstance(output, NamedArrays), output
    return output


@pytest.fixture
def make_runner() -> Iterator[MakeRunner]:
    runners: list[TorchRunner] = []

    def make(
        model: torch.nn.Module,
        *,
        precision: Precision = "fp32",
        compile_mode: CompileMode = "off",
        max_batch_size: int = 64,
        outputs: tuple[TensorSpec, ...] = (Y,),
    ) -> TorchRunner:
        runner = TorchRunner(
            model,
            inputs=(X,),
            outputs=outputs,
            device=CPU,
            precision=precision,
            compile_mode=compile_mode,
            max_batch_size=max_batch_size,
        )
        runners.append(runner)
        return runner

    yield make
    for runner in runners:
        runner.close()


def test_run_batch_splits_exact_outputs_back_per_payload_in_order(
    make_runner: MakeRunner,
) -> None:
    runner = make_runner(AffineModel())
    payloads = [rows(3, 0), rows(1, 100), rows(5, 200), rows(2, 300)]

    outputs = runner.run_batch([named(payload) for payload in payloads])

    assert len(outputs) == len(payloads)
    for payload, output in zip(payloads, outputs, strict=True):
        assert answered(output).names == ("y",)
        assert answered(output)["y"].dtype == np.float32
        np.testing.assert_array_equal(answered(output)["y"], 2 * payload + 1)


def test_run_batch_with_one_payload(make_runner: MakeRunner) -> None:
    runner = make_runner(AffineModel())
    payload = rows(7)

    [output] = runner.run_batch([named(payload)])

    np.testing.assert_array_equal(answered(output)["y"], 2 * payload + 1)


def test_bf16_autocast_on_cpu_is_close_to_fp32(make_runner: MakeRunner) -> None:
    payload = np.random.default_rng(0).uniform(-4, 4, size=(64, FEATURES)).astype(np.float32)
    expected = 2 * payload + 1

    [answer] = make_runner(AffineModel(), precision="bf16").run_batch([named(payload)])
    output = answered(answer)["y"]

    assert output.dtype == np.float32
    # bf16 keeps 8 significant bits: each rounding is off by at most 2**-9 relative. Autocast
    # rounds the input (2|x| * 2**-9 after doubling) and the output (|2x + 1| * 2**-9); the
    # weights 2 and 1 are exact. So |error| <= 2**-8 * (2|x| + 1); allow twice that.
    bound = 2**-7 * (2 * np.abs(payload) + 1)
    assert np.all(np.abs(output - expected) <= bound)
    # The forward really ran in bf16: every output is a bf16 value, and some differ from fp32.
    as_bf16 = torch.from_numpy(output).to(torch.bfloat16).to(torch.float32).numpy()
    np.testing.assert_array_equal(output, as_bf16)
    assert not np.array_equal(output, expected)


def test_fp16_on_cpu_is_refused(make_runner: MakeRunner) -> None:
    with pytest.raises(ModelLoadError, match="CUDA"):
        make_runner(AffineModel(), precision="fp16")


def test_cuda_without_cuda_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)

    for requested in ("cuda", "cuda:0", "cuda:1"):
        with pytest.raises(ModelLoadError, match="CUDA is not available"):
            resolve_device(requested)


def test_a_cuda_index_past_the_visible_devices_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)

    with pytest.raises(ModelLoadError, match="1 CUDA device"):
        resolve_device("cuda:1")


def test_auto_and_cpu_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_device("cpu") == CPU

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == CPU


def test_eager_mode_does_not_pad(make_runner: MakeRunner) -> None:
    runner = make_runner(AffineModel(), max_batch_size=48)

    assert not runner.compiled
    assert [runner.padded_rows(n) for n in (1, 3, 5, 47, 48, 100)] == [1, 3, 5, 47, 48, 100]


def test_batch_sizes_to_warm() -> None:
    assert batch_sizes_to_warm(48) == [1, 2, 4, 8, 16, 32, 48]
    assert batch_sizes_to_warm(64) == [1, 2, 4, 8, 16, 32, 64]
    assert batch_sizes_to_warm(1) == [1]
    assert batch_sizes_to_warm(3) == [1, 2, 3]


@pytest.fixture
def fresh_dynamo() -> Iterator[None]:
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


@pytest.mark.slow
@pytest.mark.usefixtures("fresh_dynamo")
# Importing inductor imports torch.utils.mkldnn, which decorates with torch.jit.script_method.
@pytest.mark.filterwarnings(r"ignore:`torch\.jit\.script_method` is deprecated:DeprecationWarning")
def test_compiled_runner_warms_each_padded_size_and_pads_odd_batches(
    make_runner: MakeRunner,
) -> None:
    eager = make_runner(AffineModel(), max_batch_size=4)
    runner = make_runner(AffineModel(), compile_mode="default", max_batch_size=4)

    for size in runner.padded_batch_sizes:  # as lifecycle's warm-up runs them
        runner.warm_up_batch(named(np.zeros((size, FEATURES), dtype=np.float32)))
    graphs_after_warm_up = counters["stats"]["unique_graphs"]
    payloads = [rows(1, 0), rows(2, 50)]
    outputs = runner.run_batch([named(payload) for payload in payloads])

    assert runner.compiled
    assert [runner.padded_rows(n) for n in (1, 2, 3, 4)] == [1, 2, 4, 4]
    # One static graph per warmed size (1, 2, 4); 3 rows reuse the size-4 graph.
    assert graphs_after_warm_up == 3
    assert counters["stats"]["unique_graphs"] == 3
    assert [len(answered(output)) for output in outputs] == [1, 2]
    eager_outputs = eager.run_batch([named(payload) for payload in payloads])
    for payload, output, eager_output in zip(payloads, outputs, eager_outputs, strict=True):
        np.testing.assert_array_equal(answered(output)["y"], 2 * payload + 1)
        np.testing.assert_allclose(
            answered(output)["y"], answered(eager_output)["y"], rtol=0, atol=1e-6
        )


def test_the_forward_runs_in_the_device_thread_under_inference_mode_and_autocast(
    make_runner: MakeRunner,
) -> None:
    model = ThreadRecorder()
    runner = make_runner(model, precision="bf16")

    [output] = runner.executor.submit(runner.run_batch, [named(rows(2))]).result()

    assert answered(output)["y"].shape == (2, FEATURES)
    assert len(model.thread_names) == 1
    assert model.thread_names[0].startswith("batchserve-device")
    assert model.autocast_dtypes == [torch.bfloat16]
    assert model.inference_mode == [True]
    # Autocast is thread-local and was entered in the device thread: none leaks out here.
    assert not torch.is_autocast_enabled("cpu")


def test_a_tuple_with_the_wrong_count_of_outputs_is_refused(make_runner: MakeRunner) -> None:
    runner = make_runner(TupleModel())  # two tensors, one declared output

    with pytest.raises(
        OutputMismatchError, match=r"returned 2 outputs; the manifest declares 1 \['y'\]"
    ):
        runner.run_batch([named(rows(2))])
    with pytest.raises(ModelLoadError, match=r"returned 2 outputs; the manifest declares 1"):
        runner.check_outputs(named(rows(2)))


def test_a_tuple_is_answered_per_declared_output_in_order(make_runner: MakeRunner) -> None:
    doubled = TensorSpec(name="doubled", dtype="float32", shape=(-1, FEATURES))
    runner = make_runner(TupleModel(), outputs=(Y, doubled))
    payloads = [rows(2), rows(3, 40)]

    runner.check_outputs(named(rows(2)))
    outputs = runner.run_batch([named(payload) for payload in payloads])

    for payload, output in zip(payloads, outputs, strict=True):
        assert answered(output).names == ("y", "doubled")
        np.testing.assert_array_equal(answered(output)["y"], payload)
        np.testing.assert_array_equal(answered(output)["doubled"], 2 * payload)


def test_a_model_returning_extra_rows_is_refused_not_truncated(
    make_runner: MakeRunner,
) -> None:
    runner = make_runner(DoubledRowsModel())

    with pytest.raises(ValueError, match="returned 6 rows of 'y' for a batch of 3"):
        runner.run_batch([named(rows(1)), named(rows(2))])


def test_an_exported_program_module_runs(make_runner: MakeRunner) -> None:
    example = torch.from_numpy(rows(2))
    batch = torch.export.Dim("batch", min=1)
    program = torch.export.export(AffineModel(), (example,), dynamic_shapes=({0: batch},))
    runner = make_runner(program.module())
    payloads = [rows(1), rows(4, 10)]

    outputs = runner.run_batch([named(payload) for payload in payloads])

    for payload, output in zip(payloads, outputs, strict=True):
        np.testing.assert_array_equal(answered(output)["y"], 2 * payload + 1)
