"""Start `speculant serve` as a child process on a free loopback port, bounded in time, and stop it."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
MODEL = "smollm2-135m-instruct"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, *args: str, life: int = 900) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "SPECULANT_THREADS": os.environ.get("SPECULANT_THREADS", "1")}
        # `timeout` bounds the server's life even if the test process dies without stopping it.
        cmd = ["timeout", "-s", "KILL", str(life), sys.executable, "-m", "speculant.cli", "serve", "--model", MODEL,
               "--host", "127.0.0.1", "--port", str(self.port), "--no-progress", *args]
        self.log = tempfile.NamedTemporaryFile("w+", prefix="speculant-server-", suffix=".log", delete=False)
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}: {self.output()}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError("server did not come up in 120 s: " + self.output())

    def output(self) -> str:
        if self.log.closed:
            return self.final_output
        self.log.flush()
        self.log.seek(0)
        return self.log.read()[-4000:]

    def server_pid(self) -> int:
        """The Python server's pid (the child of `timeout`)."""
        out = subprocess.run(["pgrep", "-P", str(self.proc.pid)], capture_output=True, text=True).stdout.split()
        return int(out[0])

    def stop(self) -> int:
        if self.proc.poll() is None:
            try:
                os.kill(self.server_pid(), 15)
            except (IndexError, ProcessLookupError):
                pass
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        if not self.log.closed:
            self.final_output = self.output()
            self.log.close()
            Path(self.log.name).unlink(missing_ok=True)
        return self.proc.returncode
