"""Tokens, TLS and bind checks for kvstream's listeners (socket sink, HTTP servers).

Secure by default:

* a TCP sink binds `127.0.0.1` unless told otherwise, and refuses any other
  address without a token;
* a token is read from an environment variable or a file, never from a URL or
  a command line (which other users can read in `ps`), and it never appears
  in a log line, an error message or a `repr`;
* tokens are compared in constant time (`token_matches()`).
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import os
import ssl
import stat

from kvstream.errors import ConfigError

__all__ = [
    "bearer_authorized",
    "check_listen_address",
    "client_ssl_context",
    "is_loopback",
    "read_token",
    "server_ssl_context",
]

log = logging.getLogger("kvstream.wire")


def is_loopback(host: str) -> bool:
    """True for `localhost` and loopback addresses (127.0.0.0/8, ::1)."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to anything


def check_listen_address(
    host: str, token: str | None, where: str, how: str = "--token-env NAME or --token-file PATH"
) -> None:
    """Refuse to listen beyond loopback without a token (every kvstream listener)."""
    if token is None and not is_loopback(host):
        raise ConfigError(
            f"{where}: listening on {host} (not loopback) needs a token: "
            f"set {how} (or listen on 127.0.0.1)"
        )


def bearer_authorized(authorization: str | None, token: str | None) -> bool:
    """Does an HTTP `Authorization` header carry `Bearer <token>`? Constant time.

    Always True when no token is set (a loopback-only listener).
    """
    if token is None:
        return True
    scheme, _, credential = (authorization or "").strip().partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(
        credential.strip().encode("utf-8"), token.encode("utf-8")
    )


def read_token(*, env: str | None, file: str | None, where: str) -> str | None:
    """The shared secret from `$env` or the file `file` (one line), or None.

    Raises `ConfigError` when the variable is unset or empty, the file
    cannot be read or is empty, or both are given. The token itself is never
    part of a message.
    """
    if env is not None and file is not None:
        raise ConfigError(f"{where}: give token_env or token_file, not both")
    if env is not None:
        if not env:
            raise ConfigError(f"{where}: token_env: expected an environment variable name")
        value = os.environ.get(env)
        if not value:
            raise ConfigError(f"{where}: token_env: environment variable {env} is unset or empty")
        return value
    if file is not None:
        try:
            with open(file, "rb") as f:
                mode = os.fstat(f.fileno()).st_mode
                raw = f.read(4097)
        except OSError as exc:
            raise ConfigError(f"{where}: token_file: cannot read {file}: {exc.strerror}") from exc
        if stat.S_IMODE(mode) & 0o077:
            log.warning("%s: token file %s is readable by other users (chmod 600 it)", where, file)
        try:
            value = raw.decode("utf-8").strip()
        except UnicodeDecodeError:
            raise ConfigError(f"{where}: token_file: {file} is not UTF-8 text") from None
        if not value:
            raise ConfigError(f"{where}: token_file: {file} is empty")
        if len(value) > 4096:
            raise ConfigError(f"{where}: token_file: {file}: expected at most 4096 characters")
        return value
    return None


def server_ssl_context(cert: str, key: str | None, *, where: str) -> ssl.SSLContext:
    """A TLS server context from a PEM certificate (chain) and its key."""
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(
            f"{where}: tls_cert/tls_key: cannot load {cert}"
            + (f" / {key}" if key else "")
            + f": {exc}"
        ) from exc
    return ctx


def client_ssl_context(ca: str | None, *, where: str) -> ssl.SSLContext:
    """A TLS client context trusting `ca` (a PEM file), or the system's CAs."""
    try:
        ctx = ssl.create_default_context(cafile=ca)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"{where}: tls_ca: cannot load {ca}: {exc}") from exc
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    return ctx
