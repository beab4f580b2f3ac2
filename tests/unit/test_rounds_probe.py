"""``rounds="auto"``'s probe (``communicators/rounds.py``): blocks of ring rounds alternate between
the transports, and a transport far ahead after one block in each order ends the probe early.
Horovod's own rounds on a one-worker job, one of them held back by a sleep per round."""
from __future__ import annotations

import time

from horovod_safusion.communicators import rounds as rounds_module
from horovod_safusion.communicators.rounds import (PROBE_BLOCKS, PROBE_DECISIVE, PROBE_ROUNDS, HorovodRounds,
                                                   probe)


class Delayed:
    """Horovod's rounds under another name, each round held back by ``delay`` seconds; counts them."""

    def __init__(self, process_set, name: str, delay: float) -> None:
        self.inner, self.name, self.delay = HorovodRounds(process_set), name, delay
        self.process_set = process_set
        self.rounds = 0

    def start(self, sends, sources, name, empty):
        self.rounds += 1
        started = self.inner.start(sends, sources, name, empty)
        time.sleep(self.delay)
        return started


def test_a_transport_far_ahead_ends_the_probe_after_one_block_in_each_order(hvd):
    fast, slow = Delayed(hvd.global_process_set, "fast", 0.0), Delayed(hvd.global_process_set, "slow", 0.02)
    times = probe([slow, fast])
    per_block = PROBE_ROUNDS + 1  # with its warm-up round
    assert fast.rounds == slow.rounds == 2 * per_block
    assert times["slow"] >= 0.02 and times["slow"] >= PROBE_DECISIVE * times["fast"]


def test_transports_within_the_margin_run_every_block(hvd, monkeypatch):
    monkeypatch.setattr(rounds_module, "PROBE_DECISIVE", float("inf"))  # no lead is decisive
    a, b = Delayed(hvd.global_process_set, "a", 0.002), Delayed(hvd.global_process_set, "b", 0.002)
    times = probe([a, b])
    assert a.rounds == b.rounds == PROBE_BLOCKS * (PROBE_ROUNDS + 1)
    assert set(times) == {"a", "b"} and min(times.values()) >= 0.002
