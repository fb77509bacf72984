"""A small client of the master's HTTP API, used by the ``tiresias`` client commands.

It finds the master through a state dir (``STATE/master.json`` has the URL, ``STATE/token``
the operator's bearer token, or a user's token file instead) or through an explicit URL
and token file.
"""
from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from typing import Any


class ClientError(RuntimeError):
    """The master refused the request (``status`` 400/401/403/404) or could not be reached (0)."""

    def __init__(self, message: str, status: int = 0) -> None:
        super().__init__(message)
        self.status = status


def normalize_url(address: str) -> str:
    address = address.strip().rstrip("/")
    if address.startswith("tcp://"):
        address = address[len("tcp://"):]
    if "://" not in address:
        address = "http://" + address
    return address


class Client:
    def __init__(self, url: str, token: str, timeout: float = 30.0) -> None:
        self.url = normalize_url(url)
        self.token = token
        self.timeout = timeout

    @classmethod
    def from_state(cls, state_dir: str, token_file: str | None = None) -> "Client":
        """The master of ``state_dir``, with the token of ``token_file`` (default: STATE/token)."""
        try:
            with open(os.path.join(state_dir, "master.json")) as f:
                url = json.load(f)["url"]
        except (OSError, ValueError, KeyError):
            raise ClientError(f"no master address in {state_dir}/master.json (is a master running with "
                              f"--state {state_dir}?)") from None
        return cls(url, read_token(token_file or os.path.join(state_dir, "token")))

    def request(self, method: str, path: str, body: Any = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method)
        req.add_header("Authorization", f"Bearer {self.token}")
        if data is not None:
            req.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                return json.loads(resp.read() or b"null")
        except urllib.error.HTTPError as exc:
            try:
                message = json.loads(exc.read()).get("error", exc.reason)
            except (ValueError, AttributeError):
                message = exc.reason
            raise ClientError(str(message), exc.code) from None
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise ClientError(f"cannot reach the master at {self.url}: {reason}") from None

    def get(self, path: str) -> Any:
        return self.request("GET", path)

    def post(self, path: str, body: Any = None) -> Any:
        return self.request("POST", path, {} if body is None else body)


def read_token(path: str) -> str:
    try:
        with open(path) as f:
            token = f.read().strip()
    except OSError as exc:
        raise ClientError(f"cannot read the token file {path}: {exc.strerror}") from None
    if not token:
        raise ClientError(f"the token file {path} is empty")
    return token
