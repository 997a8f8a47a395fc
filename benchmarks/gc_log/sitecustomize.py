"""Log the cyclic garbage collector's pauses in every Python process of a run.

Python imports a module named `sitecustomize` at start-up from the first directory
of `sys.path` that has one, so putting this directory first on `PYTHONPATH` loads
it into the benchmark, the server it launches and the engine process that server
spawns, which all inherit the variable. With `GC_PAUSE_LOG` set to a file, each
process appends to it a line for every collection that took more than 3 ms (its
pid, the wall time, the generation, the pause, the objects it freed), and at exit
a summary per generation: (collections, total ms, longest ms). A process that
leaves through `os._exit`, as the engine process does, writes no summary.

    GC_PAUSE_LOG=gc.log PYTHONPATH=benchmarks/gc_log:. \\
        python benchmarks/serving.py --launch --request-rates inf --num-requests 256

Without `GC_PAUSE_LOG` it does nothing.
"""

import atexit
import gc
import os
import sys
import time

_log = os.environ.get("GC_PAUSE_LOG")
if _log:
    _t = [0.0]
    _stats = {0: [0, 0.0, 0.0], 1: [0, 0.0, 0.0], 2: [0, 0.0, 0.0]}

    def _write(line: str) -> None:
        with open(_log, "a") as f:
            f.write(f"{os.getpid()} {line}\n")

    def _on_collection(phase: str, info: dict) -> None:
        if phase == "start":
            _t[0] = time.perf_counter()
            return
        pause = time.perf_counter() - _t[0]
        s = _stats[info["generation"]]
        s[0] += 1
        s[1] += pause
        s[2] = max(s[2], pause)
        if pause > 0.003:
            _write(f"{time.time():.3f} gen{info['generation']} {pause * 1e3:.1f}ms "
                   f"collected={info['collected']}")

    gc.callbacks.append(_on_collection)

    def _summary() -> None:
        per_gen = {g: (n, round(t * 1e3, 1), round(m * 1e3, 1)) for g, (n, t, m) in _stats.items()}
        _write("summary " + " ".join(sys.argv[:3]) + " " + repr(per_gen))

    atexit.register(_summary)
