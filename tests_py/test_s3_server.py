"""The S3 test server helper (``tests_py/s3_server.py``): a real s3s-fs that
answers signed requests with the fixed test credentials and refuses others."""

from __future__ import annotations

import os
import urllib.error
import urllib.request
from pathlib import Path

from s3_server import S3Server, signed_request


def test_the_test_server_is_a_real_s3(tmp_path: Path) -> None:
    with S3Server(tmp_path / "s3", buckets=("bucket",)) as server:
        assert server.endpoint.startswith("http://127.0.0.1:")
        assert server.env()["AWS_ENDPOINT_URL"] == server.endpoint
        status, _ = signed_request(server, "PUT", "bucket", "a/b.page", b"hello")
        assert status == 200
        assert server.object_file("bucket", "a/b.page").read_bytes() == b"hello"
        assert signed_request(server, "GET", "bucket", "a/b.page") == (200, b"hello")
        status, _ = signed_request(server, "GET", "bucket", "missing")
        assert status == 404
        try:
            urllib.request.urlopen(server.endpoint + "/bucket/a/b.page", timeout=30)
            raise AssertionError("an unsigned request was served")
        except urllib.error.HTTPError as e:
            assert e.code == 403
        pid = int((tmp_path / "s3" / ".server.pid").read_text())
        server.stop()
        assert not _alive(pid)
        server.restart()
        assert signed_request(server, "GET", "bucket", "a/b.page") == (200, b"hello")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
