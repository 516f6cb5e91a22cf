"""An S3 server for the object-store checkpoint tests: moto's S3 emulator, a real HTTP
server speaking the S3 REST protocol (signatures, multipart uploads, listings), in a
process of its own.

moto lives in a virtual environment of its own (`.venv-s3`, made by `make test`):
it depends on botocore, which pins python-dateutil below 3 while the kubernetes client
needs 3 or later, so the two cannot share rove's environment. `ROVE_TEST_MOTO_SERVER`
names another `moto_server` executable.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pytest

from tests.support import free_port

ROOT = Path(__file__).resolve().parent.parent


def moto_server() -> str:
    """The emulator's executable; the test fails (not skips) without it, saying how to
    install it."""
    named = os.environ.get("ROVE_TEST_MOTO_SERVER")
    for candidate in (named, str(ROOT / ".venv-s3" / "bin" / "moto_server")):
        if candidate and Path(candidate).exists():
            return candidate
    found = shutil.which("moto_server")
    if found:
        return found
    pytest.fail(
        "no S3 emulator: run `make test` (it installs moto's server into .venv-s3), or "
        "set ROVE_TEST_MOTO_SERVER to a moto_server executable"
    )


class S3Server:
    """moto_server on a free loopback port; `bucket()` makes a fresh bucket."""

    def __init__(self, log: Path) -> None:
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.log = log
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 60.0) -> None:
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                [moto_server(), "-H", "127.0.0.1", "-p", str(self.port)],
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"moto_server exited: {self.log.read_text()[-2000:]}")
            try:
                urllib.request.urlopen(f"{self.endpoint}/", timeout=2).close()
                return
            except (urllib.error.URLError, OSError):
                time.sleep(0.2)
        raise RuntimeError(f"moto_server did not answer in {timeout:.0f} s")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def env(self) -> dict[str, str]:
        """What a process needs to reach it, as it would reach any S3-compatible store."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": "rove-test",
            "AWS_SECRET_ACCESS_KEY": "rove-test-secret",
            "AWS_REGION": "us-east-1",
            "AWS_ALLOW_HTTP": "true",
        }

    def bucket(self) -> str:
        name = f"rove-{uuid.uuid4().hex[:12]}"
        request = urllib.request.Request(f"{self.endpoint}/{name}", method="PUT")
        urllib.request.urlopen(request, timeout=30).close()
        return name
