"""Admission: how much work the server takes in, and in what order it reaches the engine.

One API request asks for `prompts x n` sequences. The server splits them into
*units*, each one engine request (a prompt and some of its `n` choices), and
ranks them inside the request: unit 0, 1, 2 ... Unit 0 holds up to
`FIRST_UNIT_SEQS` choices of the first prompt (fewer when the batch is small);
the others up to `UNIT_SEQS` choices of one prompt.

```
request A: 1 prompt, n = 40    units  A0 (4)  A1 (16)  A2 (16)  A3 (4)
request B: 3 prompts, n = 1    units  B0 (1)  B1 (1)   B2 (1)
request C: 1 prompt,  n = 1    units  C0 (1)

engine priority = rank:   A0 B0 C0 -> 0     A1 B1 -> 1     A2 B2 -> 2     A3 -> 3
```

Unit 0 of every request goes to the engine at once, at priority 0. The other
units ("bulk") go through `FairGate`, which lets at most `bulk_capacity`
sequences of bulk into the engine at a time and hands out room by rank, then
arrival: two big requests take turns, and a quarter of the running batch is
always left to first units. The engine's scheduler orders its queue by
priority, so a small request (all of it rank 0) never waits behind the bulk of
a big one, and finds a free batch slot at once.

`Admission` bounds everything the server holds: the sequences of admitted
requests, running or not, at most `max_num_seqs + max_queued_seqs`. A request
that finds no room is answered 503 with `Retry-After`.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from dataclasses import dataclass

# Sequences of one engine request (a prompt and up to this many of its `n` choices):
# the choices of a unit share their prompt's prefill in the engine.
UNIT_SEQS = 16
# Sequences of a request's first unit, the part that goes in at once.
FIRST_UNIT_SEQS = 4
# Share of the engine's running batch that the bulk of big requests may fill.
BULK_SHARE = 0.75
# Seconds a client is told to wait (`Retry-After`) when the server is full.
RETRY_AFTER_S = 1


class ServerBusy(Exception):
    """No room for a request now; the client should retry after `retry_after` seconds."""

    def __init__(self, message: str, retry_after: int = RETRY_AFTER_S) -> None:
        super().__init__(message)
        self.retry_after = retry_after


@dataclass(frozen=True)
class Unit:
    """One engine request of an API request.

    Attributes:
        prompt_index: which prompt of the request.
        first_choice: the index (within the prompt's `n`) of its first choice.
        n: how many choices it computes.
        rank: its place within the request (0 = the first unit).
    """

    prompt_index: int
    first_choice: int
    n: int
    rank: int


def split_units(num_prompts: int, n: int, unit_seqs: int = UNIT_SEQS,
                first_unit_seqs: int = FIRST_UNIT_SEQS) -> list[Unit]:
    """The units of a request of `num_prompts` prompts with `n` choices each, prompt-major:
    at most `first_unit_seqs` sequences first (what goes in at once), then at most
    `unit_seqs` at a time."""
    units: list[Unit] = []
    for prompt_index in range(num_prompts):
        first = 0
        while first < n:
            size = min(unit_seqs if units else first_unit_seqs, n - first)
            units.append(Unit(prompt_index, first, size, len(units)))
            first += size
    return units


# --8<-- [start:fair_gate]
class FairGate:
    """A weighted semaphore that grants room by (rank, arrival), never out of turn.

    Args:
        capacity: the most weight (sequences) inside at once.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.in_use = 0
        self._waiting: list[tuple[int, int, int, asyncio.Future[None]]] = []  # a heap
        self._arrivals = itertools.count()

    async def acquire(self, weight: int, rank: int) -> None:
        """Wait until `weight` fits and no better-ranked waiter is before it.

        A weight above the capacity is admitted alone (when nothing is inside).
        Cancelling the wait gives back whatever was granted.
        """
        if not self._waiting and self._fits(weight):
            self.in_use += weight
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._waiting, (rank, next(self._arrivals), weight, future))
        try:
            await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():  # granted just before the cancel
                self.release(weight)
            else:
                future.cancel()  # _wake skips it
                self._wake()
            raise

    def release(self, weight: int) -> None:
        """Give back `weight` and let the next waiters in."""
        self.in_use -= weight
        self._wake()

    def _fits(self, weight: int) -> bool:
        return self.in_use + weight <= self.capacity or self.in_use == 0

    def _wake(self) -> None:
        while self._waiting:
            _, _, weight, future = self._waiting[0]
            if future.cancelled():
                heapq.heappop(self._waiting)
                continue
            if not self._fits(weight):
                return  # the best waiter waits; nobody overtakes it
            heapq.heappop(self._waiting)
            self.in_use += weight
            future.set_result(None)
# --8<-- [end:fair_gate]


class Ticket:
    """The room one admitted request holds; `release()` gives it back (once)."""

    def __init__(self, admission: Admission, seqs: int) -> None:
        self._admission = admission
        self.seqs = seqs

    def release(self) -> None:
        if self.seqs:
            self._admission.in_flight -= self.seqs
            self.seqs = 0


class Admission:
    """The server's bound on work in flight, and the gate for bulk units.

    Args:
        max_num_seqs: the engine's running batch (`SchedulerConfig.max_num_seqs`).
        max_queued_seqs: sequences held beyond the running batch.
        unit_seqs: the most sequences of one unit (one engine request).
    """

    def __init__(self, max_num_seqs: int, max_queued_seqs: int,
                 unit_seqs: int = UNIT_SEQS) -> None:
        self.max_in_flight = max_num_seqs + max_queued_seqs
        self.in_flight = 0
        capacity = max(1, int(max_num_seqs * BULK_SHARE))
        self.bulk = FairGate(capacity)
        # Two units at least fit the bulk's share: one starts while another runs.
        self.unit_seqs = max(1, min(unit_seqs, capacity // 2))
        # First units share the rest of the batch: one takes at most half of it.
        self.first_unit_seqs = max(1, min(FIRST_UNIT_SEQS, (max_num_seqs - capacity) // 2))

    # --8<-- [start:admit]
    def admit(self, seqs: int) -> Ticket:
        """Take in a request of `seqs` sequences, or refuse it.

        Raises:
            ValueError: the request is larger than the server can ever hold.
            ServerBusy: there is no room for it now.
        """
        if seqs > self.max_in_flight:
            raise ValueError(
                f"the request asks for {seqs} sequences (prompts x n); the server holds at most "
                f"{self.max_in_flight} (max_num_seqs + max_queued_seqs)")
        if self.in_flight + seqs > self.max_in_flight:
            raise ServerBusy(f"the server is full ({self.in_flight} sequences in flight); "
                             "retry later")
        self.in_flight += seqs
        return Ticket(self, seqs)
    # --8<-- [end:admit]


__all__ = ["BULK_SHARE", "FIRST_UNIT_SEQS", "RETRY_AFTER_S", "UNIT_SEQS", "Admission", "FairGate", "ServerBusy",
           "Ticket", "Unit", "split_units"]
