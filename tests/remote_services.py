"""Real local servers for the remote-target tests: the GCS emulator (``gcp-storage-emulator``, PyPI), olah (a Hub
mirror, PyPI, serving local git repos), and a forwarding proxy that injects HTTP errors in front of either."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            urllib.request.urlopen(url, timeout=2)
            return
        except urllib.error.HTTPError:
            return  # it answers
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def start_gcs_emulator(data_dir: Path) -> tuple[subprocess.Popen, str]:
    """``gcp-storage-emulator start`` on a free port (in memory); (process, endpoint URL)."""
    port = free_port()
    exe = Path(sys.executable).with_name("gcp-storage-emulator")
    proc = subprocess.Popen([str(exe), "-d", str(data_dir), "start", "--host", "127.0.0.1", "--port", str(port),
                             "--in-memory", "-q"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"
    wait_http(endpoint + "/storage/v1/b")
    return proc, endpoint


def olah_cli() -> str | None:
    """olah's command: ``$OPSKIT_OLAH`` (its own venv: olah pins packages that clash with opskit's), PATH, or the
    Makefile's ``.venv-olah``."""
    for candidate in (os.environ.get("OPSKIT_OLAH"), shutil.which("olah-cli"),
                      str(Path(__file__).parents[1] / ".venv-olah" / "bin" / "olah-cli")):
        if candidate and Path(candidate).is_file():
            return candidate
    return None


def start_olah(mirror_root: Path, work: Path) -> tuple[subprocess.Popen, str]:
    """olah in offline mode serving the git repos under ``mirror_root`` (``datasets/<org>/<repo>``)."""
    port = free_port()
    work.mkdir(parents=True, exist_ok=True)
    config = work / "olah.toml"
    config.write_text(f'[basic]\nhost = "127.0.0.1"\nport = {port}\nmirror-netloc = "127.0.0.1:{port}"\n'
                      f'mirror-lfs-netloc = "127.0.0.1:{port}"\nmirrors-path = ["{mirror_root}"]\n'
                      f'repos-path = "{work / "repos"}"\n[accessibility]\noffline = true\n')
    proc = subprocess.Popen([olah_cli(), "-c", str(config)], cwd=work, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"
    wait_http(endpoint + "/api/datasets/none/none", timeout=60)
    return proc, endpoint


class FaultProxy:
    """Forwards every request to ``upstream``; ``fail(part, status, times, skip)`` lets ``skip`` requests whose path
    contains ``part`` through, then answers the next ``times`` of them with ``status``. ``seen`` counts forwarded
    requests. ``delay_s`` holds every request that long first (a network round trip, for benchmarks)."""

    def __init__(self, upstream: str, delay_s: float = 0.0):
        self.upstream, self.rules, self.seen, self.lock = upstream, [], 0, threading.Lock()
        self.delay_s = delay_s
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _forward(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                time.sleep(proxy.delay_s)
                status = proxy._injected(self.path)
                if status is not None:
                    data = b'{"error": {"code": %d, "message": "injected"}}' % status
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                    return
                with proxy.lock:
                    proxy.seen += 1
                headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "content-length")}
                request = urllib.request.Request(proxy.upstream + self.path, data=body if body else None,
                                                 headers=headers, method=self.command)
                try:
                    response = urllib.request.urlopen(request, timeout=60)
                except urllib.error.HTTPError as e:
                    response = e
                data = response.read()
                self.send_response(response.status if hasattr(response, "status") else response.code)
                for key, value in response.headers.items():
                    if key.lower() not in ("transfer-encoding", "content-length", "connection"):
                        self.send_header(key, value)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = _forward  # noqa: N815

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def fail(self, part: str, status: int, times: int = 1, skip: int = 0) -> None:
        with self.lock:
            self.rules.append({"part": part, "status": status, "times": times, "skip": skip})

    def _injected(self, path: str) -> int | None:
        with self.lock:
            for rule in self.rules:
                if rule["part"] in path and rule["skip"] > 0:
                    rule["skip"] -= 1
                elif rule["part"] in path and rule["times"] > 0:
                    rule["times"] -= 1
                    return rule["status"]
        return None

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
