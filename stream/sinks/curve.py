"""ZeroMQ CURVE authentication and encryption for the publish and control endpoints.

    stream keys generate DIR NAME        writes DIR/NAME.key (public) and DIR/NAME.key_secret, as pyzmq's
                                         zmq.auth.create_certificates does
    stream run --curve-secret server.key_secret --curve-clients clients/
                                         only peers whose public .key file is in clients/ get in
    stream subscribe EP --curve-server server.key --curve-secret me.key_secret

The daemon runs pyzmq's ZAP authenticator on its event loop; an unknown key's connection is refused at the
handshake, so it receives nothing (and its subscriptions never count for --wait-subscribers).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import zmq
import zmq.asyncio

from stream.errors import ConfigError

if TYPE_CHECKING:
    from zmq.auth.asyncio import AsyncioAuthenticator

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServerKeys:
    public: bytes
    secret: bytes
    clients_dir: Path


def _load(path: str | Path, what: str, need_secret: bool) -> tuple[bytes, bytes | None]:
    import zmq.auth

    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{what} {p} does not exist; make keys with `stream keys generate DIR NAME`")
    try:
        public, secret = zmq.auth.load_certificate(p)
    except (ValueError, OSError) as exc:
        raise ConfigError(
            f"{what} {p} is not a ZeroMQ certificate ({exc}); make keys with `stream keys generate`"
        ) from exc
    if need_secret and not secret:
        raise ConfigError(f"{what} {p} holds no secret key; pass the NAME.key_secret file")
    return public, secret


def server_keys(secret_file: str, clients_dir: str) -> ServerKeys | None:
    """The daemon's keys from config; None when CURVE is off (both empty). One without the other is an error."""
    if not secret_file and not clients_dir:
        return None
    if not secret_file or not clients_dir:
        raise ConfigError("'curve_secret' and 'curve_clients' go together: give both (or neither)")
    d = Path(clients_dir)
    if not d.is_dir():
        raise ConfigError(f"'curve_clients' {d} is not a folder of client .key files")
    public, secret = _load(secret_file, "'curve_secret'", need_secret=True)
    assert secret is not None
    return ServerKeys(public, secret, d)


def make_server(sock: zmq.Socket, keys: ServerKeys | None) -> None:
    if keys is None:
        return
    sock.curve_secretkey = keys.secret
    sock.curve_publickey = keys.public
    sock.curve_server = True


def start_authenticator(ctx: zmq.asyncio.Context, keys: ServerKeys | None) -> AsyncioAuthenticator | None:
    """pyzmq's ZAP handler on the running loop, accepting the public keys in keys.clients_dir."""
    if keys is None:
        return None
    from zmq.auth.asyncio import AsyncioAuthenticator

    auth = AsyncioAuthenticator(ctx)
    auth.start()
    auth.configure_curve(domain="*", location=str(keys.clients_dir))
    n = len(list(keys.clients_dir.glob("*.key")))
    log.info("CURVE on: %d client key(s) in %s", n, keys.clients_dir)
    return auth


def make_client(sock: zmq.Socket, server_public_file: str | None, secret_file: str | None) -> None:
    """Configure a client socket for a CURVE server; both files or neither."""
    if not server_public_file and not secret_file:
        return
    if not server_public_file or not secret_file:
        raise ConfigError("--curve-server and --curve-secret go together: give both (or neither)")
    server_public, _ = _load(server_public_file, "--curve-server", need_secret=False)
    public, secret = _load(secret_file, "--curve-secret", need_secret=True)
    sock.curve_serverkey = server_public
    sock.curve_publickey = public
    sock.curve_secretkey = secret


def generate(directory: str | Path, name: str) -> tuple[Path, Path]:
    import zmq.auth

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    public, secret = zmq.auth.create_certificates(d, name)
    Path(secret).chmod(0o600)
    return Path(public), Path(secret)
