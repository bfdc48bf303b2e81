"""The push pipeline, no I/O: gradients cut into blocks, encoded by a codec chain, with error
feedback (what a lossy chain left out is added to the next push of the block) and local
accumulation (gradients summed here and sent only when a key is due).

The client takes credit and hands the encoded push to the agent; only once it is on its way
does :meth:`PushPipeline.commit` keep the new residuals, so a push that never left changes
nothing.
"""
from __future__ import annotations

import threading

import numpy as np

from gradbus.codecs import device, net, wire
from gradbus.codecs import tensor as tcodec


class PushPipeline:
    def __init__(self, cache, error_feedback: bool | str, rng: np.random.Generator):
        if error_feedback not in (True, False, "all"):
            raise ValueError(f"error_feedback must be True, False or 'all', not {error_feedback!r}")
        self.cache = cache
        self.error_feedback = error_feedback   # True: chains that drop more than bf16 rounding
        self.rng = rng
        self.residual: dict[str, np.ndarray] = {}   # block key -> what lossy codecs left unsent
        self.acc: dict[str, list] = {}              # name -> [sum, count, chain, acks]
        self.acc_lock = threading.Lock()
        self.every, self.threshold = 1, None

    # -- encoding ---------------------------------------------------------------------------
    def encode(self, flats: dict, layouts: dict, chain: str,
               counts: dict | None = None, detach: bool = True) -> tuple[list, list, dict]:
        """``(descs, bufs, residuals)`` of a push of ``flats`` (name -> flat gradient) in
        blocks; ``counts``: name -> how many gradients a sum stands for. ``detach=False``: a
        raw block's buffer may be the caller's memory, and its checksum ``x`` is None: the
        push's shared memory (``ClientShm.place``) hashes it as it copies it into a ring slot,
        before :meth:`push` returns, or hashes it where it is."""
        lossy = (tcodec.is_lossy(chain) if self.error_feedback == "all" else
                 self.error_feedback and tcodec.drops_more_than_rounding(chain))
        descs, bufs, residuals = [], [], {}
        for name, flat in flats.items():
            layout = layouts[name]
            cnt = counts.get(name, 1) if counts else 1
            for i, key in enumerate(layout.block_keys()):
                a, b = layout.block_range(i)
                block = flat[a:b]
                on_device = device.is_device(block)
                if lossy:
                    res = self.residual.get(key)
                    if res is not None:     # kept where the gradients live
                        block = block + (device.array_module(block).asarray(res) if on_device
                                         else device.to_host(res))
                    d, buf, decoded = wire.encode_tensor_lossy(key, block, chain, self.rng)
                    residuals[key] = (block - decoded).astype(block.dtype, copy=False)
                else:
                    later = not detach and not on_device and chain == "raw"
                    d, buf = wire.encode_tensor(key, block, chain, rng=self.rng,
                                                hashed=not later)
                    if later:
                        d["x"] = None          # hashed as the ring copies it
                    elif not on_device and detach:
                        buf = net.detach(buf, flat)   # never send the caller's own memory
                if cnt != 1:
                    d["cnt"] = cnt      # the shard applies it as cnt gradients (steps of the mean)
                descs.append(d)
                bufs.append(buf)
        return descs, bufs, residuals

    def commit(self, residuals: dict) -> None:
        """The push is on its way: keep what its lossy blocks left out."""
        self.residual.update(residuals)

    # -- local accumulation -------------------------------------------------------------------
    @property
    def accumulating(self) -> bool:
        return self.every > 1 or self.threshold is not None

    def pending(self) -> bool:
        with self.acc_lock:
            return bool(self.acc)

    def configure(self, every: int, threshold: float | None) -> None:
        if not isinstance(every, int) or every < 1:
            raise ValueError("every must be a positive int")
        if threshold is not None and not threshold > 0:
            raise ValueError("threshold must be positive")
        self.every, self.threshold = every, threshold

    def add(self, flats: dict, chain: str, acks: int, stats) -> tuple[dict, dict]:
        """Sum ``flats`` into what is held; returns ``(due sums, their counts)``."""
        due, counts = {}, {}
        with self.acc_lock:
            for name, flat in flats.items():
                ent = self.acc.get(name)
                if ent is None:
                    ent = self.acc[name] = [flat.astype(flat.dtype, copy=True), 0, chain, acks]
                else:
                    ent[0] += flat
                ent[1] += 1
                ent[2], ent[3] = chain, acks
                if self._due(name, ent):
                    due[name], counts[name] = self.acc.pop(name)[:2]
            stats["accumulated"] += len(flats) - len(due)
        return due, counts

    def hold_back(self, flats: dict, counts: dict, chain: str, acks: int) -> None:
        """Sums that were due but not sent: keep them for the next push."""
        with self.acc_lock:
            for name, flat in flats.items():
                ent = self.acc.get(name)
                if ent is None:
                    self.acc[name] = [flat, counts[name], chain, acks]
                else:
                    ent[0] += flat
                    ent[1] += counts[name]

    def _due(self, name: str, ent: list) -> bool:
        if self.threshold is None:
            return ent[1] >= self.every
        if self.every > 1 and ent[1] >= self.every:
            return True
        if not self.cache.tracked(name):
            return True
        w = self.cache.tensor(name)
        if w is None:       # a block rewritten in its board, its update on the way: send it
            return True
        return float(np.linalg.norm(ent[0])) >= self.threshold * float(np.linalg.norm(w))

    def take_all(self) -> dict[tuple, dict]:
        """Everything held, emptied: ``{(chain, acks): {name: (sum, count)}}``."""
        with self.acc_lock:
            held, self.acc = self.acc, {}
        groups: dict[tuple, dict] = {}
        for name, (flat, count, chain, acks) in held.items():
            groups.setdefault((chain, acks), {})[name] = (flat, count)
        return groups

    def stats(self) -> dict:
        res = list(self.residual.values())
        return {"error_feedback_keys": len(res),
                "error_feedback_norm": float(np.sqrt(sum(float((r * r).sum()) for r in res))),
                "accumulating_keys": len(self.acc)}
