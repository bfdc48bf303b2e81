"""gradbus.codecs: the bottom layer.

It owns the wire format (:mod:`.wire`) and the typed messages built from it
(:mod:`.messages`), error codes (:mod:`.errors`), the key -> partition
function and block layout (:mod:`.partition`), the tensor codec chains (:mod:`.tensor`), the
optimizer/initializer specs that travel in INIT messages (:mod:`.specs`), the named timing
constants shared by every process (:mod:`.timing`) and CurveZMQ security (:mod:`.security`).
broker/, shards/ and workers/ import it and never each other.
"""
