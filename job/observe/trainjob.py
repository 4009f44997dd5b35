"""A Kubeflow Trainer TrainJob's progress endpoint as a status sink: ``TrainJob.status.trainerStatus``.

With the controller's ``TrainJobStatus`` feature gate on (alpha since Trainer v2.2, off by default), the
controller injects three variables into the trainer container (``pkg/runtime/framework/plugins/trainjobstatus/
trainjobstatus.go``, kubeflow/trainer v2.3.0):

- ``KUBEFLOW_TRAINER_SERVER_URL``: ``https://<webhook service>.<controller namespace>.svc:<port>`` plus the path
  ``/apis/trainer.kubeflow.org/v1alpha1/namespaces/<namespace>/trainjobs/<name>/status``
  (``pkg/statusserver/utils.go`` ``StatusUrl``; defaults ``kubeflow-trainer-controller-manager``,
  ``kubeflow-system``, 10443);
- ``KUBEFLOW_TRAINER_SERVER_CA_CERT``: the CA that signed the endpoint's certificate, a file of a projected volume
  that the controller keeps in sync with its webhook certificates (they rotate);
- ``KUBEFLOW_TRAINER_SERVER_TOKEN``: a projected service account token (a JWT of 1 h, audience the TrainJob's
  status path) that the kubelet replaces before it expires.

The body is ``UpdateTrainJobStatusRequest`` ("TrainerStatus", ``pkg/apis/trainer/v1alpha1/trainjob_types.go``):
``progressPercentage`` and ``estimatedRemainingSeconds`` are int32 (0-100, and >= 0), ``metrics`` a list of at most
256 ``{name, value}`` whose value is a string (both 1-64 characters), ``lastUpdatedTime`` an RFC 3339 time that
the CRD requires. The server (``pkg/statusserver/server.go``) answers 200 with the payload it parsed, or a
``metav1.Status`` whose ``message`` says what it refused (403 for a token it does not accept, 422 for a body that
does not parse or does not validate).

One request per ``send``, on a new connection: the CA is re-read when its file changes and the token on every
send (both rotate), so a long run never holds a stale one. Every failure (no token, unreachable, timed out,
refused) raises ``ReportFailed``; the reporter logs it and training goes on.
"""

from __future__ import annotations

import http.client
import json
import os
import ssl
from collections.abc import Mapping
from datetime import datetime, timezone
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from job.errors import ReportFailed
from job.observe.status import Status

URL_ENV = "KUBEFLOW_TRAINER_SERVER_URL"
CA_CERT_ENV = "KUBEFLOW_TRAINER_SERVER_CA_CERT"
TOKEN_ENV = "KUBEFLOW_TRAINER_SERVER_TOKEN"
MIN_INTERVAL_S = 5.0
"""At most one request per 5 s: the client throttle of Trainer's guide and of the Kubeflow SDK's
``update_trainjob_status`` (the endpoint applies each one to the TrainJob through the API server)."""
TIMEOUT_S = 5.0
"""Per connect and per read: a controller that does not answer in this time is reported, never waited on."""
CHECKPOINT_STEP, CHECKPOINT_AGE = "last_checkpoint_step", "checkpoint_age_s"
"""The metric names of the newest complete checkpoint and its age in seconds: the work a preemption now costs."""
MAX_METRICS, MAX_METRIC_CHARS = 256, 64
"""The CRD's limits: ``metrics`` MaxItems, and MaxLength of a metric's name and of its value."""
INT32_MAX = 2**31 - 1
MAX_ANSWER_BYTES = 1 << 16


def rfc3339(unix_time: float) -> str:
    """UTC, whole seconds, ``Z``: how ``metav1.Time`` writes a time (the controller keeps no finer one)."""
    return datetime.fromtimestamp(unix_time, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def metric_value(value: float) -> str:
    """A metric as the API wants it, a string: six significant digits (``nan``/``inf`` stay readable)."""
    return f"{value:.6g}"


def status_metrics(status: Status) -> list[dict[str, str]]:
    """The latest metrics of ``status`` plus the checkpoint fields, as ``{name, value}`` items within the CRD's
    limits: a name longer than 64 characters is left out (cutting it could merge two metrics)."""
    items = [
        {"name": name, "value": metric_value(v)}
        for name, v in status.metrics.items()
        if 0 < len(name) <= MAX_METRIC_CHARS
    ]
    if status.last_checkpoint_step is not None:
        items.append({"name": CHECKPOINT_STEP, "value": str(status.last_checkpoint_step)})
    if status.checkpoint_age_s is not None:
        items.append({"name": CHECKPOINT_AGE, "value": f"{status.checkpoint_age_s:.0f}"})
    return items[-MAX_METRICS:]  # the checkpoint fields come last: they are kept


def trainer_status(status: Status) -> dict[str, Any]:
    """The request body for ``status``: ``{"trainerStatus": {...}}`` (an unknown ETA is left out, as the API's
    "empty if unknown")."""
    body: dict[str, Any] = {"progressPercentage": status.progress_percentage}
    eta = status.estimated_remaining_s
    if eta is not None:
        body["estimatedRemainingSeconds"] = min(max(eta, 0), INT32_MAX)
    metrics = status_metrics(status)
    if metrics:
        body["metrics"] = metrics
    body["lastUpdatedTime"] = rfc3339(status.wall_time)
    return {"trainerStatus": body}


def refusal(code: int, reason: str, body: bytes) -> str:
    """``HTTP 422 Unprocessable Entity: <metav1.Status message>``, or the status line alone."""
    text = f"HTTP {code} {reason}".rstrip()
    try:
        answer = json.loads(body)
    except ValueError:
        return text
    if isinstance(answer, dict) and isinstance(answer.get("message"), str) and answer["message"]:
        return f"{text}: {answer['message']}"
    return text


class TrainJobProgress:
    """POSTs each status to the TrainJob's progress endpoint, over TLS that trusts only the injected CA, with the
    bearer token read from its file on every send."""

    name = "trainjob status"
    min_interval_s = MIN_INTERVAL_S

    def __init__(self, url: str, ca_cert: Path, token: Path, timeout_s: float = TIMEOUT_S) -> None:
        parts = urlsplit(url)
        if parts.scheme != "https" or not parts.hostname:
            raise ValueError(f"{URL_ENV}={url!r} is not an https:// URL")
        self.url, self.ca_cert, self.token, self.timeout_s = url, ca_cert, token, timeout_s
        self.host, self.port = parts.hostname, parts.port or 443
        self.path = parts.path + (f"?{parts.query}" if parts.query else "")
        self._context: ssl.SSLContext | None = None
        self._ca_stamp: tuple[int, int, int] | None = None

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> TrainJobProgress | None:
        """The sink the controller's variables describe; None unless all three are set."""
        url, ca, token = (environ.get(k, "") for k in (URL_ENV, CA_CERT_ENV, TOKEN_ENV))
        if not (url and ca and token):
            return None
        return cls(url, Path(ca), Path(token))

    def send(self, status: Status) -> None:
        body = json.dumps(trainer_status(status), allow_nan=False).encode()
        headers = {
            "Authorization": f"Bearer {self._read_token()}",
            "Content-Type": "application/json",
            "Accept": "application/json",
        }
        conn = http.client.HTTPSConnection(self.host, self.port, timeout=self.timeout_s, context=self._tls())
        try:
            conn.request("POST", self.path, body=body, headers=headers)
            answer = conn.getresponse()
            data = answer.read(MAX_ANSWER_BYTES)
        except (OSError, http.client.HTTPException) as e:  # refused, unreachable, timed out, TLS refused
            raise ReportFailed(self.name, f"POST {self.url}: {type(e).__name__}: {e}") from None
        finally:
            conn.close()
        if not 200 <= answer.status < 300:
            raise ReportFailed(self.name, f"POST {self.url}: {refusal(answer.status, answer.reason, data)}")

    def _read_token(self) -> str:
        """The current token: the kubelet replaces the file's content before the old token expires."""
        try:
            token = self.token.read_text().strip()
        except OSError as e:
            raise ReportFailed(self.name, f"token file {self.token} ({TOKEN_ENV}): {e.strerror or e}") from None
        if not token:
            raise ReportFailed(self.name, f"token file {self.token} ({TOKEN_ENV}) is empty")
        return token

    def _tls(self) -> ssl.SSLContext:
        """A context that trusts only the CA file, made again when the file changes (a rotated CA)."""
        try:
            st = os.stat(self.ca_cert)
        except OSError as e:
            raise ReportFailed(self.name, f"CA file {self.ca_cert} ({CA_CERT_ENV}): {e.strerror or e}") from None
        stamp = (st.st_ino, st.st_mtime_ns, st.st_size)
        if self._context is None or stamp != self._ca_stamp:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # verifies the chain and the host name
            try:
                context.load_verify_locations(cafile=str(self.ca_cert))
            except (OSError, ssl.SSLError) as e:
                raise ReportFailed(self.name, f"CA file {self.ca_cert} ({CA_CERT_ENV}): {e}") from None
            self._context, self._ca_stamp = context, stamp
        return self._context
