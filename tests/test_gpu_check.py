"""The GPU check script runs everywhere: on CUDA it checks the CUDA paths, here the CPU ones."""

from __future__ import annotations

import pytest
import torch

from loadtests.gpu_check import main

pytestmark = pytest.mark.slow


# Compiling imports inductor, which imports torch.utils.mkldnn, which decorates with
# torch.jit.script_method (deprecated in torch 2.13).
@pytest.mark.filterwarnings(r"ignore:`torch\.jit\.script_method` is deprecated:DeprecationWarning")
def test_gpu_check_runs_and_says_what_it_skipped(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--requests", "48"]) == 0
    output = capsys.readouterr().out
    if not torch.cuda.is_available():
        assert "CUDA not available" in output
        assert "skipped the CUDA configurations" in output
    assert "| digits | " in output
    assert "| textenc | " in output
    assert "| default | " in output, "the compiled configurations ran"
    assert "0 failed" in output
