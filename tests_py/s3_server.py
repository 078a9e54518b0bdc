"""A real S3-compatible server for Python tests: s3s-fs through
``ci/s3-server.sh`` (built once and cached under ~/.cache/lmcache-rc/).

``S3Server`` starts one on a free loopback port with the script's fixed test
credentials and stops it on ``stop()`` (or at the end of a ``with`` block);
the script's watchdog also stops it when the test process ends. ``env()``
gives the ``AWS_*`` variables a sidecar started with ``--shared-url
s3://BUCKET/prefix`` reads. ``signed_request`` is a minimal SigV4 client
(standard library only) for tests that look at the bucket themselves.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import hmac
import os
import subprocess
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "ci" / "s3-server.sh"
ACCESS_KEY = "lmcache-rc-test"
SECRET_KEY = "lmcache-rc-test-secret"
REGION = "us-east-1"


def _script(*args: str, port: int | None = None) -> str:
    env = dict(os.environ, LMCACHE_RC_S3_OWNER_PID=str(os.getpid()))
    if port is not None:
        env["LMCACHE_RC_S3_PORT"] = str(port)
    out = subprocess.run(
        ["bash", str(SCRIPT), *args], env=env, capture_output=True, text=True, check=False
    )
    if out.returncode != 0:
        raise RuntimeError(f"ci/s3-server.sh {args} failed:\n{out.stdout}\n{out.stderr}")
    lines = out.stdout.strip().splitlines()
    return lines[-1].strip() if lines else ""


class S3Server:
    """An s3s-fs serving ``data_dir`` (buckets are its subdirectories)."""

    def __init__(self, data_dir: Path, buckets: tuple[str, ...] = ("lmcache-rc-test",)) -> None:
        self.data_dir = Path(data_dir)
        self.buckets = buckets
        self.endpoint = _script("start", str(self.data_dir), *buckets)

    @property
    def port(self) -> int:
        return int(self.endpoint.rsplit(":", 1)[1])

    def stop(self) -> None:
        _script("stop", str(self.data_dir))

    def restart(self) -> None:
        """Start again on the same port and data (after ``stop``)."""
        self.endpoint = _script("start", str(self.data_dir), *self.buckets, port=self.port)

    def env(self) -> dict[str, str]:
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_REGION": REGION,
            "AWS_ALLOW_HTTP": "true",
        }

    def object_file(self, bucket: str, key: str) -> Path:
        """The file s3s-fs keeps an object in (to corrupt or delete it)."""
        return self.data_dir / bucket / key

    def __enter__(self) -> S3Server:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def signed_request(
    server: S3Server, method: str, bucket: str, key: str, body: bytes = b""
) -> tuple[int, bytes]:
    """One path-style S3 request signed with SigV4; returns (status, body)."""
    now = _dt.datetime.now(_dt.UTC)
    amz_date = now.strftime("%Y%m%dT%H%M%SZ")
    day = now.strftime("%Y%m%d")
    host = urllib.parse.urlparse(server.endpoint).netloc
    path = "/" + urllib.parse.quote(f"{bucket}/{key}")
    payload_hash = hashlib.sha256(body).hexdigest()
    headers = {"host": host, "x-amz-content-sha256": payload_hash, "x-amz-date": amz_date}
    signed = ";".join(sorted(headers))
    canonical = "\n".join(
        [
            method,
            path,
            "",
            *(f"{k}:{headers[k]}" for k in sorted(headers)),
            "",
            signed,
            payload_hash,
        ]
    )
    scope = f"{day}/{REGION}/s3/aws4_request"
    to_sign = "\n".join(
        ["AWS4-HMAC-SHA256", amz_date, scope, hashlib.sha256(canonical.encode()).hexdigest()]
    )
    k = f"AWS4{SECRET_KEY}".encode()
    for part in (day, REGION, "s3", "aws4_request"):
        k = hmac.new(k, part.encode(), hashlib.sha256).digest()
    signature = hmac.new(k, to_sign.encode(), hashlib.sha256).hexdigest()
    headers["authorization"] = (
        f"AWS4-HMAC-SHA256 Credential={ACCESS_KEY}/{scope}, "
        f"SignedHeaders={signed}, Signature={signature}"
    )
    request = urllib.request.Request(
        server.endpoint + path, data=body or None, method=method, headers=headers
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
