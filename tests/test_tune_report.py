"""``tuning.report``: the env file ``serve --env-file`` serves as it is, and a report that
says why the written settings were written."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from service.config import BUNDLED_MODEL_REPOSITORY
from service.server.tuning.comparison import compare
from service.server.tuning.report import TuneReport, env_variables, markdown
from service.server.tuning.search import ModelLimit, Result
from service.server.tuning.space import Candidate, defaults_candidate
from service.server.tuning.trials import reserve_port

PICK = Candidate(max_batch_size=16)


def report(repository: Path = BUNDLED_MODEL_REPOSITORY, version: str = "latest") -> TuneReport:
    made = TuneReport(
        model="digits",
        version="dae3cd981a36",
        version_asked=version,
        repository=repository.resolve(),
        requests="256 tensor instances",
        rows_per_request=1.0,
        cores=2,
        concurrency=64,
        p99_target_ms=40.0,
        budget_s=300.0,
        limit=ModelLimit(rows_per_s={None: {1: 1000.0}}),
        model_limit_rps=1000.0,
        ceiling_rps={1: 3000.0},
        window_s=2.0,
    )
    made.winner = made.pick = Result(PICK, 680.0, 10.0, 30.0)
    return made


def test_the_env_file_names_the_repository_unless_it_is_the_bundled_one(tmp_path: Path) -> None:
    """Issue 35, item 5: without the repository, ``serve --env-file`` failed to start
    unless the same variable was set."""
    assert "BATCHSERVE_MODEL_REPOSITORY" not in env_variables(report())
    own = env_variables(report(tmp_path))
    assert own["BATCHSERVE_MODEL_REPOSITORY"] == str(tmp_path.resolve())
    assert own["BATCHSERVE_MODEL_NAME"] == "digits"
    assert own["BATCHSERVE_MAX_BATCH_SIZE"] == "16"


@pytest.mark.parametrize(("asked", "written"), [("latest", None), ("dae3cd981a36", "dae3cd981a36")])
def test_the_env_file_pins_a_version_only_when_one_was_asked_for(
    asked: str, written: str | None
) -> None:
    assert env_variables(report(version=asked)).get("BATCHSERVE_MODEL_VERSION") == written


def test_the_report_says_why_the_defaults_were_kept_and_why_figures_differ() -> None:
    """Issue 37, item 1: 680 requests/s in the search and 272-536 re-measured, unexplained."""
    made = report()
    tuned = [Result(PICK, rps, 10.0, 30.0) for rps in (272.0, 536.0, 400.0)]
    defaults = [Result(defaults_candidate(), rps, 10.0, 30.0) for rps in (300.0, 520.0, 410.0)]
    made.remeasured = {"tuned": tuned, "defaults": defaults}
    made.comparison = compare(tuned, defaults, 40.0)
    made.winner = made.final = Result(defaults_candidate(), 410.0, 10.0, 30.0)
    page = markdown(made, None)
    assert (
        "The defaults are within the noise of the search's pick, `batch=16`: the pick's median "
        "requests/s is 2% worse than the defaults'. The defaults are kept."
    ) in page
    assert (
        "In the search the pick served 680 requests/s; re-measured, 272 to 536 (median 400), "
        "41% less: one window is a noisy sample on this host"
    ) in page
    assert "measured the pick and the defaults in turn, 3 windows each" in page


def test_a_reserved_port_is_taken_by_a_server_binding_with_reuse_address_only() -> None:
    """tune chooses its servers' ports by a bind to port 0 and holds them: no other program
    binds one meanwhile, but the server it is for (uvicorn, gunicorn: ``SO_REUSEADDR``) can."""
    reservation = reserve_port()
    port = reservation.getsockname()[1]
    with reservation, socket.socket() as other, socket.socket() as server:
        with pytest.raises(OSError, match="Address already in use"):
            other.bind(("127.0.0.1", port))
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(("127.0.0.1", port))
        server.listen()
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            accepted, _ = server.accept()
            accepted.close()
