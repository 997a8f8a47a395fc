"""Async scheduling: launch step N+1 before reading step N back.

`LLMEngine.step()` (chapter 6) schedules, launches, then waits for the
sampled tokens and records them: while the host detokenizes, checks stops and
schedules the next step, the GPU has nothing queued. With async scheduling
(on by default on a GPU) the engine launches the next step first and reads
the previous one back after, so the host's work overlaps the device's:

```
host:   schedule N+1 | launch N+1 | read N, detok N, stop N | schedule N+2 | ...
device: ...  forward N, sample N  | forward N+1, sample N+1 | ...
```

Requests sampled in step N carry a placeholder token until it is read back;
step N+1 takes its value on the device (`BatchEntry.prev_sample_row`). A
request that step N finished with a stop token or string was already
launched in step N+1: that one token is wasted and dropped. One whose
placeholder is its `max_tokens`-th token is not launched again: the count
alone says it is done.

Some rows' sampling depends on the values of their tokens so far (penalties
count them, a grammar's mask and a bad word's ban follow them): then step N
is read back after step N+1's forward is queued and before its sampler
(`sampler_needs_values`), so the host's work overlaps that forward:

```
host:   schedule N+1 | launch forward N+1 | read N, detok N, masks N+1 | launch sampler N+1 | ...
device: ... sample N | forward N+1 ...............................      | sample N+1
```

A step whose sequences speculate next is read back before N+1 is even
planned (`needs_values`): the proposer needs the tokens.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mini_vllm.engine.request_state import _Step
    from mini_vllm.outputs import RequestOutput


class AsyncScheduling:
    """`LLMEngine`'s overlapped step (the engine mixes this in; see the module docstring)."""

    _in_flight: _Step | None  # launched, not read back

    # --8<-- [start:step_async]
    def step_async(self) -> list[RequestOutput]:
        """One engine iteration that leaves the step it launched in flight."""
        outputs: list[RequestOutput] = []
        prev, self._in_flight = self._in_flight, None
        if prev is not None and prev.needs_values:
            # The proposer needs the previous tokens' values to plan: no overlap.
            outputs += self._process(prev)
            prev = None

        read_error: list[BaseException] = []

        def before_sampling() -> None:
            # The forward of the new step is queued: read the previous step back
            # while it runs, so that the new step's sampler sees its tokens. (An
            # error here is the engine's own, not the new step's: raised below.)
            nonlocal prev
            if prev is not None and prev.sampler_needs_values:
                step, prev = prev, None
                try:
                    outputs.extend(self._process(step))
                except BaseException as e:  # noqa: BLE001 - re-raised after the launch
                    read_error.append(e)

        sched = self.scheduler.schedule()
        cur = self._launch(sched, prev, before_sampling) if sched.scheduled else None
        if read_error:
            raise read_error[0]
        if cur is None:
            self._last_sampling = None  # no token drawn: the next rows start afresh
        if isinstance(cur, list):  # the step failed
            outputs += cur
            cur = None
        if prev is not None:
            outputs += self._process(prev)
        self._in_flight = cur
        return outputs
    # --8<-- [end:step_async]


__all__ = ["AsyncScheduling"]
