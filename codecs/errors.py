"""Error codes carried in ERROR messages, and the exception types that map to them.

A code is a short stable string; the numeric value is for metrics and exit statuses.
"""
from __future__ import annotations

import enum


class Code(str, enum.Enum):
    BAD_FRAME = "BAD_FRAME"                # not msgpack, not a map, wrong frame count
    BAD_VERSION = "BAD_VERSION"            # unsupported protocol version
    UNKNOWN_KIND = "UNKNOWN_KIND"          # message kind not known to the receiver
    BAD_FIELD = "BAD_FIELD"                # a header field missing or of the wrong type
    BAD_DTYPE = "BAD_DTYPE"                # dtype not in the allow-list
    BAD_SHAPE = "BAD_SHAPE"                # shape invalid or not matching the bytes
    TOO_LARGE = "TOO_LARGE"                # decoded size above the cap
    BAD_CHECKSUM = "BAD_CHECKSUM"          # tensor bytes do not match the checksum
    BAD_CODEC = "BAD_CODEC"                # unknown or inconsistent codec chain, or undecodable data
    UNKNOWN_KEY = "UNKNOWN_KEY"            # the key was never initialised
    SHAPE_MISMATCH = "SHAPE_MISMATCH"      # init of an existing key with another shape/dtype
    SHARD_UNAVAILABLE = "SHARD_UNAVAILABLE"  # the shard owning the key is dead or absent
    BROKER_UNAVAILABLE = "BROKER_UNAVAILABLE"  # the broker is silent past its liveness (client-side)
    SECURITY = "SECURITY"                  # a CURVE key file that cannot be used, or a handshake
                                           # the broker refused (client-side, never on the wire)
    NO_SHARDS = "NO_SHARDS"                # no live shard to place a new partition on
    NOT_FINITE = "NOT_FINITE"              # NaN or Inf in a gradient
    BAD_REQUEST = "BAD_REQUEST"            # well-formed but not acceptable
    NOT_REGISTERED = "NOT_REGISTERED"      # a shard spoke before registering (or after being
                                           # declared dead): it must send REGISTER again
    STALE = "STALE"                        # a push computed on weights older than its tensor's
                                           # consistency model allows (ssp refuse, bsp)
    RECOVERING = "RECOVERING"              # a restarted broker is still learning its table from
                                           # its shards: try again shortly (the SDK resends)
    BUSY = "BUSY"                          # the broker holds its byte cap of tensor data: a push
                                           # or init not accepted, to be sent again after a
                                           # back-off (the SDK does; nothing was kept)
    FENCED = "FENCED"                      # a shard spoke for a partition it no longer holds
                                           # (failed over while it was away): refused, counted
    FORBIDDEN = "FORBIDDEN"                # the sender's CURVE key lacks the role the message
                                           # needs (shard, client, operator): refused, counted
    SHARD_ID_IN_USE = "SHARD_ID_IN_USE"    # a REGISTER for a shard id alive on another
                                           # connection: refused, counted
    SHM_TORN = "SHM_TORN"                  # a reply's bytes in a shard's shared memory were
                                           # rewritten before they were read whole: ask again
                                           # (with frames); nothing was used
    NOT_ACTIVE = "NOT_ACTIVE"              # a standby broker of a pair: the sender tries the
                                           # next broker it knows (protocol section 23)
    MOVED = "MOVED"                        # a broker tier member that does not hold the name:
                                           # the message names the member that does
                                           # (protocol section 24)
    INTERNAL = "INTERNAL"                  # a bug: the receiver failed handling a valid message


class GradbusError(Exception):
    """Base of every error gradbus raises to a user."""

    code: Code = Code.INTERNAL

    def __init__(self, message: str, code: Code | str | None = None):
        super().__init__(message)
        if code is not None:
            self.code = Code(code) if code in Code._value2member_map_ else code  # type: ignore[assignment]

    def __str__(self) -> str:  # "CODE: message"
        code = self.code.value if isinstance(self.code, Code) else self.code
        return f"{code}: {self.args[0]}"


class WireError(GradbusError):
    """A message failed validation; ``code`` says which rule."""

    def __init__(self, code: Code, message: str):
        super().__init__(message, code)


class ShardUnavailableError(GradbusError):
    code = Code.SHARD_UNAVAILABLE


class UnknownKeyError(GradbusError, KeyError):
    code = Code.UNKNOWN_KEY

    def __str__(self) -> str:  # KeyError would repr() the message
        return GradbusError.__str__(self)


class BackPressureError(GradbusError):
    """The client's credit window stayed full for the whole timeout."""

    code = Code.BAD_REQUEST


class BrokerUnavailableError(GradbusError):
    """The broker has been silent past its liveness window."""

    code = Code.BROKER_UNAVAILABLE


class SecurityError(GradbusError):
    """A CURVE key file that cannot be used, or a connection the broker refused: a key not in
    its allow directory, CURVE on one side only, or a wrong server key."""

    code = Code.SECURITY


class StaleError(GradbusError):
    """A push computed on weights too old for its tensor's consistency model: pull fresher
    weights and compute again."""

    code = Code.STALE


class MovedError(GradbusError):
    """A write went to a broker tier member that does not hold its tensor or table: the
    message names the member that does (``gradbus.connect`` to any member routes by itself)."""

    code = Code.MOVED


class ClosedError(GradbusError):
    """The client was closed."""


def error_from(code: str, message: str) -> GradbusError:
    """Build the exception a user sees for an ERROR reply."""
    if code == Code.SHARD_UNAVAILABLE or code == Code.NO_SHARDS:
        return ShardUnavailableError(message, code)
    if code == Code.UNKNOWN_KEY:
        return UnknownKeyError(message)
    if code == Code.STALE:
        return StaleError(message)
    if code == Code.MOVED:
        return MovedError(message)
    return GradbusError(message, code)
