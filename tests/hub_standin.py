"""A STAND-IN for the Hugging Face Hub's write API, for tests only (no installable server accepts uploads).

It implements exactly the endpoints huggingface_hub calls to create a repository, commit regular files and tag:

- ``POST /api/repos/create`` (JSON ``{"name", "organization", "type", "visibility"}``) -> ``{"url"}``; 409 when it
  exists (the client's ``exist_ok`` handles that),
- ``POST /api/{type}s/{org}/{repo}/preupload/{revision}`` (JSON ``{"files": [{"path", "sample", "size"}]}``) ->
  every file ``uploadMode: regular`` (so the test needs no LFS/Xet server),
- ``POST /api/{type}s/{org}/{repo}/commit/{revision}`` (NDJSON: a ``header`` line, then ``file`` lines with base64
  content) -> ``{"commitUrl", "commitOid"}``; files are stored in memory, one list entry per commit,
- ``POST /api/validate-yaml`` (sent before a commit that adds README.md) -> ``{}``,
- ``GET /api/{type}s/{org}/{repo}/refs`` -> branches and tags; ``POST .../tag/{revision}`` (JSON ``{"tag"}``).

Every request is recorded (method, path, content type, parsed body, whether a Bearer token came) so a contract test
can pin what the client sends; ``fail(path_part, status, times)`` makes the next matching requests fail with a
JSON error whose message quotes the request's Authorization header (to prove opskit scrubs it). Anything else is 404.
"""

from __future__ import annotations

import base64
import hashlib
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@dataclass
class Recorded:
    method: str
    path: str
    content_type: str
    body: object
    authorized: bool


@dataclass
class HubStandIn:
    repos: dict[str, dict[str, bytes]] = field(default_factory=dict)
    commits: list[dict] = field(default_factory=list)
    tags: dict[str, dict[str, str]] = field(default_factory=dict)  # repo key -> tag -> commit id
    snapshots: dict[str, dict[str, bytes]] = field(default_factory=dict)  # commit id -> the repo's files then
    requests: list[Recorded] = field(default_factory=list)
    failures: list[list] = field(default_factory=list)  # [path_part, status, times left]
    lock: threading.Lock = field(default_factory=threading.Lock)
    endpoint: str = ""

    def fail(self, path_part: str, status: int, times: int = 1) -> None:
        with self.lock:
            self.failures.append([path_part, status, times])

    def _injected(self, path: str) -> int | None:
        with self.lock:
            for failure in self.failures:
                if failure[0] in path and failure[2] > 0:
                    failure[2] -= 1
                    return failure[1]
        return None

    def handle(self, method: str, path: str, headers, raw: bytes) -> tuple[int, dict]:
        content_type = headers.get("Content-Type", "")
        if "ndjson" in content_type:
            body = [json.loads(line) for line in raw.splitlines() if line.strip()]
        else:
            body = json.loads(raw) if raw else None
        auth = headers.get("Authorization", "")
        with self.lock:
            self.requests.append(Recorded(method, path.split("?")[0], content_type.split(";")[0], body,
                                          auth.startswith("Bearer ")))
        if (status := self._injected(path)) is not None:
            return status, {"error": f"injected failure for request with Authorization: {auth}"}
        parts = path.split("?")[0].strip("/").split("/")
        if method == "POST" and parts == ["api", "validate-yaml"]:
            return 200, {}
        if method == "POST" and parts[:3] == ["api", "repos", "create"]:
            repo_id = f"{body['organization']}/{body['name']}"
            key = f"{body.get('type', 'model')}:{repo_id}"
            if key in self.repos:
                return 409, {"error": "You already created this repo", "url": f"{self.endpoint}/{repo_id}"}
            self.repos[key] = {}
            return 200, {"url": f"{self.endpoint}/{repo_id}"}
        key = f"{parts[1][:-1]}:{parts[2]}/{parts[3]}" if len(parts) >= 5 and parts[0] == "api" else ""
        if method == "GET" and len(parts) == 5 and parts[4] == "refs":
            if key not in self.repos:
                return 404, {"error": "Repository not found"}
            tags = [{"name": t, "ref": f"refs/tags/{t}", "targetCommit": c} for t, c in self.tags.get(key, {}).items()]
            return 200, {"branches": [], "converts": [], "tags": tags}
        if method == "POST" and len(parts) == 6 and parts[4] == "tag":
            if body["tag"] in self.tags.setdefault(key, {}):
                return 409, {"error": "tag exists"}
            self.tags[key][body["tag"]] = parts[5]
            return 200, {}
        if method == "POST" and len(parts) == 6 and parts[0] == "api" and parts[4] in ("preupload", "commit"):
            if key not in self.repos:
                return 404, {"error": "Repository not found"}
            if parts[4] == "preupload":
                return 200, {"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False}
                                       for f in body["files"]]}
            return self._commit(key, body)
        return 404, {"error": f"stand-in: no such endpoint {method} {path}"}

    def _commit(self, key: str, lines: list[dict]) -> tuple[int, dict]:
        files = self.repos[key]
        changed = {}
        for line in lines[1:]:
            if line["key"] == "file":
                changed[line["value"]["path"]] = base64.b64decode(line["value"]["content"])
            elif line["key"] == "deletedFile":
                files.pop(line["value"]["path"], None)
                changed.pop(line["value"]["path"], None)
        files.update(changed)
        oid = hashlib.sha1(json.dumps([lines[0], sorted(changed)]).encode() + bytes(len(self.commits))).hexdigest()
        self.commits.append({"repo": key, "summary": lines[0]["value"]["summary"], "files": sorted(changed)})
        self.snapshots[oid] = dict(files)
        return 200, {"commitUrl": f"{self.endpoint}/{key.split(':')[1]}/commit/{oid}", "commitOid": oid}


def serve(hub: HubStandIn) -> ThreadingHTTPServer:
    """Start ``hub`` on 127.0.0.1 on a free port, in a daemon thread; ``hub.endpoint`` is set to its URL."""

    class Handler(BaseHTTPRequestHandler):
        def _reply(self, method: str) -> None:
            raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            status, payload = hub.handle(method, self.path, self.headers, raw)
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_POST(self):  # noqa: N802 - http.server's naming
            self._reply("POST")

        def do_GET(self):  # noqa: N802
            self._reply("GET")

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    hub.endpoint = f"http://127.0.0.1:{server.server_address[1]}"
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server
