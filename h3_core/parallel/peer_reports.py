"""Failures told through the rendezvous store, so a rank whose collective lost a peer can say which rank failed
and why. A rank on another machine (`python -m h3_core.parallel`) has no queue to the caller; without this, its
failure reached the caller only as rank 0 losing its connection."""

from __future__ import annotations

import json
import socket
import threading
import time
from datetime import timedelta

import torch.distributed as dist

KEY = "h3_failure/{rank}"
STORE_TIMEOUT = timedelta(seconds=5)  # a failing rank's store calls: its host may be gone, and the rank exits next
PEER_WAIT_S = 2.0  # how long a rank that lost a peer waits for the peer's report (it is written before exiting)
# a store whose host stopped answering without closing the connection blocks reads past their timeout: the whole
# exchange is given this long, then the rank exits without it
EXCHANGE_LIMIT_S = PEER_WAIT_S + 2 * STORE_TIMEOUT.total_seconds()
LOST_PEER_WORDS = ("closed by peer", "reset by peer", "broken pipe", "remote process exited", "connection refused",
                   "communicator was aborted", "watchdog")
DIST_ERRORS = ("DistError", "DistBackendError", "DistNetworkError", "DistStoreError")


def lost_a_peer(error: BaseException | str) -> bool:
    """Whether `error` (or its "Type: message" summary) is a collective that broke because another rank went away
    (gloo: 'Connection closed by peer'; NCCL: its watchdog's DistBackendError)."""
    text = str(error) if isinstance(error, BaseException) else error
    return (isinstance(error, dist.DistError) or text.startswith(DIST_ERRORS)
            or any(words in text.lower() for words in LOST_PEER_WORDS))


def forget(store: dist.Store, rank: int) -> None:
    """Drop a report left under this rank in an earlier run on the same store (under torchrun, env:// meets in the
    agent's store, which outlives a run; the runner's own stores are new for each)."""
    store.delete_key(KEY.format(rank=rank))


def exchange(store: dist.Store | None, rank: int, world: int, device: str, error: BaseException,
             summary: str) -> list[tuple[int, str, str]]:
    """Leave this rank's failure in the store and, if its collective lost a peer, return what the others reported:
    (rank, where, summary), the ranks that failed on their own first. Best effort, bounded by EXCHANGE_LIMIT_S."""
    if store is None or world < 2:
        return []
    lost = lost_a_peer(error)
    found: list[tuple[int, str, str]] = []

    def run() -> None:
        try:
            store.set_timeout(STORE_TIMEOUT)
            store.set(KEY.format(rank=rank), json.dumps({"where": f"{device} of {socket.gethostname()}",
                                                         "summary": summary, "lost_peer": lost}))
            if lost:
                found.extend(_peer_failures(store, rank, world, PEER_WAIT_S))
        except Exception:  # noqa: BLE001  the store went with its host (rank 0's process): nothing to tell or read
            pass

    worker = threading.Thread(target=run, name="h3-peer-reports", daemon=True)
    worker.start()
    worker.join(EXCHANGE_LIMIT_S)
    return list(found) if not worker.is_alive() else []


def _peer_failures(store: dist.Store, rank: int, world: int, wait_s: float) -> list[tuple[int, str, str]]:
    deadline = time.monotonic() + wait_s
    while True:
        told = {}
        for other in range(world):
            key = KEY.format(rank=other)
            if other != rank and store.check([key]):
                told[other] = json.loads(store.get(key))
        own = [other for other, report in told.items() if not report["lost_peer"]]
        if own or time.monotonic() >= deadline:  # a rank that failed on its own comes first, else the rank order
            order = sorted(told, key=lambda other: (other not in own, other))
            return [(other, told[other]["where"], told[other]["summary"]) for other in order]
        time.sleep(0.1)
