"""Kubeflow Trainer's TrainJob status endpoint (the ``TrainJobStatus`` feature gate), as the controller of
v2.3.0 serves it (``pkg/statusserver/``, read from that tag), for the simulation and the sink's tests:

* ``POST /apis/trainer.kubeflow.org/v1alpha1/namespaces/{namespace}/trainjobs/{name}/status`` over TLS, with a
  certificate for the controller's Service name signed by a CA of its own (``trustme``; the CA file is what the
  controller copies into the TrainJob's ``<name>-tls-config`` ConfigMap); anything else is 404 ``Not found``;
* the bearer token checked as ``projectedServiceAccountTokenAuthorizer`` does: signature, issuer, expiry, the
  audience of this TrainJob's status path and the ``kubernetes.io`` namespace claim; else 403 ``Forbidden``.
  Tokens are JWTs signed here (HMAC instead of the API server's RSA key: the same checks, no OIDC discovery);
* a body over 64 KiB is 413; one that does not decode into ``UpdateTrainJobStatusRequest`` as Go's
  ``encoding/json`` would (unknown fields are ignored, an int32 must be an integer literal, a metric value a
  string, the time RFC 3339) is 422 ``Invalid payload``; one the CRD rejects on apply (percentage 0-100,
  remaining seconds >= 0, at most 256 metrics, names and values 1-64 characters, ``lastUpdatedTime`` present) is
  422 with the API server's message; no ``trainerStatus`` is 200 and changes nothing;
* accepted: ``trainer_status`` holds it as ``TrainJob.status.trainerStatus`` would after the server-side apply
  (the whole object replaced, the time in whole seconds), and the answer is 200 with the parsed payload.

Every request is logged (``requests``: time, path, token, body, answer). Fault switches: ``down()`` (nothing
listens: connections are refused), ``fault = "slow"`` (the answer comes after ``slow_s``), ``fault = "error"``
(500 ``Internal error``, what the server answers when the apply fails).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import re
import secrets
import ssl
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import trustme

SERVICE, OPERATOR_NAMESPACE, PORT = "kubeflow-trainer-controller-manager", "kubeflow-system", 10443
SERVICE_HOST = f"{SERVICE}.{OPERATOR_NAMESPACE}.svc"  # the host name of KUBEFLOW_TRAINER_SERVER_URL
MOUNT = "/var/run/secrets/kubeflow/trainer"  # the projected volume with ``token`` and ``ca.crt``
ISSUER = "https://kubernetes.default.svc.cluster.local"
MAX_BODY = 1 << 16
INT32_MAX = 2**31 - 1
PATH = re.compile(r"/apis/trainer\.kubeflow\.org/v1alpha1/namespaces/([^/]+)/trainjobs/([^/]+)/status")
RFC3339 = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?(Z|[+-]\d\d:\d\d)", re.I)


def status_path(namespace: str, name: str) -> str:
    """``StatusUrl`` (pkg/statusserver/utils.go)."""
    return f"/apis/trainer.kubeflow.org/v1alpha1/namespaces/{namespace}/trainjobs/{name}/status"


def audience(namespace: str, name: str) -> str:
    """``TokenAudience``: the projected token's audience for one TrainJob."""
    return f"trainer.kubeflow.org/v1alpha1/namespaces/{namespace}/trainjobs/{name}/status"


def url(namespace: str, name: str, host: str = SERVICE_HOST, port: int = PORT) -> str:
    """``KUBEFLOW_TRAINER_SERVER_URL`` as the TrainJobStatus plugin builds it."""
    return f"https://{host}:{port}{status_path(namespace, name)}"


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


class TokenIssuer:
    """The API server's token signer for projected service account tokens (JWTs)."""

    def __init__(self) -> None:
        self._key = secrets.token_bytes(32)

    def issue(self, namespace: str, name: str, pod: str, ttl_s: float) -> str:
        now = time.time()
        claims = {
            "aud": [audience(namespace, name)],
            "exp": now + ttl_s,
            "iat": now,
            "nbf": now,
            "iss": ISSUER,
            "jti": str(uuid.uuid4()),
            "kubernetes.io": {
                "namespace": namespace,
                "pod": {"name": pod, "uid": str(uuid.uuid4())},
                "serviceaccount": {"name": "default", "uid": "00000000-0000-0000-0000-000000000001"},
            },
            "sub": f"system:serviceaccount:{namespace}:default",
        }
        head = _b64(json.dumps({"alg": "HS256", "kid": "sim", "typ": "JWT"}).encode())
        body = _b64(json.dumps(claims).encode())
        return f"{head}.{body}.{self._sign(f'{head}.{body}')}"

    def _sign(self, text: str) -> str:
        return _b64(hmac.new(self._key, text.encode(), hashlib.sha256).digest())

    def claims(self, token: str) -> dict | None:
        """The claims of a token this issuer signed, None for anything else (go-oidc's signature check)."""
        parts = token.split(".")
        if len(parts) != 3 or not hmac.compare_digest(self._sign(f"{parts[0]}.{parts[1]}"), parts[2]):
            return None
        try:
            claims = json.loads(_unb64(parts[1]))
        except ValueError:
            return None
        return claims if isinstance(claims, dict) else None

    def authorize(self, header: str, namespace: str, name: str) -> bool:
        """``Authorize``: exactly ``Bearer <token>`` (any case, any spacing), a token of ours, unexpired, issued
        for this TrainJob's audience, bound to a pod of its namespace."""
        fields = header.split()
        if len(fields) != 2 or fields[0].lower() != "bearer":
            return False
        claims = self.claims(fields[1])
        if claims is None or claims.get("iss") != ISSUER or not time.time() < float(claims.get("exp", 0)):
            return False
        if audience(namespace, name) not in (claims.get("aud") or []):
            return False
        return (claims.get("kubernetes.io") or {}).get("namespace") == namespace


class Invalid(Exception):
    """A request the server answers 422, with the message it sends."""


def _int32(obj: dict, key: str) -> int | None:
    """Go's json into ``*int32``: absent or null is nil; only an integer literal in range decodes."""
    v = obj.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or not -(2**31) <= v <= INT32_MAX:
        raise Invalid("Invalid payload")
    return v


def decode(body: bytes) -> dict | None:
    """``json.Decoder.Decode`` into ``UpdateTrainJobStatusRequest``: the trainerStatus it holds (None: none),
    with the fields Go keeps; unknown fields are dropped, a wrong type is ``Invalid``."""
    try:
        req, _ = json.JSONDecoder().raw_decode(body.decode().lstrip())  # Decode reads one value
    except (ValueError, UnicodeDecodeError):
        raise Invalid("Invalid payload") from None
    if req is None:
        return None
    if not isinstance(req, dict):
        raise Invalid("Invalid payload")
    ts = req.get("trainerStatus")
    if ts is None:
        return None
    if not isinstance(ts, dict):
        raise Invalid("Invalid payload")
    out: dict[str, Any] = {}
    for key in ("progressPercentage", "estimatedRemainingSeconds"):
        value = _int32(ts, key)
        if value is not None:
            out[key] = value
    metrics = ts.get("metrics")
    if metrics is not None:
        if not isinstance(metrics, list):
            raise Invalid("Invalid payload")
        out["metrics"] = [_metric(m) for m in metrics]
    out["lastUpdatedTime"] = _time(ts.get("lastUpdatedTime"))
    return out


def _metric(m: object) -> dict[str, str]:
    """One ``Metric``: null decodes as the empty metric, a name or value that is not a string is ``Invalid``."""
    if m is None:
        m = {}
    if not isinstance(m, dict):
        raise Invalid("Invalid payload")
    out = {}
    for key in ("name", "value"):
        v = m.get(key)
        if v is not None and not isinstance(v, str):
            raise Invalid("Invalid payload")
        out[key] = v or ""
    return out


def _time(v: object) -> str | None:
    """``metav1.Time``: null is the zero time (None here); a string must parse as RFC 3339; kept in UTC, whole
    seconds, as ``metav1.Time`` marshals it."""
    if v is None:
        return None
    if not isinstance(v, str) or not RFC3339.fullmatch(v):
        raise Invalid("Invalid payload")
    t = datetime.fromisoformat(v.upper().replace("Z", "+00:00"))
    return t.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def validate(ts: dict, name: str) -> None:
    """The CRD's rules on ``status.trainerStatus`` at apply; ``Invalid`` with the API server's message."""
    base = "status.trainerStatus"
    errors = []
    pct = ts.get("progressPercentage")
    if pct is not None and pct < 0:
        errors.append(
            f"{base}.progressPercentage: Invalid value: {pct}: {base}.progressPercentage in body should be greater than or equal to 0"
        )
    if pct is not None and pct > 100:
        errors.append(
            f"{base}.progressPercentage: Invalid value: {pct}: {base}.progressPercentage in body should be less than or equal to 100"
        )
    eta = ts.get("estimatedRemainingSeconds")
    if eta is not None and eta < 0:
        errors.append(
            f"{base}.estimatedRemainingSeconds: Invalid value: {eta}: {base}.estimatedRemainingSeconds in body should be greater than or equal to 0"
        )
    metrics = ts.get("metrics") or []
    if len(metrics) > 256:
        errors.append(f"{base}.metrics: Too many: {len(metrics)}: must have at most 256 items")
    for i, m in enumerate(metrics):
        for key in ("name", "value"):
            n = len(m[key])
            if not 1 <= n <= 64:
                bound = "at least 1 chars long" if n < 1 else "at most 64 chars long"
                errors.append(
                    f'{base}.metrics[{i}].{key}: Invalid value: "{m[key]}": {base}.metrics[{i}].{key} in body should be {bound}'
                )
    if ts.get("lastUpdatedTime") is None:
        errors.append(f'{base}: Invalid value: "object": lastUpdatedTime is required when trainerStatus is present')
    if errors:
        listed = errors[0] if len(errors) == 1 else f"[{', '.join(errors)}]"
        raise Invalid(f'TrainJob.trainer.kubeflow.org "{name}" is invalid: {listed}')


def api_status(message: str, reason: str, code: int) -> dict:
    """The ``metav1.Status`` the server sends with an error (``badRequest``)."""
    return {"metadata": {}, "status": "Failure", "message": message, "reason": reason, "code": code}


@dataclass(frozen=True)
class Request:
    time: float
    method: str
    path: str
    token: str
    body: bytes
    code: int
    answer: dict

    def claims(self) -> dict:
        """The token's claims, unverified (for the tests: which pod sent it)."""
        parts = self.token.split(".")
        return json.loads(_unb64(parts[1])) if len(parts) == 3 else {}


class StatusServer:
    """The controller's status server for one TrainJob ``namespace/name``, on ``host:port``. ``open_socket``
    creates the listening socket (the simulation makes it inside the controller's network namespace)."""

    def __init__(
        self,
        workdir: Path,
        namespace: str,
        name: str,
        host: str,
        port: int = PORT,
        *,
        names: tuple[str, ...] = (SERVICE_HOST,),
    ) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        self.namespace, self.name, self.host, self.port = namespace, name, host, port
        self.issuer = TokenIssuer()
        self.ca = trustme.CA(organization_name="kubeflow-trainer sim")
        self.ca_file = workdir / "ca.crt"
        self.ca.cert_pem.write_to_path(str(self.ca_file))
        self._tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.ca.issue_cert(*names).configure_cert(self._tls)
        self.trainer_status: dict | None = None
        """``TrainJob.status.trainerStatus`` as the API server holds it after the last accepted request."""
        self.history: list[tuple[float, dict]] = []
        self.requests: list[Request] = []
        self.fault: str | None = None
        self.slow_s = 8.0
        self._lock = threading.Lock()
        self._httpd: ThreadingHTTPServer | None = None
        self._open_socket: Callable[[Callable[[], ThreadingHTTPServer]], ThreadingHTTPServer] = lambda make: make()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ listening
    def up(self, open_socket: Callable[[Callable[[], ThreadingHTTPServer]], ThreadingHTTPServer] | None = None) -> None:
        """Listen (again): ``open_socket(make)`` calls ``make`` where the socket must live (default: here; a later
        call without one uses the first one's)."""
        if self._httpd is not None:
            return
        if open_socket is not None:
            self._open_socket = open_socket
        httpd = self._open_socket(self._make)
        if self.port == 0:
            self.port = httpd.server_address[1]
        self._httpd = httpd
        self._thread = threading.Thread(target=httpd.serve_forever, name="trainjob-status", daemon=True)
        self._thread.start()

    def down(self) -> None:
        """Stop listening: a connection is refused, as by a controller that is not running."""
        httpd, self._httpd = self._httpd, None
        if httpd is not None:
            httpd.shutdown()
            httpd.server_close()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def _make(self) -> ThreadingHTTPServer:
        server = self

        class Handler(_Handler):
            owner = server

        httpd = ThreadingHTTPServer((self.host, self.port), Handler, bind_and_activate=False)
        httpd.daemon_threads = True
        httpd.socket = self._tls.wrap_socket(httpd.socket, server_side=True, do_handshake_on_connect=False)
        httpd.server_bind()
        httpd.server_activate()
        return httpd

    def url(self, host: str | None = None) -> str:
        return url(self.namespace, self.name, host or SERVICE_HOST, self.port)

    # ------------------------------------------------------------------ the handler's logic
    def answer(self, method: str, path: str, auth: str, body: bytes) -> tuple[int, dict]:
        """``handleTrainJobRuntimeStatus`` (and ``handleDefault``): the code and JSON of the answer."""
        m = PATH.fullmatch(path)
        if method != "POST" or m is None:
            return 404, api_status("Not found", "NotFound", 404)
        namespace, name = m.groups()
        if not self.issuer.authorize(auth, namespace, name):
            return 403, api_status("Forbidden", "Forbidden", 403)
        try:
            ts = decode(body)
        except Invalid as e:
            return 422, api_status(str(e), "Invalid", 422)
        if ts is None:
            return 200, {}
        if self.fault == "error":
            return 500, api_status("Internal error", "InternalError", 500)
        if (namespace, name) != (self.namespace, self.name):
            return 404, api_status("Train job not found", "NotFound", 404)
        try:
            validate(ts, name)
        except Invalid as e:
            return 422, api_status(str(e), "Invalid", 422)
        with self._lock:
            self.trainer_status = ts
            self.history.append((time.time(), ts))
        return 200, {"trainerStatus": ts}

    def record(self, req: Request) -> None:
        with self._lock:
            self.requests.append(req)


class _Handler(BaseHTTPRequestHandler):
    owner: StatusServer
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        pass  # every request is in ``owner.requests``

    timeout = 10  # the server's readTimeout

    def handle(self) -> None:
        """The TLS handshake here, in the connection's thread (not in the accepting loop)."""
        try:
            self.request.do_handshake()
        except (ssl.SSLError, OSError):  # a client that refused our certificate, or left
            return
        super().handle()

    def handle_one_request(self) -> None:
        try:
            super().handle_one_request()
        except (ssl.SSLError, ConnectionError, TimeoutError):  # a client that gave up mid-request
            self.close_connection = True

    def do_POST(self) -> None:
        self._serve("POST")

    def do_GET(self) -> None:
        self._serve("GET")

    def _serve(self, method: str) -> None:
        owner = self.owner
        t = time.time()
        length = int(self.headers.get("Content-Length") or 0)
        auth = self.headers.get("Authorization") or ""
        if length > MAX_BODY:
            code, answer, body = 413, api_status("Payload too large", "RequestEntityTooLarge", 413), b""
        else:
            body = self.rfile.read(length)
            if owner.fault == "slow":
                time.sleep(owner.slow_s)
            code, answer = owner.answer(method, self.path, auth, body)
        token = auth.split()[-1] if auth.split() else ""
        owner.record(Request(t, method, self.path, token, body, code, answer))
        data = (json.dumps(answer) + "\n").encode()
        try:
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except (ConnectionError, ssl.SSLError, TimeoutError):
            self.close_connection = True  # the client timed out and left
