"""Settings: read from BATCHSERVE_* variables; bad values name the variable and the range."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from service.config import Settings, SettingsError, load_settings
from service.server.cli import main
from service.server.supervisor import POLL_INTERVAL_S


def test_environment_variables_configure_the_service(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BATCHSERVE_MAX_BATCH_SIZE", "32")
    monkeypatch.setenv("BATCHSERVE_MAX_WAIT_MS", "2.5")
    monkeypatch.setenv("BATCHSERVE_DEVICE", "cuda:1")
    monkeypatch.setenv("BATCHSERVE_WARMUP_BATCH_SIZES", "[1, 8]")
    settings = load_settings()
    assert settings.max_batch_size == 32
    assert settings.max_wait_ms == 2.5
    assert settings.device == "cuda:1"
    assert settings.warmup_batch_sizes == (1, 8)


@pytest.mark.parametrize(
    ("value", "edges"), [("512", (512,)), ("8,64,512", (8, 64, 512)), ("[16, 256]", (16, 256))]
)
def test_length_buckets_read_one_edge_a_list_or_json(
    monkeypatch: pytest.MonkeyPatch, value: str, edges: tuple[int, ...]
) -> None:
    monkeypatch.setenv("BATCHSERVE_LENGTH_BUCKETS", value)
    assert load_settings().length_buckets == edges


def test_overrides_win_over_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BATCHSERVE_PORT", "9000")
    assert load_settings(port="9100").port == 9100


def test_defaults_serve_the_embedded_digits_model() -> None:
    settings = load_settings()
    assert settings.model_name == "digits"
    assert settings.model_version == "latest"
    assert (settings.model_repository / "digits").is_dir()


@pytest.mark.parametrize(
    ("variable", "value", "fragment"),
    [
        ("BATCHSERVE_MAX_BATCH_SIZE", "0", "greater than or equal to 1"),
        ("BATCHSERVE_MAX_BATCH_SIZE", "5000", "less than or equal to 4096"),
        ("BATCHSERVE_MAX_WAIT_MS", "-1", "greater than or equal to 0"),
        ("BATCHSERVE_PORT", "70000", "less than or equal to 65535"),
        (
            "BATCHSERVE_DEVICE",
            "gpu",
            "must be auto, cpu, cuda, cuda:N or a list of cpu and cuda:N, got 'gpu'",
        ),
        ("BATCHSERVE_PRECISION", "fp8", "'fp32', 'fp16' or 'bf16'"),
        ("BATCHSERVE_COMPILE_MODE", "fast", "'off', 'default'"),
        ("BATCHSERVE_MODEL_VERSION", "../etc", "should match pattern"),
        ("BATCHSERVE_MODEL_NAME", "../digits", "should match pattern"),
        ("BATCHSERVE_WARMUP_BATCH_SIZES", "[0]", "at least 1"),
    ],
)
def test_invalid_values_fail_with_the_variable_value_and_range(
    monkeypatch: pytest.MonkeyPatch, variable: str, value: str, fragment: str
) -> None:
    monkeypatch.setenv(variable, value)
    with pytest.raises(SettingsError) as raised:
        load_settings()
    message = str(raised.value)
    assert variable in message
    assert fragment in message


def test_warmup_sizes_above_max_batch_size_are_refused() -> None:
    with pytest.raises(SettingsError, match="must not exceed max_batch_size 4"):
        load_settings(max_batch_size=4, warmup_batch_sizes="1,8")


def test_a_heartbeat_interval_above_a_quarter_of_the_timeout_is_refused() -> None:
    with pytest.raises(SettingsError, match=r"engine_heartbeat_interval_s 0\.5 must be at most"):
        load_settings(engine_heartbeat_timeout_s=1.5, engine_heartbeat_interval_s=0.5)


def test_the_default_heartbeat_declares_a_stopped_engine_hung_within_2_s() -> None:
    """The supervisor looks every POLL_INTERVAL_S: a stopped engine is declared hung at most
    that long after the timeout, counted from its last heartbeat."""
    settings = load_settings()
    assert settings.engine_heartbeat_timeout_s + POLL_INTERVAL_S <= 2.0
    assert settings.engine_heartbeat_interval_s * 4 <= settings.engine_heartbeat_timeout_s


def test_serve_with_a_bad_flag_prints_the_problem_and_exits_2(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["serve", "--max-batch-size", "0"]) == 2
    error = capsys.readouterr().err
    assert "BATCHSERVE_MAX_BATCH_SIZE = '0'" in error
    assert "greater than or equal to 1" in error


def test_a_queue_too_small_for_the_largest_request_is_refused_at_start() -> None:
    """129 instances in chunks of 16 are 9 queue entries: with a queue of 8 such a valid
    request would be answered 429 forever."""
    with pytest.raises(ValidationError, match="max_queue_size 8 cannot hold a request"):
        Settings(max_queue_size=8, max_batch_size=16, max_instances_per_request=129)
    Settings(max_queue_size=9, max_batch_size=16, max_instances_per_request=129)
