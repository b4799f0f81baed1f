"""What several URL schemes share: a broker's client URL, a token named by options."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from kvstream._wire.socket_security import read_token
from kvstream.errors import ConfigError

if TYPE_CHECKING:
    from kvstream.config import Options

__all__ = ["client_url", "snapshot_options", "token_from_options"]


def client_url(raw: str, scheme: str, default_port: int) -> str:
    """`scheme://[userinfo@]host:port` of a sink/source URL: what a client connects to.

    The path (subject or stream) and the query (kvstream's options) are left out;
    credentials stay (they are never shown in messages).
    """
    parts = urlsplit(raw.partition("?")[0])
    netloc = parts.netloc or f"127.0.0.1:{default_port}"
    return f"{scheme}://{netloc}"


def token_from_options(opts: Options, where: str) -> str | None:
    """The token a URL's `token_env=` or `token_file=` option names (see `read_token()`).

    A `token=` option is refused: a secret in a URL is visible to other users.
    """
    if "token" in opts:
        raise ConfigError(
            f"{where}: option token: a secret in a URL is visible to other users "
            "(ps, shell history, logs); use token_env=NAME or token_file=PATH"
        )
    return read_token(env=opts.pop_str("token_env"), file=opts.pop_str("token_file"), where=where)


def snapshot_options(opts: Options) -> dict[str, Any]:
    """The snapshot and heartbeat options of a broker sink URL, as keyword arguments.

    `snapshot_every` (batches), `snapshot_interval` (seconds),
    `snapshot_max_bytes` and `heartbeat` (seconds).
    """
    out: dict[str, Any] = {
        "snapshot_every": opts.pop_int("snapshot_every", minimum=1),
        "snapshot_interval": opts.pop_float("snapshot_interval"),
        "heartbeat": opts.pop_float("heartbeat"),
    }
    max_bytes = opts.pop_int("snapshot_max_bytes", minimum=1)
    if max_bytes is not None:
        out["snapshot_max_bytes"] = max_bytes
    return out
