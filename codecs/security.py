"""CurveZMQ for every gradbus socket: key files, socket setup, the broker's allow list and the
errors a refused handshake becomes.

CURVE is off unless a process is given a key pair. With it on:

* the broker's three sockets (frontend, backend, events) are CURVE servers
  (:func:`server_setup`) and a ZAP handler (:class:`Authenticator`, a thread in the broker's
  context) admits only the public keys found in its allow directory;
* shards, clients and ops commands are CURVE clients (:func:`client_setup`): they hold their
  own key pair and the broker's public key. All traffic is encrypted and authenticated.

Key files are pyzmq's (``zmq.auth.create_certificates``): ``NAME.key`` holds the public key,
``NAME.key_secret`` the public and the secret key. :func:`generate` writes a pair with the
secret file readable by its owner only.

Roles: a public key file in the allow directory says what its key may do in the metadata line
``roles = "shard client operator"`` (any of the three). ``shard``: the backend (REGISTER and
everything a shard sends); ``client``: a worker's requests (init, push, snapshot, rows,
catalog, status, digest); ``operator``: those and the ops commands that change the cluster
(``checkpoint``, ``admin`` rebalance and drain). HELLO is open to every admitted key. A key
file without a ``roles`` line is a legacy entry: it has every role, and the broker logs one
warning per such file. :func:`permits` is the table the broker checks each message against.
"""
from __future__ import annotations

import dataclasses
import glob
import logging
import os
import re
import struct
import time
from collections.abc import Mapping

import zmq
import zmq.auth
from zmq.utils import z85

from . import wire
from .errors import SecurityError

log = logging.getLogger("gradbus.security")

#: The ZAP domain of every gradbus CURVE server socket (the authenticator answers for it).
ZAP_DOMAIN = "gradbus"
PAIR_ZAP_DOMAIN = "gradbus-pair"    # a broker pair's link: only the brokers' own key
PUBLIC_SUFFIX = ".key"
SECRET_SUFFIX = ".key_secret"
#: The SDK's default key pair and broker key, when ``connect(curve=None)``.
ENV_SECRET = "GRADBUS_SECURITY_CURVE_SECRET"
ENV_SERVER_KEY = "GRADBUS_SECURITY_CURVE_SERVER_KEY"

_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
           | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)


@dataclasses.dataclass(frozen=True, repr=False)
class Curve:
    """One process's CURVE settings. Keys are Z85 text (40 characters) as bytes.

    ``public``/``secret``: this process's key pair. ``server_key``: the broker's public key
    (clients and shards). ``allow``: the directory of admitted public keys (the broker)."""

    public: bytes
    secret: bytes
    server_key: bytes | None = None
    allow: str | None = None

    @classmethod
    def from_files(cls, secret: str | os.PathLike, server_key: str | os.PathLike | None = None,
                   allow: str | os.PathLike | None = None) -> "Curve":
        """Load ``secret`` (a ``NAME.key_secret`` file), the broker's public key file
        ``server_key`` (a ``NAME.key``) and check the ``allow`` directory exists."""
        public, sec = load_secret(secret)
        server = load_public(server_key) if server_key is not None else None
        if allow is not None:
            allow = os.fspath(allow)
            if not os.path.isdir(allow):
                raise SecurityError(f"CURVE allow directory {allow} does not exist")
        return cls(public, sec, server, allow)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "Curve | None":
        """From ``$GRADBUS_SECURITY_CURVE_SECRET`` and ``$GRADBUS_SECURITY_CURVE_SERVER_KEY``,
        or None when neither is set (CURVE off)."""
        environ = os.environ if environ is None else environ
        secret, server = environ.get(ENV_SECRET), environ.get(ENV_SERVER_KEY)
        if not secret and not server:
            return None
        if not (secret and server):
            raise SecurityError(f"set both {ENV_SECRET} and {ENV_SERVER_KEY} (or neither)")
        return cls.from_files(secret, server)

    def __repr__(self) -> str:   # never the secret key
        return (f"Curve(public={self.public.decode()!r}, server_key="
                f"{self.server_key.decode() if self.server_key else None!r}, allow={self.allow!r})")


def _read(path) -> tuple[bytes, bytes | None]:
    path = os.fspath(path)
    try:
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as e:
        raise SecurityError(f"cannot read CURVE key file {path}: {e}") from None
    for key in (public, secret):
        if key is None:
            continue
        try:
            if len(key) != 40 or len(z85.decode(key)) != 32:
                raise ValueError
        except (ValueError, KeyError, IndexError, struct.error):
            raise SecurityError(f"{path}: a CURVE key is 40 characters of Z85") from None
    if secret is not None and zmq.curve_public(secret) != public:
        raise SecurityError(f"{path}: its public key is not the one of its secret key")
    return public, secret


def load_secret(path) -> tuple[bytes, bytes]:
    """``(public, secret)`` from a ``NAME.key_secret`` file."""
    public, secret = _read(path)
    if secret is None:
        raise SecurityError(f"{os.fspath(path)} holds no secret key: give the "
                            f"NAME{SECRET_SUFFIX} file")
    return public, secret


def load_public(path) -> bytes:
    """The public key from a ``NAME.key`` file. A file that also holds a secret key is
    refused: a peer's secret key has no business outside that peer."""
    public, secret = _read(path)
    if secret is not None:
        raise SecurityError(f"{os.fspath(path)} holds a secret key: give the public "
                            f"NAME{PUBLIC_SUFFIX} file")
    return public


def generate(directory: str | os.PathLike, name: str, force: bool = False,
             roles=None) -> tuple[str, str]:
    """Write ``NAME.key`` and ``NAME.key_secret`` (mode 0600) in ``directory`` (made if
    missing); returns their paths. Existing files are kept unless ``force``. With ``roles``
    (names from :data:`ROLES`) the public file says them (its ``roles`` metadata line), so a
    copy of it in the broker's allow directory grants exactly those."""
    roles = check_roles(roles) if roles is not None else None
    if not name or name.startswith(".") or os.sep in name or (os.altsep and os.altsep in name):
        raise SecurityError(f"bad key name {name!r}: a file name without a path")
    directory = os.fspath(directory)
    os.makedirs(directory, exist_ok=True)
    public = os.path.join(directory, name + PUBLIC_SUFFIX)
    secret = os.path.join(directory, name + SECRET_SUFFIX)
    if not force:
        for p in (public, secret):
            if os.path.exists(p):
                raise SecurityError(f"{p} exists (use --force to replace it)")
    # The secret file is created 0600 before a key is written into it (pyzmq's writer
    # truncates the file and keeps its mode).
    os.close(os.open(secret, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600))
    os.chmod(secret, 0o600)
    zmq.auth.create_certificates(directory, name)
    os.chmod(secret, 0o600)
    if roles is not None:
        write_public(public, load_public(public), roles)
    return public, secret


# -- roles -----------------------------------------------------------------------------------

SHARD, CLIENT, OPERATOR = "shard", "client", "operator"
#: What a key in the allow directory may be: a shard, a client (worker), an operator.
ROLES = (SHARD, CLIENT, OPERATOR)
ALL_ROLES = frozenset(ROLES)
#: Frontend kinds only an operator may send: they change the cluster or write its data.
OPERATOR_KINDS = frozenset({wire.CHECKPOINT, wire.ADMIN})
#: Frontend kinds every admitted key may send: discovery (shards use it too), and STATUS, which
#: only reads (every container's healthcheck asks it with that container's own key).
OPEN_KINDS = frozenset({wire.HELLO, wire.STATUS})
_ROLES_LINE = re.compile(r'^\s*roles\s*=\s*"?([^"\n]*)"?\s*$', re.MULTILINE)


def check_roles(roles) -> frozenset[str]:
    """``roles`` as a frozenset, or SecurityError naming an unknown one."""
    out = frozenset(roles)
    bad = sorted(out - ALL_ROLES)
    if bad or not out:
        raise SecurityError(f"roles must be some of {', '.join(ROLES)}, not "
                            f"{', '.join(bad) or 'none'}")
    return out


def permits(roles: frozenset[str] | None, backend: bool, kind: str) -> bool:
    """Whether a message of ``kind`` (on the backend or the frontend) from a key with
    ``roles`` is acted on. ``None``: CURVE off, nobody is authenticated, everything goes."""
    if roles is None:
        return True
    if backend:
        return SHARD in roles
    if kind in OPEN_KINDS:
        return bool(roles)
    if kind in OPERATOR_KINDS:
        return OPERATOR in roles
    return CLIENT in roles or OPERATOR in roles


def needs(backend: bool, kind: str) -> str:
    """The role(s) a message of ``kind`` needs, in words (for the refusal's message)."""
    if backend:
        return "the shard role"
    if kind in OPERATOR_KINDS:
        return "the operator role"
    return "the client or operator role"


def read_roles(path) -> frozenset[str] | None:
    """The roles a public key file names (its ``roles`` metadata line), or None when it names
    none (a legacy file). Unknown role names are SecurityError."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()
    except OSError as e:
        raise SecurityError(f"cannot read CURVE key file {os.fspath(path)}: {e}") from None
    m = _ROLES_LINE.search(text.split("\ncurve", 1)[0])
    if m is None:
        return None
    try:
        return check_roles(m.group(1).replace(",", " ").split())
    except SecurityError as e:
        raise SecurityError(f"{os.fspath(path)}: {e.args[0]}") from None


def write_public(path, public: bytes, roles) -> str:
    """Write a public key file holding ``public`` with a ``roles`` line (what the broker's
    allow directory reads); returns its path."""
    roles = check_roles(roles)
    path = os.fspath(path)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write("#   ****  gradbus CURVE public key  ****\n\nmetadata\n"
                f'    roles = "{" ".join(r for r in ROLES if r in roles)}"\n'
                f'curve\n    public-key = "{public.decode()}"\n')
    os.replace(tmp, path)
    return path


def grant(allow_dir: str | os.PathLike, public_file: str | os.PathLike, roles) -> str:
    """Admit the key of ``public_file`` to an allow directory with ``roles``: writes
    ``ALLOW/NAME.key`` (NAME from the file) naming them; returns its path."""
    os.makedirs(allow_dir, exist_ok=True)
    return write_public(os.path.join(os.fspath(allow_dir), os.path.basename(
        os.fspath(public_file))), load_public(public_file), roles)


# -- sockets ---------------------------------------------------------------------------------

def server_setup(sock: zmq.Socket, curve: Curve, domain: str = ZAP_DOMAIN) -> zmq.Socket:
    """Make ``sock`` a CURVE server under the gradbus ZAP domain (before it binds)."""
    sock.curve_secretkey = curve.secret
    sock.curve_publickey = curve.public
    sock.curve_server = True
    sock.zap_domain = domain.encode()
    return sock


def client_setup(sock: zmq.Socket, curve: Curve) -> zmq.Socket:
    """Make ``sock`` a CURVE client of the broker (before it connects)."""
    if curve.server_key is None:
        raise SecurityError("a CURVE client needs the broker's public key (--curve-server-key)")
    sock.curve_serverkey = curve.server_key
    sock.curve_publickey = curve.public
    sock.curve_secretkey = curve.secret
    return sock


def _events(mon: zmq.Socket):
    """The ``(event, value)`` pairs waiting on a monitor socket."""
    while True:
        try:
            frames = mon.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            return
        if len(frames) == 2 and len(frames[0]) == 6:
            yield struct.unpack("=HI", frames[0])


class HandshakeWatch:
    """Watches a client socket's handshakes, so a refused connection becomes a clear
    :class:`SecurityError` instead of a silent timeout. Create it before ``connect``.

    A refused key (ZAP status 400) and a security mechanism mismatch are reported by libzmq as
    such and fail at once. Which side notices a mismatch first is a race, though, and a wrong
    server key shows only as the broker dropping the connection, which a broker closing
    mid-handshake also causes: those fail after ``limit`` of them (None: never)."""

    def __init__(self, sock: zmq.Socket, curve: Curve | None, url: str, failures: int = 0,
                 limit: int | None = 3, closing: bool = False, refusals: bool = False):
        """``closing``: also count the connection's closings (:attr:`closed`), for a socket
        that can have no other monitor; ``refusals``: its refused connection attempts
        (:attr:`refused`: nothing listens there)."""
        self.sock, self.curve, self.url, self.limit = sock, curve, url, limit
        self.mon = sock.get_monitor_socket(_FAILED
                                           | (zmq.EVENT_DISCONNECTED if closing else 0)
                                           | (zmq.EVENT_CONNECT_RETRIED if refusals else 0))
        self.mon.linger = 0
        self.failures = failures   # failed handshakes so far (carried over from earlier sockets)
        self.closed = self.refused = 0

    def check(self) -> None:
        """Raise :class:`SecurityError` if the handshakes so far say the broker refuses us."""
        for event, value in _events(self.mon):
            if event == zmq.EVENT_DISCONNECTED:
                self.closed += 1
                continue
            if event == zmq.EVENT_CONNECT_RETRIED:
                self.refused += 1
                continue
            if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                raise SecurityError(
                    f"the broker at {self.url} refused this process's CURVE key "
                    f"{self.curve.public.decode() if self.curve else ''}: its public key file "
                    f"is not in the broker's allow directory (--curve-allow)")
            mismatch = value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH
            self.failures += 1
            if mismatch or (self.limit is not None and self.failures >= self.limit):
                raise SecurityError(self._message(mismatch))

    def _message(self, mismatch: bool) -> str:
        if self.curve is None:
            return (f"the broker at {self.url} requires CURVE: give this process its key "
                    f"pair (--curve-secret) and the broker's public key (--curve-server-key)")
        if mismatch:
            return f"the broker at {self.url} does not use CURVE: connect without keys"
        return (f"the CURVE handshake with the broker at {self.url} failed: is the server key "
                f"given (--curve-server-key) the broker's public key, and is CURVE on there?")

    def poll(self, timeout_ms: int) -> bool:
        """Wait up to ``timeout_ms`` for the socket to be readable; raises on a failed
        handshake. A watch that counts refusals returns False as soon as one is counted
        (nothing listens there: no reply will come)."""
        deadline = time.monotonic() + timeout_ms / 1000
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self.mon, zmq.POLLIN)
        while True:
            ready = dict(poller.poll(max(0, int((deadline - time.monotonic()) * 1000))))
            if self.mon in ready:
                self.check()
            if self.sock in ready:
                return True
            if self.refused or time.monotonic() >= deadline:
                return False

    def close(self) -> None:
        self.sock.disable_monitor()
        self.mon.close(linger=0)


class FailureCounter:
    """Counts failed handshakes on the broker's CURVE server sockets: a key not in the allow
    directory (``curve_denied``) and anything else, such as a client without CURVE or with a
    wrong server key (``curve_handshake_failed``)."""

    def __init__(self, socks):
        self.socks = list(socks)
        self.mons = [s.get_monitor_socket(_FAILED) for s in self.socks]
        for m in self.mons:
            m.linger = 0

    def drain(self, errors) -> None:
        for mon in self.mons:
            for event, _ in _events(mon):
                errors["curve_denied" if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH
                       else "curve_handshake_failed"] += 1

    def close(self) -> None:
        for s, m in zip(self.socks, self.mons):
            if not s.closed:
                s.disable_monitor()
            m.close(linger=0)


# -- the broker's allow list -------------------------------------------------------------

class AllowList:
    """The public keys in a directory's ``*.key`` files and the roles each file names: a ZAP
    credentials provider (``callback(domain, key)``). It rereads the directory whenever the
    directory changes (a key file added, removed or renamed), so keys can be added and revoked
    while the broker runs. :meth:`roles_of` answers for the ZAP user id (the Z85 public key)
    libzmq attaches to every message of an authenticated connection."""

    def __init__(self, directory: str):
        self.directory = directory
        self.keys: frozenset[bytes] = frozenset()
        self.roles: dict[str, frozenset[str]] = {}    # Z85 public key (text) -> its roles
        self._mtime: int | None = None
        self._refused: set[bytes] = set()
        self._legacy_warned: set[str] = set()
        self.reload()

    def reload(self) -> None:
        mtime = os.stat(self.directory).st_mtime_ns
        roles: dict[str, frozenset[str]] = {}
        for path in sorted(glob.glob(os.path.join(glob.escape(self.directory),
                                                  "*" + PUBLIC_SUFFIX))):
            try:
                key = _read(path)[0].decode()
                named = read_roles(path)
            except SecurityError as e:
                log.warning("skipping %s", e)
                continue
            if named is None:
                named = ALL_ROLES
                if path not in self._legacy_warned:
                    self._legacy_warned.add(path)
                    log.warning("%s names no roles: its key may act as shard, client and "
                                "operator (add a line roles = \"...\" under metadata, or "
                                "make it with gradbus keys generate --role)", path)
            roles[key] = roles.get(key, frozenset()) | named
        keys = {k.encode() for k in roles}
        self.keys, self.roles, self._mtime = frozenset(keys), roles, mtime
        if not keys:
            log.warning("no public keys in %s: every CURVE client will be refused",
                        self.directory)

    def callback(self, domain: str, key: bytes) -> bool:
        try:
            if os.stat(self.directory).st_mtime_ns != self._mtime:
                self.reload()
        except OSError as e:   # keep the last list rather than admit or refuse everyone
            log.warning("cannot reread the CURVE allow directory: %s", e)
        ok = key in self.keys
        if not ok:
            # warn once per key, so a client retrying does not flood the log
            (log.debug if key in self._refused else log.warning)(
                "refused CURVE key %s: not in %s", key.decode(errors="replace"), self.directory)
            self._refused.add(key)
        return ok

    def roles_of(self, user_id: str | None) -> frozenset[str]:
        """The roles of an authenticated connection's user id (its Z85 public key); none for
        a key no longer in the directory."""
        return self.roles.get(user_id, frozenset()) if user_id else frozenset()


class Authenticator:
    """The broker's ZAP handler: pyzmq's ``ThreadAuthenticator`` (thread ``gradbus-zap``)
    answering for :data:`ZAP_DOMAIN` from an :class:`AllowList`. Start it before the CURVE
    sockets bind and stop it before the context terminates. One per context."""

    def __init__(self, ctx: zmq.Context, allow_dir: str):
        from zmq.auth.thread import ThreadAuthenticator
        self.allow = AllowList(allow_dir)
        self._auth = ThreadAuthenticator(ctx, log=logging.getLogger("gradbus.zap"))
        self._auth.configure_curve_callback(ZAP_DOMAIN, self.allow)

    def admit_pair(self, public: bytes) -> None:
        """A broker pair's link (:data:`PAIR_ZAP_DOMAIN`) admits one key: the brokers' own
        (both brokers of a pair hold one key pair)."""
        self._auth.configure_curve_callback(PAIR_ZAP_DOMAIN, _OneKey(public))

    def start(self) -> "Authenticator":
        self._auth.start()
        self._auth.thread.name = "gradbus-zap"
        return self

    def stop(self) -> None:
        self._auth.stop()


class _OneKey:
    def __init__(self, public: bytes):
        self.public = public

    def callback(self, domain: str, key: bytes) -> bool:
        if key != self.public:
            log.warning("refused CURVE key %s on the pair link: not this broker's",
                        key.decode(errors="replace"))
        return key == self.public


# -- a local cluster's keys ------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class ClusterKeys:
    """Key files for a local cluster: one pair each for the broker, the shards and a client,
    and the allow directory holding the shard's public key (role shard) and the client's (roles
    client and operator: a local cluster's one client key serves workers and ops commands)."""

    directory: str

    def path(self, name: str, secret: bool = False) -> str:
        return os.path.join(self.directory, name + (SECRET_SUFFIX if secret else PUBLIC_SUFFIX))

    @property
    def allow(self) -> str:
        return os.path.join(self.directory, "allowed")

    def client(self) -> Curve:
        """The client's settings (for the SDK and ops commands)."""
        return Curve.from_files(self.path("client", True), self.path("broker"))

    @classmethod
    def ensure(cls, directory: str | os.PathLike) -> "ClusterKeys":
        """Generate what is missing in ``directory`` (existing keys are reused)."""
        keys = cls(os.fspath(directory))
        os.makedirs(keys.allow, exist_ok=True)
        for name in ("broker", "shard", "client"):
            if not os.path.exists(keys.path(name, True)):
                generate(keys.directory, name, force=True)
            elif not os.path.exists(keys.path(name)):
                raise SecurityError(f"{keys.path(name, True)} has no {name}{PUBLIC_SUFFIX} "
                                    f"next to it")
        for name, roles in (("shard", {SHARD}), ("client", {CLIENT, OPERATOR})):
            allowed = os.path.join(keys.allow, name + PUBLIC_SUFFIX)
            if (not os.path.exists(allowed) or load_public(allowed) != load_public(keys.path(name))
                    or read_roles(allowed) != roles):
                grant(keys.allow, keys.path(name), roles)
        return keys


__all__ = ["Curve", "SecurityError", "generate", "load_secret", "load_public", "server_setup",
           "client_setup", "HandshakeWatch", "FailureCounter", "AllowList", "Authenticator",
           "ClusterKeys", "ZAP_DOMAIN", "ROLES", "permits", "grant", "read_roles",
           "write_public"]
