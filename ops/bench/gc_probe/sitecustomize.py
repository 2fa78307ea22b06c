"""The collector's time in every Python process started with this directory on
PYTHONPATH (a diagnostic for the benches; nothing in genpipe imports it).

    GENPIPE_GC_PROBE=/tmp/gc PYTHONPATH=$PWD/ops/bench/gc_probe python ops/bench/throughput.py ...

Each process writes GENPIPE_GC_PROBE/<pid>.txt once a second and at exit: its command
line, its CPU seconds, whether it called `gc.freeze()` (a worker's end of start-up) and,
per generation, the collections and their thread CPU seconds, counted from that freeze
when there was one, else from its start. throughput.py reads them for both sides (a
reference's workers get their worktree first on PYTHONPATH, this directory after it).
Python imports `sitecustomize` at start-up by itself: that is the whole hook.
"""

import os

if os.environ.get("GENPIPE_GC_PROBE"):
    import gc
    import sys
    import threading
    import time

    _stats = {g: [0, 0] for g in range(3)}  # generation -> [collections, ns]
    _since = [0.0, 0]  # process CPU at the reset; the collection in progress's start
    _freeze = gc.freeze

    def _on_collect(phase, info):
        if phase == "start":
            _since[1] = time.thread_time_ns()
        else:
            entry = _stats[info["generation"]]
            entry[0] += 1
            entry[1] += time.thread_time_ns() - _since[1]

    def _frozen():  # start-up is over: count from here
        _freeze()
        for entry in _stats.values():
            entry[0] = entry[1] = 0
        _since[0] = time.process_time()

    def _write():
        lines = [" ".join(sys.argv), f"cpu {time.process_time() - _since[0]:.3f} s",
                 f"frozen {int(_since[0] > 0)}"]
        lines += [f"gen{g} {n} collections {ns / 1e9:.3f} s" for g, (n, ns) in _stats.items()]
        path = os.path.join(os.environ["GENPIPE_GC_PROBE"], f"{os.getpid()}.txt")
        with open(path + ".tmp", "w") as f:
            f.write("\n".join(lines) + "\n")
        os.replace(path + ".tmp", path)

    def _every_second():
        while True:
            time.sleep(1)
            _write()

    gc.callbacks.append(_on_collect)
    gc.freeze = _frozen
    import atexit

    atexit.register(_write)
    threading.Thread(target=_every_second, daemon=True, name="gc-probe").start()
