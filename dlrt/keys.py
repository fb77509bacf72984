"""The cluster's key directory: where the keys live, how they are made, how they are read.

One key set serves the whole runtime (docs/security.md has the threat model). The directory
is ``$DLRT_KEYS``, else ``~/.dlrt/keys``; it is mode 0700 and every secret file in it 0600:

``cluster.secret``
    32 random bytes (hex): the cluster key. pMaster and aggregators, Infiniswap's daemons
    and devices prove it to each other (``dlrt.proof``: HMAC-SHA256 over a fresh nonce); it
    never travels. Made on a service's first start when missing (``ensure_cluster_secret``).
``operator.token``
    what operator commands present (``autops migrate``, ``release``, ...). Made on first
    start when missing (``ensure_operator_token``).
``curve/server.key`` and ``curve/server.key_secret``
    the CURVE key pair every service of the cluster serves with (ZeroMQ certificate files,
    ``zmq.auth``). Clients need the public half only.
``curve/client.key`` and ``curve/client.key_secret``
    the key pair the holder of this directory connects with.
``curve/authorized/NAME.key``
    public keys allowed to connect to the cluster's services (read at every handshake, so
    adding or revoking one needs no restart).

``dlrt keys init`` makes a cluster's directory (all of the above; ``client`` is the
cluster's own members' key, authorized as ``member``); ``dlrt keys tenant NAME --out DIR``
makes a tenant's directory: a fresh client key pair and the server's public key, nothing
else, and authorizes the new public key; ``dlrt keys revoke NAME`` removes one. CURVE is on
where the directory holds the server's public key (``Keys.curve``), unless
``$DLRT_CURVE=0``.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import re
import secrets
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import zmq
import zmq.auth

__all__ = ["KeysError", "Keys", "key_dir", "init_keys", "add_tenant", "revoke", "authorized_names",
           "ensure_cluster_secret", "ensure_operator_token", "read_secret_file", "temporary_cluster",
           "fingerprint"]

CLUSTER_SECRET = "cluster.secret"
OPERATOR_TOKEN = "operator.token"
CURVE_DIR = "curve"
AUTHORIZED_DIR = "authorized"
MEMBER = "member"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


class KeysError(RuntimeError):
    """A key directory or file that is missing, unreadable or malformed (the text says which)."""


def key_dir(path: str | os.PathLike | None = None) -> Path:
    """The key directory: ``path``, else ``$DLRT_KEYS``, else ``~/.dlrt/keys``."""
    if path:
        return Path(path)
    env = os.environ.get("DLRT_KEYS")
    return Path(env) if env else Path.home() / ".dlrt" / "keys"


def _private_dir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(path, 0o700)
    return path


def _write_private(path: Path, text: str) -> None:
    """Write ``text`` to a new file readable by its owner only (never widening an old one)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text + "\n")
    try:
        os.link(tmp, path)            # first writer wins: two services starting at once agree
    except FileExistsError:
        pass
    finally:
        os.unlink(tmp)


def read_secret_file(path: str | os.PathLike) -> str:
    """The one-line secret in ``path``; ``KeysError`` when missing, empty or readable by others."""
    path = Path(path)
    try:
        st = path.stat()
        text = path.read_text().strip()
    except OSError as exc:
        raise KeysError(f"cannot read {path}: {exc.strerror or exc}") from None
    if not text:
        raise KeysError(f"{path} is empty")
    if st.st_mode & 0o077:
        raise KeysError(f"{path} is readable by other users (mode {st.st_mode & 0o777:o}): chmod 600 it")
    return text


def _ensure_secret(name: str, make, path: str | os.PathLike | None) -> str:
    directory = _private_dir(key_dir(path))
    target = directory / name
    if not target.exists():
        _write_private(target, make())
    return read_secret_file(target)


def ensure_cluster_secret(path: str | os.PathLike | None = None) -> bytes:
    """The cluster key (32 bytes), made in the key directory at the first call if missing."""
    text = _ensure_secret(CLUSTER_SECRET, lambda: secrets.token_hex(32), path)
    try:
        secret = bytes.fromhex(text)
    except ValueError:
        raise KeysError(f"{key_dir(path) / CLUSTER_SECRET} is not hex") from None
    if len(secret) < 16:
        raise KeysError(f"{key_dir(path) / CLUSTER_SECRET} is too short ({len(secret)} bytes; at least 16)")
    return secret


def ensure_operator_token(path: str | os.PathLike | None = None) -> str:
    """The operator token, made in the key directory at the first call if missing."""
    return _ensure_secret(OPERATOR_TOKEN, lambda: secrets.token_urlsafe(32), path)


def check_name(name: str) -> str:
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(f"bad key name {name!r}: letters, digits, '_', '.', '-' (at most 64)")
    return name


@dataclass(frozen=True)
class Keys:
    """What one process holds of the key directory (CURVE keys as z85 bytes)."""

    directory: Path
    server_public: bytes | None
    server_secret: bytes | None
    client_public: bytes | None
    client_secret: bytes | None

    @property
    def curve(self) -> bool:
        """Whether ZeroMQ channels over tcp run CURVE: the directory holds the server's public
        key and ``$DLRT_CURVE`` is not ``0``."""
        return self.server_public is not None and os.environ.get("DLRT_CURVE", "1") != "0"

    @property
    def authorized_dir(self) -> Path:
        return self.directory / CURVE_DIR / AUTHORIZED_DIR

    @classmethod
    def load(cls, path: str | os.PathLike | None = None) -> "Keys":
        """The keys in the key directory (the CURVE halves that are there; none is fine)."""
        directory = key_dir(path)
        curve = directory / CURVE_DIR
        server_public, server_secret = _load_pair(curve / "server.key", curve / "server.key_secret")
        client_public, client_secret = _load_pair(curve / "client.key", curve / "client.key_secret")
        if server_public is not None and (client_public is None or client_secret is None):
            raise KeysError(f"{curve} has the server's key but no client key pair (client.key_secret): "
                            "make it with `dlrt keys init` or `dlrt keys tenant`")
        return cls(directory, server_public, server_secret, client_public, client_secret)

    def require_server(self) -> None:
        if self.server_secret is None:
            raise KeysError(f"CURVE is on but {self.directory / CURVE_DIR / 'server.key_secret'} is missing: "
                            "a service needs the cluster's server key (`dlrt keys init`, copied to every "
                            "service host)")


def _load_pair(public_file: Path, secret_file: Path) -> tuple[bytes | None, bytes | None]:
    if secret_file.exists():
        if secret_file.stat().st_mode & 0o077:
            raise KeysError(f"{secret_file} is readable by other users: chmod 600 it")
        try:
            return zmq.auth.load_certificate(secret_file)
        except (OSError, ValueError) as exc:
            raise KeysError(f"cannot read the key pair {secret_file}: {exc}") from None
    if public_file.exists():
        try:
            return zmq.auth.load_certificate(public_file)[0], None
        except (OSError, ValueError) as exc:
            raise KeysError(f"cannot read the public key {public_file}: {exc}") from None
    return None, None


def fingerprint(path: str | os.PathLike | None = None) -> str | None:
    """What tells two machines' key directories apart without showing a secret: 12 hex digits
    of SHA-256 over the cluster key and the CURVE server's public key (None: no cluster key
    there). Machines of one cluster must show the same one."""
    directory = key_dir(path)
    try:
        secret = (directory / CLUSTER_SECRET).read_bytes().strip()
    except OSError:
        return None
    try:
        public = (directory / CURVE_DIR / "server.key").read_bytes()
    except OSError:
        public = b""
    return hashlib.sha256(secret + b"\0" + public).hexdigest()[:12]


def _new_pair(directory: Path, name: str) -> None:
    """A fresh CURVE key pair as ``directory/name.key`` (+ ``.key_secret``, 0600)."""
    _, secret_file = zmq.auth.create_certificates(str(directory), name)
    os.chmod(secret_file, 0o600)


def _authorize(directory: Path, name: str, public_file: Path) -> Path:
    """Accept the public key in ``public_file`` as ``name``: a copy in ``curve/authorized``."""
    authorized = _private_dir(directory / CURVE_DIR / AUTHORIZED_DIR)
    target = authorized / f"{check_name(name)}.key"
    target.write_text(public_file.read_text())
    return target


def init_keys(path: str | os.PathLike | None = None, force: bool = False) -> Path:
    """Make a cluster's key directory: cluster key, operator token, CURVE server and member
    key pairs, the member's key authorized. Existing files are kept unless ``force``."""
    directory = _private_dir(key_dir(path))
    curve = _private_dir(directory / CURVE_DIR)
    if force:
        for name in (CLUSTER_SECRET, OPERATOR_TOKEN):
            (directory / name).unlink(missing_ok=True)
        for name in ("server.key", "server.key_secret", "client.key", "client.key_secret"):
            (curve / name).unlink(missing_ok=True)
    ensure_cluster_secret(directory)
    ensure_operator_token(directory)
    if not (curve / "server.key_secret").exists():
        _new_pair(curve, "server")
    if not (curve / "client.key_secret").exists():
        _new_pair(curve, "client")
    _authorize(directory, MEMBER, curve / "client.key")
    return directory


def add_tenant(name: str, out: str | os.PathLike, path: str | os.PathLike | None = None) -> Path:
    """Make tenant ``name``'s key directory at ``out`` (its own client key pair and the
    server's public key, no cluster secret) and authorize its key in the cluster's."""
    check_name(name)
    if name == MEMBER:
        raise ValueError(f"{MEMBER!r} is the cluster's own members' key name")
    directory = key_dir(path)
    server_public = directory / CURVE_DIR / "server.key"
    if not server_public.exists():
        raise KeysError(f"{directory} has no CURVE server key: run `dlrt keys init` first")
    out_curve = _private_dir(Path(out) / CURVE_DIR)
    if (out_curve / "client.key_secret").exists():
        raise KeysError(f"{out_curve} already holds a client key pair")
    (out_curve / "server.key").write_text(server_public.read_text())
    _new_pair(out_curve, "client")
    _authorize(directory, name, out_curve / "client.key")
    return Path(out)


def revoke(name: str, path: str | os.PathLike | None = None) -> bool:
    """Stop accepting tenant ``name``'s key; whether it was authorized."""
    target = key_dir(path) / CURVE_DIR / AUTHORIZED_DIR / f"{check_name(name)}.key"
    try:
        target.unlink()
    except FileNotFoundError:
        return False
    return True


def authorized_names(path: str | os.PathLike | None = None) -> list[str]:
    """The names of the authorized public keys."""
    authorized = key_dir(path) / CURVE_DIR / AUTHORIZED_DIR
    return sorted(p.stem for p in authorized.glob("*.key")) if authorized.is_dir() else []


@contextlib.contextmanager
def temporary_cluster(curve: bool = True) -> Iterator[Path]:
    """A fresh cluster key directory that ``$DLRT_KEYS`` points at until exit, for this
    process and every process it starts (tests, benchmarks, demos on emulated hosts). With
    ``curve`` it holds CURVE keys (``init_keys``); without, only what a first start makes, and
    ``$DLRT_CURVE=0`` keeps every channel plaintext. Removed on exit."""
    directory = Path(tempfile.mkdtemp(prefix="dlrt-keys-"))
    saved = {name: os.environ.get(name) for name in ("DLRT_KEYS", "DLRT_CURVE")}
    if curve:
        init_keys(directory)
        os.environ.pop("DLRT_CURVE", None)
    else:
        os.environ["DLRT_CURVE"] = "0"
    os.environ["DLRT_KEYS"] = str(directory)
    try:
        yield directory
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        shutil.rmtree(directory, ignore_errors=True)
