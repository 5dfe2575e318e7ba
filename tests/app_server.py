"""python app.py on 127.0.0.1 in a subprocess, for the tests that talk to it as clients do."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Url(str):
    """The server's URL, carrying the server's process id (for tests that read its memory)."""

    def __new__(cls, url: str, pid: int):
        self = super().__new__(cls, url)
        self.pid = pid
        return self


def rss_mib(pid: int) -> float:
    """Resident memory of a process, in MiB."""
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith("VmRSS")).split()[1]) / 1024


@contextlib.contextmanager
def serve(log: Path, **env: str):
    """Start the app with extra environment `env`; yield its URL (a Url, with .pid); stop it afterwards."""
    port = free_port()
    full_env = {**os.environ, "GRADIO_ANALYTICS_ENABLED": "False", "HF_HUB_OFFLINE": "1", **env}
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "app.py", "--port", str(port)],
            cwd=ROOT,
            env=full_env,
            stdout=out,
            stderr=subprocess.STDOUT,
            text=True,
        )
        try:
            deadline = time.time() + 180
            while True:
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=1).close()
                    break
                except OSError:
                    if proc.poll() is not None or time.time() > deadline:
                        raise RuntimeError(log.read_text()) from None
                    time.sleep(0.5)
            yield Url(f"http://127.0.0.1:{port}/", proc.pid)
        finally:
            proc.terminate()
            proc.wait(timeout=30)
