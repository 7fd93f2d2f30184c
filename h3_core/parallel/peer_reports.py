"""Failures told through the rendezvous store, so a rank whose collective lost a peer can say which rank failed
and why. A rank on another machine (`python -m h3_core.parallel`) has no queue to the caller; without this, its
failure reached the caller only as rank 0 losing its connection."""

from __future__ import annotations

import json
import socket
import time
from datetime import timedelta

import torch.distributed as dist

KEY = "h3_failure/{rank}"
STORE_TIMEOUT = timedelta(seconds=5)  # a failing rank's store calls: its host may be gone, and the rank exits next
PEER_WAIT_S = 2.0  # how long a rank that lost a peer waits for the peer's report (it is written before exiting)
LOST_PEER_WORDS = ("closed by peer", "reset by peer", "broken pipe", "remote process exited", "connection refused")


def report(store: dist.Store | None, rank: int, device: str, summary: str) -> None:
    """Leave this rank's failure in the store for its peers; best effort (the store's host may be gone)."""
    if store is None:
        return
    try:
        store.set_timeout(STORE_TIMEOUT)
        store.set(KEY.format(rank=rank), json.dumps({"where": f"{device} of {socket.gethostname()}",
                                                     "summary": summary}))
    except Exception:  # noqa: BLE001  a report that cannot be left is no reason to hide the failure itself
        pass


def lost_a_peer(error: BaseException) -> bool:
    """Whether `error` is a collective that broke because another rank went away (gloo: 'Connection closed by
    peer'; NCCL: its watchdog's DistBackendError)."""
    text = str(error).lower()
    return isinstance(error, dist.DistError) or any(words in text for words in LOST_PEER_WORDS)


def peer_failures(store: dist.Store | None, rank: int, world: int, wait_s: float = 0.0) -> list[tuple[int, str, str]]:
    """(rank, where, summary) of every other rank that reported a failure, waiting up to `wait_s` for the first."""
    if store is None or world < 2:
        return []
    deadline = time.monotonic() + wait_s
    while True:
        found = []
        try:
            store.set_timeout(STORE_TIMEOUT)
            for other in range(world):
                key = KEY.format(rank=other)
                if other != rank and store.check([key]):
                    told = json.loads(store.get(key))
                    found.append((other, told["where"], told["summary"]))
        except Exception:  # noqa: BLE001  the store went with its host (rank 0's process): nothing to read
            return []
        if found or time.monotonic() >= deadline:
            return found
        time.sleep(0.1)
