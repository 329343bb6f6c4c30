"""Serving helpers: a loopback HTTP server thread, and a TLS context re-read on change.

:class:`ServingThread` runs a ``ThreadingHTTPServer`` on a daemon thread (the alerting
API and ``/metrics``); :class:`ReloadingTLS` is the controller listener's certificate and
key, re-read when their files change (a mounted Kubernetes Secret, cert-manager).
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import ssl
import threading
from http.server import ThreadingHTTPServer
from pathlib import Path

from core.errors import ConfigError

logger = logging.getLogger(__name__)


class ServingThread:
    """Own one HTTP server and the daemon thread that serves it."""

    def __init__(self) -> None:
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    def start(self, server: ThreadingHTTPServer, *, name: str,
              poll_interval: float = 0.5) -> int:
        """Serve ``server`` in a daemon thread called ``name``; return its bound port."""
        server.daemon_threads = True
        self._server = server
        self._thread = threading.Thread(target=server.serve_forever,
                                        kwargs={"poll_interval": poll_interval},
                                        name=name, daemon=True)
        self._thread.start()
        return int(server.server_address[1])

    def stop(self) -> None:
        """Stop serving, close the socket and join the thread; idempotent."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join(timeout=5.0)
            self._thread = None


_PEM_CERT = re.compile(r"-----BEGIN CERTIFICATE-----.+?-----END CERTIFICATE-----", re.S)
_PEM_KEY = re.compile(r"-----BEGIN ([A-Z ]*)PRIVATE KEY-----.+?-----END \1PRIVATE KEY-----",
                      re.S)


def _stamp(path: Path) -> tuple[int, int, int, int] | None:
    """What identifies a file's content: device, inode, size, mtime (``None``: unreadable).

    ``stat`` follows symlinks, so a Kubernetes ``..data`` swap shows as a new inode.
    """
    try:
        st = path.stat()
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


class ReloadingTLS:
    """A server TLS context whose certificate and key are re-read when their files change.

    Kubernetes updates a mounted Secret (cert-manager's ``tls.crt``/``tls.key``) by
    swapping its ``..data`` symlink, both files at once; an operator may rewrite them in
    place, one after the other. :meth:`reload` (the controller calls it every second)
    loads the pair into a fresh context when either file changed (device, inode, size,
    modification time) and puts it in use only if it loads: a half-written file, or a key
    that does not match the certificate, is refused with an error naming the file, and the
    certificate in use stays. :attr:`context` is what the listener is given; its SNI
    callback (called on every handshake, server name or not) hands each new handshake the
    context in use, so a new certificate needs no restart and connections already open
    keep theirs.

    Args:
        cert_file: The PEM certificate chain (leaf first).
        key_file: The PEM private key.
        where: What names the settings in messages (``"<config>: [controller]"``).

    Raises:
        ConfigError: The pair cannot be loaded at start (names the file and why).
    """

    def __init__(self, cert_file: Path, key_file: Path, *, where: str = "[controller]") -> None:
        self.cert_file = cert_file
        self.key_file = key_file
        self.where = where
        self._stamps = (_stamp(cert_file), _stamp(key_file))
        self.context = self._load()
        """The listener's context (its SNI callback picks the context in use)."""
        self._current = self.context
        self.context.sni_callback = self._select
        self.fingerprint = self._fingerprint()
        """SHA-256 of the certificate in use (hex, of its DER), for logs and tests."""
        self.reloads = 0
        """Certificates put in use since start (not counting the first)."""
        self.problem = ""
        """Why the files as they are now were refused; ``""`` while the pair in use is theirs."""

    def _select(self, sslobj: ssl.SSLObject | ssl.SSLSocket, server_name: str | None,
                context: ssl.SSLContext) -> None:
        current = self._current
        if current is not context:
            sslobj.context = current

    def _fingerprint(self) -> str:
        try:
            match = _PEM_CERT.search(self.cert_file.read_text(encoding="ascii",
                                                              errors="replace"))
        except OSError:
            return ""
        if match is None:
            return ""
        try:
            return hashlib.sha256(ssl.PEM_cert_to_DER_cert(match.group(0))).hexdigest()
        except ValueError:
            return ""

    def _load(self) -> ssl.SSLContext:
        """A fresh server context with the pair as the files hold it now.

        Raises:
            ConfigError: A file is missing or unreadable, not PEM (half-written), or the
                key does not match the certificate; the message names the file.
        """
        for key, path in (("tls_cert_file", self.cert_file), ("tls_key_file", self.key_file)):
            if not os.access(path, os.R_OK):
                why = "no such file" if not path.exists() else "cannot be read"
                raise ConfigError(f"{self.where} {key} {path}: {why}")
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        try:
            context.load_cert_chain(str(self.cert_file), str(self.key_file))
        except ssl.SSLError as exc:
            raise ConfigError(self._diagnose(exc)) from exc
        except OSError as exc:
            raise ConfigError(f"{self.where} tls_cert_file {self.cert_file} / tls_key_file "
                              f"{self.key_file}: {exc.strerror or exc}") from exc
        return context

    def _diagnose(self, exc: ssl.SSLError) -> str:
        """Which file of a pair OpenSSL refused, and why."""
        reason = exc.reason or str(exc)
        try:
            ssl.create_default_context().load_verify_locations(cafile=str(self.cert_file))
        except (ssl.SSLError, OSError) as cert_exc:
            return (f"{self.where} tls_cert_file {self.cert_file}: not a complete PEM "
                    f"certificate chain (half-written?): "
                    f"{getattr(cert_exc, 'reason', None) or cert_exc}")
        try:
            key_text = self.key_file.read_text(encoding="ascii", errors="replace")
        except OSError as key_exc:
            return f"{self.where} tls_key_file {self.key_file}: {key_exc.strerror}"
        match = _PEM_KEY.search(key_text)
        if match is None:
            return (f"{self.where} tls_key_file {self.key_file}: not a complete PEM private "
                    "key (half-written?)")
        if "ENCRYPTED" in match.group(0):
            return (f"{self.where} tls_key_file {self.key_file}: an encrypted key (the "
                    "listener needs it unencrypted)")
        # Both files are whole: the key is not the certificate's (KEY_VALUES_MISMATCH; a
        # key of another type than the certificate's: NO_CERTIFICATE_ASSIGNED).
        return (f"{self.where} tls_key_file {self.key_file} is not the key of "
                f"tls_cert_file {self.cert_file} (OpenSSL: {reason})")

    def reload(self) -> bool:
        """Load the pair again if a file changed; return whether a new one is in use.

        A pair that does not load is logged once (naming the file) and the certificate in
        use stays; the next change of either file is tried again.
        """
        stamps = (_stamp(self.cert_file), _stamp(self.key_file))
        if stamps == self._stamps:
            return False
        self._stamps = stamps  # taken before reading: a change while loading is seen next
        try:
            context = self._load()
        except ConfigError as exc:
            if str(exc) != self.problem:
                self.problem = str(exc)
                logger.error("TLS certificate not re-read: %s; the certificate in use "  # noqa: TRY400
                             "(sha256 %s) stays", exc, self.fingerprint[:16])
            return False
        self._current = context
        self.problem = ""
        self.reloads += 1
        old, self.fingerprint = self.fingerprint, self._fingerprint()
        logger.info("TLS certificate re-read from %s (sha256 %s, was %s): new connections "
                    "get it", self.cert_file, self.fingerprint[:16], old[:16])
        return True
