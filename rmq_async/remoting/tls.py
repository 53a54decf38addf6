"""The TLS context of a client's connections, from the options consumers and producers share.

TLS is off unless asked for. When it is on, the broker's and name server's certificates are
verified by default, as any TLS client does: against the system's trusted CAs, or against the
CA file given, with the host name (or IP address) the client connects to checked against the
certificate. Turning verification off is possible but explicit, and logged once per client.
"""

from __future__ import annotations

import os
import ssl

import structlog

from rmq_async.errors import InvalidArgumentError

__all__ = ["client_ssl_context", "verification_disabled"]

log = structlog.get_logger(__name__)


def verification_disabled(ctx: ssl.SSLContext) -> bool:
    """Whether ``ctx`` accepts a peer whose certificate it cannot verify."""
    return ctx.verify_mode == ssl.CERT_NONE


def client_ssl_context(
    *,
    tls: bool,
    tls_verify: bool = True,
    tls_ca_file: str | os.PathLike[str] | None = None,
    ssl_context: ssl.SSLContext | None = None,
    client: str = "",
) -> ssl.SSLContext | None:
    """The context for a client's connections, or ``None`` for plain TCP.

    ``ssl_context`` is used as given (it wins over the other options, which callers reject in
    combination with it). Otherwise ``tls`` turns TLS on with ``ssl.create_default_context``
    (trusting ``tls_ca_file`` when given, else the system's CAs); ``tls_verify=False`` accepts
    any certificate. A context that does not verify is reported with a
    ``tls.verification_disabled`` warning naming ``client``: call this once per client.
    """
    if ssl_context is not None:
        ctx = ssl_context
    elif not tls:
        return None
    else:
        try:
            ctx = ssl.create_default_context(
                cafile=os.fspath(tls_ca_file) if tls_ca_file is not None else None)
        except (ssl.SSLError, OSError) as exc:  # a file that holds no certificate, say
            raise InvalidArgumentError(
                f"tls_ca_file: {os.fspath(tls_ca_file or '')!r} cannot be used as CA "
                f"certificates: {exc}") from exc
        if not tls_verify:
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE
    if verification_disabled(ctx):
        log.warning(
            "tls.verification_disabled", client=client,
            detail="TLS certificates of name servers and brokers are not verified; any peer "
                   "can pose as them",
        )
    return ctx
