"""Where a step's tokens spend their time between the engine and the producer, in every
genpipe process started with this directory on PYTHONPATH (a diagnostic for the
benches; nothing in genpipe imports it).

    GENPIPE_HOP_PROBE=/tmp/hops PYTHONPATH=$PWD/ops/bench/hop_probe \\
        python ops/bench/throughput.py ... --each-alone
    python ops/bench/hop_probe/report.py /tmp/hops

Each process appends one line per event to GENPIPE_HOP_PROBE/<pid>.tsv. Every time is
wall-clock ns (the engine stamps `sampled_at_ns` with that clock, and all processes share
it), and a step's lines are keyed by its `sampled_at_ns`:
- `out  sampled  enter  written`: the engine process's outbox takes a step (the token
  holder, workers/generate/token_holder.py), and has written what it hands on;
- `in  sampled  read  handled`: the worker's event loop read the bytes that completed the
  step's frame, and handed the step to the handler (`on_outputs`);
- `pub  sampled  start  publish  done  records`: that step's publish task began, called
  `Publisher.publish_batch` (after the publish lock and taking the chunk records), and
  had its batches queued in the producer;
- `admit  0  start  end  admitted`: the worker moved waiting requests into the engine;
- `slow  0  start  end  callback`: a generate worker's event-loop callback of 1 ms or more
  (a task's step is named by its coroutine). Only on asyncio's own loop
  (`--generate-args '--event-loop asyncio'`): uvloop's handles are not Python's;
- `gc  0  start  end  generation`: a garbage collection of 0.5 ms or more.
The wrappers are patched in as the modules are imported (a meta path hook), so the
code measured is the checkout's own. Writing a line costs a few µs per step.
"""

import os

if os.environ.get("GENPIPE_HOP_PROBE"):
    import contextvars
    import importlib.abc
    import sys
    import time

    _clock = time.time_ns
    _file = None
    _step = contextvars.ContextVar("hop_probe_step", default=0)  # the step a publish task is for
    _marks = contextvars.ContextVar("hop_probe_marks", default=None)  # a publish task's publish_batch call
    _read = [0]  # when the worker's loop last read from the engine's pipe

    def _line(*fields) -> None:
        global _file
        if _file is None:
            path = os.path.join(os.environ["GENPIPE_HOP_PROBE"], f"{os.getpid()}.tsv")
            _file = open(path, "a", buffering=1)  # a line at a time: the child ends with os._exit
        _file.write("\t".join(str(f) for f in fields) + "\n")

    def _patch_outbox(module) -> None:
        """The engine child's outbox (engine_child.py; engine_process.py before 2026-12-04)."""
        outbox_send = module.Outbox._send

        def _send(self, message, *args, **kwargs):
            if self.holder is None or not isinstance(message, module.Step):
                return outbox_send(self, message, *args, **kwargs)
            enter = _clock()
            outbox_send(self, message, *args, **kwargs)
            _line("out", message.outputs.sampled_at_ns, enter, _clock())

        module.Outbox._send = _send

    def _patch_engine_process(module) -> None:
        if hasattr(module, "Outbox"):  # (older code)
            _patch_outbox(module)
        reader_received = module.StepReader.data_received

        def data_received(self, data):
            _read[0] = _clock()
            reader_received(self, data)

        module.StepReader.data_received = data_received

    def _patch_worker(module) -> None:
        on_outputs = module.GenerateHandler.on_outputs

        def wrapped(self, step):
            handled = _clock()
            _line("in", step.sampled_at_ns, _read[0], handled)
            token = _step.set(step.sampled_at_ns)  # the publish task copies this context
            try:
                return on_outputs(self, step)
            finally:
                _step.reset(token)

        module.GenerateHandler.on_outputs = wrapped

        admit = module.GenerateHandler._admit

        def timed_admit(self):
            before, start = len(self.inflight), _clock()
            refused = admit(self)
            if len(self.inflight) > before:
                _line("admit", 0, start, _clock(), len(self.inflight) - before)
            return refused

        module.GenerateHandler._admit = timed_admit
        _time_loop_callbacks()

    def _time_loop_callbacks() -> None:
        """Every event-loop callback of 1 ms or more in the generate worker: what held the
        loop while a step waited in the pipe."""
        import asyncio
        import asyncio.events

        run = asyncio.events.Handle._run

        def timed_run(self):
            start = _clock()
            run(self)
            end = _clock()
            if end - start >= 1_000_000:
                callback = self._callback
                owner = getattr(callback, "__self__", None)
                name = getattr(callback, "__qualname__", repr(callback))
                if isinstance(owner, asyncio.Task):
                    coro = owner.get_coro()
                    name = getattr(coro, "__qualname__", repr(coro))
                _line("slow", 0, start, end, name.replace("\t", " "))

        asyncio.events.Handle._run = timed_run

    def _patch_publish_steps(module) -> None:
        run = module.PublishSteps.run

        async def wrapped(self, finals):
            start = _clock()
            marks = []
            _marks.set(marks)  # (this task's own context)
            await run(self, finals)
            if marks:
                _line("pub", _step.get(), start, marks[0], _clock(), marks[1])

        module.PublishSteps.run = wrapped

    def _patch_publisher(module) -> None:
        publish_batch = module.Publisher.publish_batch

        async def wrapped(self, records, *args, **kwargs):  # (the derender's call passes own_topics)
            marks = _marks.get()
            if marks is not None and not marks:
                marks += [_clock(), len(records)]
            return await publish_batch(self, records, *args, **kwargs)

        module.Publisher.publish_batch = wrapped

    import gc

    _gc_start = [0]

    def _on_collect(phase, info):  # every collection of 0.5 ms or more, in every process
        if phase == "start":
            _gc_start[0] = _clock()
        elif _clock() - _gc_start[0] >= 500_000:
            _line("gc", 0, _gc_start[0], _clock(), info["generation"])

    gc.callbacks.append(_on_collect)

    _PATCHES = {"workers.generate.engine_process": _patch_engine_process,
                "workers.generate.engine_child": _patch_outbox,
                "workers.generate.worker": _patch_worker,
                "workers.generate.publish_steps": _patch_publish_steps,
                "workers.kafka.publisher": _patch_publisher}

    class _Finder(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            patch = _PATCHES.get(name)
            if patch is None:
                return None
            for finder in sys.meta_path:
                if finder is self:
                    continue
                spec = getattr(finder, "find_spec", lambda *a: None)(name, path, target)
                if spec is not None:
                    break
            else:
                return None
            loader_exec = spec.loader.exec_module

            def exec_module(module):
                loader_exec(module)
                patch(module)

            spec.loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, _Finder())
