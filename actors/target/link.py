"""`RankLink`: messages between the driver rank and the other ranks of one EP unit, over the unit's
own control group (gloo point-to-point; DESIGN.md, "Where the step runs").

A message is bytes: a typed msgpack call or answer (`wire.py`: numpy arrays as raw buffers, a
closed set of dataclasses, never pickle, so nothing read from the socket can run code). It goes
out as one fixed-size frame when it fits (`FRAME` bytes: an 8-byte length, then the payload),
else as a frame holding only the length followed by the payload: one gloo message per direction
for a step plan of a few hundred requests. A frame announcing a negative length or more than
`wire.MAX_BYTES` is refused (`wire.WireError`) before anything is allocated for it. Each
direction of each pair has its own tag, and gloo keeps messages of one tag between one pair in
order.

A receive blocks in gloo (no spinning: an idle rank costs no CPU); the driver bounds its waits
for answers with a timeout, the other ranks wait for their next plan without one. A peer that
dies closes its sockets, and a pending send or receive raises at once.
"""

from __future__ import annotations

import datetime

import numpy as np
import torch

from actors.target.wire import MAX_BYTES, WireError

FRAME = 8192  # bytes of a message's first (often only) gloo message
TO_RANK, TO_DRIVER = 0, 1  # tags of the two directions


class RankLink:
    """One rank's end of the control group (`group`, a standalone gloo backend)."""

    def __init__(self, group, rank: int) -> None:
        self.group, self.rank = group, rank
        self._sending: list = []  # (work, buffer): buffers stay alive until their send completes

    def send(self, peer: int, payload: bytes) -> None:
        """Queue `payload` for `peer`; does not wait for it to be received."""
        frame = torch.zeros(FRAME, dtype=torch.uint8)
        view = frame.numpy()
        view[:8] = np.frombuffer(np.int64(len(payload)).tobytes(), dtype=np.uint8)
        tag = TO_DRIVER if self.rank else TO_RANK
        self._sending = [(w, b) for w, b in self._sending if not w.is_completed()]
        if len(payload) <= FRAME - 8:
            view[8:8 + len(payload)] = np.frombuffer(payload, dtype=np.uint8)
            self._sending.append((self.group.send([frame], peer, tag), frame))
            return
        body = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        self._sending.append((self.group.send([frame], peer, tag), frame))
        self._sending.append((self.group.send([body], peer, tag), body))

    def recv(self, peer: int, timeout_s: float | None = None) -> bytes:
        """The next message from `peer`; raises RuntimeError when the wait exceeds `timeout_s` or
        the peer is gone, and `WireError` for a frame whose length no message can have."""
        tag = TO_RANK if self.rank else TO_DRIVER
        frame = torch.empty(FRAME, dtype=torch.uint8)
        self._wait(self.group.recv([frame], peer, tag), timeout_s)
        view = frame.numpy()
        n = int(view[:8].view(np.int64)[0])
        if n < 0 or n > MAX_BYTES:
            raise WireError(f"a frame announcing {n} bytes")
        if n <= FRAME - 8:
            return view[8:8 + n].tobytes()
        body = torch.empty(n, dtype=torch.uint8)
        self._wait(self.group.recv([body], peer, tag), timeout_s)
        return body.numpy().tobytes()

    @staticmethod
    def _wait(work, timeout_s: float | None) -> None:
        if timeout_s is None:
            work.wait()
        elif not work.wait(datetime.timedelta(seconds=timeout_s)):
            raise RuntimeError(f"no answer within {timeout_s:.0f} s")
