"""Named timing constants shared by broker, shards and clients.

Time is always read from an injected monotonic clock (``time.monotonic`` by default); these are
the defaults for the intervals measured on it. A peer is declared dead after ``LIVENESS``
intervals without hearing anything from it.
"""
HEARTBEAT_INTERVAL = 0.25   # seconds between heartbeats, both ways
LIVENESS = 4                # missed intervals before a peer is declared dead (1.0 s by default)
RECONNECT_MIN = 0.2         # first reconnect back-off (seconds), doubled per failure ...
RECONNECT_MAX = 2.0         # ... up to this
CLIENT_LIVENESS = 20        # a worker silent for this many intervals is forgotten (5 s)
