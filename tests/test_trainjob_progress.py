"""The TrainJob progress sink (job/observe/trainjob.py): its request body, and its requests to the controller's
status endpoint as tests/support/trainjob_status.py serves it (TLS with a CA made for the test, projected-token
checks, the CRD's validation), here on 127.0.0.1 with a free port. The in-cluster path (pod network namespaces,
the Service name, a rotating token) is in tests/test_k8s_trainjob_sim.py."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import trustme
from support import trainjob_status as tjs

from job.errors import ReportFailed
from job.observe.status import Status
from job.observe.trainjob import (
    CA_CERT_ENV,
    CHECKPOINT_AGE,
    CHECKPOINT_STEP,
    MIN_INTERVAL_S,
    TOKEN_ENV,
    URL_ENV,
    TrainJobProgress,
    metric_value,
    rfc3339,
    trainer_status,
)

NAMESPACE, NAME, POD = "team-a", "resnet", "resnet-node-0-0"
LOCAL = "127.0.0.1"


def _status(step: int = 40, **kw: object) -> Status:
    fields: dict = {
        "step": step,
        "total_steps": 100,
        "wall_time": 1_780_000_000.25,
        "step_time_s": 1.5,
        "metrics": {"train/loss": 0.41234567, "train/lr": 0.05},
        "last_checkpoint_step": 30,
        "checkpoint_age_s": 12.4,
    }
    fields.update(kw)
    return Status(**fields)


def test_trainer_status_body() -> None:
    """The body as the reference shows it: int percentage and ETA from the status, string metric values, the
    checkpoint fields as metrics, the time in RFC 3339 UTC."""
    s = _status()
    body = trainer_status(s)
    assert list(body) == ["trainerStatus"]
    ts = body["trainerStatus"]
    assert ts["progressPercentage"] == s.progress_percentage == 40
    assert ts["estimatedRemainingSeconds"] == s.estimated_remaining_s == 90
    assert ts["metrics"] == [
        {"name": "train/loss", "value": metric_value(0.41234567)},
        {"name": "train/lr", "value": "0.05"},
        {"name": CHECKPOINT_STEP, "value": "30"},
        {"name": CHECKPOINT_AGE, "value": "12"},
    ]
    assert metric_value(0.41234567) == "0.412346"
    assert ts["lastUpdatedTime"] == rfc3339(s.wall_time) == "2026-05-28T20:26:40Z"
    assert all(isinstance(m["value"], str) for m in ts["metrics"])


def test_trainer_status_unknowns_and_limits() -> None:
    """No step time yet: no ETA (the API's "empty if unknown"); no checkpoint yet: no checkpoint fields; a metric
    name over the CRD's 64 characters is left out; finished: 100 % and 0 s."""
    long_name = "x" * 65
    ts = trainer_status(
        _status(step=0, step_time_s=0.0, metrics={long_name: 1.0}, last_checkpoint_step=None, checkpoint_age_s=None)
    )["trainerStatus"]
    assert ts == {"progressPercentage": 0, "lastUpdatedTime": rfc3339(_status().wall_time)}
    done = trainer_status(_status(step=100, finished=True))["trainerStatus"]
    assert (done["progressPercentage"], done["estimatedRemainingSeconds"]) == (100, 0)


def test_the_body_is_what_the_controller_accepts() -> None:
    """The simulated controller's decoding and CRD validation take the body unchanged (time in whole seconds)."""
    body = json.dumps(trainer_status(_status(metrics={"val/top1": float("nan")}))).encode()
    ts = tjs.decode(body)
    assert ts is not None
    tjs.validate(ts, NAME)
    assert ts == trainer_status(_status(metrics={"val/top1": float("nan")}))["trainerStatus"]


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        (
            {"trainerStatus": {"progressPercentage": 150, "lastUpdatedTime": "2026-01-01T00:00:00Z"}},
            "less than or equal to 100",
        ),
        ({"trainerStatus": {"progressPercentage": 45.5, "lastUpdatedTime": "2026-01-01T00:00:00Z"}}, "Invalid payload"),
        (
            {"trainerStatus": {"metrics": [{"name": "loss", "value": 0.1}], "lastUpdatedTime": "2026-01-01T00:00:00Z"}},
            "Invalid payload",
        ),
        ({"trainerStatus": {"progressPercentage": 5}}, "lastUpdatedTime is required"),
        (
            {"trainerStatus": {"estimatedRemainingSeconds": -1, "lastUpdatedTime": "2026-01-01T00:00:00Z"}},
            "greater than or equal to 0",
        ),
    ],
)
def test_controller_model_refuses_what_the_crd_refuses(payload: dict, message: str) -> None:
    with pytest.raises(tjs.Invalid, match=message):
        ts = tjs.decode(json.dumps(payload).encode())
        assert ts is not None
        tjs.validate(ts, NAME)


def test_controller_model_ignores_unknown_fields() -> None:
    """Go's json.Decoder without DisallowUnknownFields: an unknown field is dropped, not refused."""
    ts = tjs.decode(
        b'{"trainerStatus": {"progressPercentage": 3, "step": 7, "lastUpdatedTime": "2026-01-01T00:00:00.5+01:00"}, "x": 1}'
    )
    assert ts == {"progressPercentage": 3, "lastUpdatedTime": "2025-12-31T23:00:00Z"}


@pytest.fixture
def server(tmp_path: Path) -> Iterator[tjs.StatusServer]:
    srv = tjs.StatusServer(tmp_path / "controller", NAMESPACE, NAME, LOCAL, 0, names=(LOCAL,))
    srv.up()
    yield srv
    srv.down()


def _token(server: tjs.StatusServer, path: Path, ttl_s: float = 3600.0) -> str:
    """A new token written as the kubelet does: a new file renamed over the old one."""
    token = server.issuer.issue(NAMESPACE, NAME, POD, ttl_s)
    tmp = path.with_name(path.name + ".new")
    tmp.write_text(token)
    os.replace(tmp, path)
    return token


@pytest.fixture
def sink(server: tjs.StatusServer, tmp_path: Path) -> TrainJobProgress:
    token = tmp_path / "token"
    _token(server, token)
    environ = {URL_ENV: server.url(LOCAL), CA_CERT_ENV: str(server.ca_file), TOKEN_ENV: str(token)}
    found = TrainJobProgress.from_environ(environ)
    assert found is not None
    return found


def test_from_environ_needs_all_three_variables(tmp_path: Path) -> None:
    full = {URL_ENV: "https://h:1/p", CA_CERT_ENV: str(tmp_path / "ca"), TOKEN_ENV: str(tmp_path / "t")}
    assert TrainJobProgress.from_environ(full) is not None
    for key in full:
        assert TrainJobProgress.from_environ({k: v for k, v in full.items() if k != key}) is None
    assert TrainJobProgress.min_interval_s == MIN_INTERVAL_S == 5.0
    with pytest.raises(ValueError, match="https"):
        TrainJobProgress("http://h:1/p", tmp_path / "ca", tmp_path / "t")


def test_send_sets_the_trainjob_status(server: tjs.StatusServer, sink: TrainJobProgress) -> None:
    sink.send(_status())
    (req,) = server.requests
    assert (req.method, req.path, req.code) == ("POST", tjs.status_path(NAMESPACE, NAME), 200)
    assert server.trainer_status == trainer_status(_status())["trainerStatus"]
    assert req.answer == {"trainerStatus": server.trainer_status}
    assert req.token == sink.token.read_text()


def test_token_is_read_again_on_every_send(server: tjs.StatusServer, sink: TrainJobProgress, tmp_path: Path) -> None:
    """A rotated token is the one the next request carries; a token the controller refuses is a ReportFailed and
    the send after a good token comes back succeeds."""
    first = sink.token.read_text()
    sink.send(_status(step=40))
    second = _token(server, sink.token)
    sink.send(_status(step=50))
    assert [r.token for r in server.requests] == [first, second] and first != second
    expired = _token(server, sink.token, ttl_s=-1.0)
    with pytest.raises(ReportFailed) as err:
        sink.send(_status(step=60))
    assert err.value.sink == sink.name and "HTTP 403 Forbidden: Forbidden" in err.value.reason
    assert (
        server.requests[-1].token == expired
        and server.trainer_status == trainer_status(_status(step=50))["trainerStatus"]
    )
    _token(server, sink.token)
    sink.send(_status(step=70))
    assert server.trainer_status is not None and server.trainer_status["progressPercentage"] == 70


def test_missing_or_empty_token_fails_without_a_request(server: tjs.StatusServer, sink: TrainJobProgress) -> None:
    sink.token.unlink()
    with pytest.raises(ReportFailed, match="token file"):
        sink.send(_status())
    sink.token.write_text("\n")
    with pytest.raises(ReportFailed, match="is empty"):
        sink.send(_status())
    assert server.requests == []
    _token(server, sink.token)
    sink.send(_status())
    assert [r.code for r in server.requests] == [200]


def test_only_the_given_ca_is_trusted(server: tjs.StatusServer, sink: TrainJobProgress, tmp_path: Path) -> None:
    """A CA file of another CA: the TLS handshake fails at the client, nothing is sent. The file replaced by the
    right CA (a rotation, a new file renamed over the old one): the next send trusts it."""
    other = tmp_path / "other-ca.crt"
    trustme.CA().cert_pem.write_to_path(str(other))
    right = tmp_path / "ca.crt"
    right.write_bytes(server.ca_file.read_bytes())
    sink.ca_cert = tmp_path / "mounted-ca.crt"
    os.replace(other, sink.ca_cert)
    with pytest.raises(ReportFailed, match="CERTIFICATE_VERIFY_FAILED"):
        sink.send(_status())
    assert [r for r in server.requests if r.code == 200] == []
    os.replace(right, sink.ca_cert)
    sink.send(_status())
    assert server.requests[-1].code == 200


def test_refusals_carry_the_code_and_the_message(server: tjs.StatusServer, sink: TrainJobProgress) -> None:
    """5xx and 4xx answers are ReportFailed with the code and the metav1.Status message."""
    server.fault = "error"
    with pytest.raises(ReportFailed) as err:
        sink.send(_status())
    assert "HTTP 500 Internal Server Error: Internal error" in err.value.reason
    server.fault = None
    sink.path = "/apis/trainer.kubeflow.org/v1alpha1/namespaces/team-a/trainjobs/resnet"
    with pytest.raises(ReportFailed) as err:
        sink.send(_status())
    assert "HTTP 404 Not Found: Not found" in err.value.reason
    assert [r.code for r in server.requests] == [500, 404] and server.trainer_status is None


def test_down_or_slow_endpoint_fails_within_the_timeout(server: tjs.StatusServer, sink: TrainJobProgress) -> None:
    sink.timeout_s = 0.5
    server.fault, server.slow_s = "slow", 2.0
    with pytest.raises(ReportFailed, match="timed out"):
        sink.send(_status())
    server.fault = None
    server.down()
    with pytest.raises(ReportFailed, match="ConnectionRefusedError"):
        sink.send(_status())


def test_a_run_reports_to_the_trainjob_only_with_the_three_variables(tmp_path: Path) -> None:
    """``sinks``: the TrainJob sink joins when the controller set all three variables, not with one missing,
    not with ``report.trainjob`` off; an unusable URL leaves it out (logged) rather than failing the run."""
    from job.cluster.env import detect_env
    from job.config import JobConfig
    from job.config.load import load_config
    from job.observe.report import sinks

    env = detect_env({})
    full = {URL_ENV: "https://h.svc:10443/p", CA_CERT_ENV: str(tmp_path / "ca"), TOKEN_ENV: str(tmp_path / "t")}
    cfg = load_config(["--run.output-dir", str(tmp_path)], {})

    def names(config: JobConfig, environ: dict[str, str]) -> list[str]:
        return [s.name for s in sinks(config, env, environ)]

    assert names(cfg, full) == ["status file", TrainJobProgress.name]
    assert names(cfg, {k: v for k, v in full.items() if k != TOKEN_ENV}) == ["status file"]
    assert names(load_config(["--run.output-dir", str(tmp_path), "--report.trainjob", "false"], {}), full) == [
        "status file"
    ]
    assert names(cfg, {**full, URL_ENV: "http://h.svc:10443/p"}) == ["status file"]
