"""The CPU time of the processes a bench measures, from /proc: a process's own, its
children (the generate worker's engine child), the collector's share (ops/bench/gc_probe),
and every broker of a cluster that runs on this machine (found by its listening port).
Used by ops/bench/throughput.py."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

from workers.kafka.settings import KafkaSettings


TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of one process (not its children)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def listening_pid(port: int) -> int | None:
    """The process listening on TCP `port` on this machine (a local broker), from /proc;
    None when none is (a broker elsewhere) or it cannot be seen."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()  # local address "IP:PORT" in hex, state 0A = LISTEN, inode
            if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(f"socket:[{fields[9]}]")
    for proc in Path("/proc").iterdir():
        if inodes and proc.name.isdigit():
            try:
                if any(os.readlink(fd) in inodes for fd in (proc / "fd").iterdir()):
                    return int(proc.name)
            except OSError:
                continue  # (gone, or not ours to read)
    return None


async def broker_ports(settings: KafkaSettings) -> list[int]:
    """The client port of every broker in the cluster (its metadata), so the CPU of all the
    local ones is counted, whichever of them --bootstrap-servers names."""
    from aiokafka.admin import AIOKafkaAdminClient

    admin = AIOKafkaAdminClient(**settings.client_kwargs())
    await admin.start()
    try:
        return sorted(int(broker["port"]) for broker in (await admin.describe_cluster())["brokers"])
    finally:
        await admin.close()


def broker_pids(settings: KafkaSettings) -> list[int]:
    """The processes of the cluster's brokers that run on this machine (none: `n/a`)."""
    return sorted({pid for port in asyncio.run(broker_ports(settings)) if (pid := listening_pid(port)) is not None})


def collector_seconds(pid: int, since: float) -> float | None:
    """The collector's CPU seconds in process `pid` since its start-up ended, from
    ops/bench/gc_probe (when GENPIPE_GC_PROBE is set), once its file is newer than
    `since` (it is written every second); None without the probe, or for a process that
    never froze (an engine child before workers/generate/engine_process.py did)."""
    if not os.environ.get("GENPIPE_GC_PROBE"):
        return None
    path = Path(os.environ["GENPIPE_GC_PROBE"]) / f"{pid}.txt"
    deadline = time.time() + 5
    while not path.exists() or path.stat().st_mtime < since:
        if time.time() > deadline:
            return None
        time.sleep(0.1)  # polling for the probe's next write
    lines = path.read_text().splitlines()
    if "frozen 1" not in lines:
        return None  # counted from its start: start-up's collections would be in it
    return sum(float(line.split()[3]) for line in lines if line.startswith("gen"))


def children(pid: int) -> list[int]:
    """The engine child(ren) of a generate worker: its children that multiprocessing's spawn
    started (workers/generate/engine_process.py), not its resource tracker nor a helper it
    runs and that exits at once. Found by each process's parent in /proc/<pid>/stat: the
    kernel walks /proc/<pid>/task/*/children without a lock, and that walk can skip a
    child while a sibling exits (the likely cause of tests/test_proc_cpu.py finding no
    engine child once in four CI runs)."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):  # (gone since listed)
            continue
        if ppid == pid:
            out.append(int(entry.name))
    return [c for c in sorted(out) if _spawned(c)]


def _spawned(pid: int) -> bool:
    """Whether a process runs multiprocessing's spawn_main; False for one gone since it was
    listed (its /proc entry disappears with it: CI's throughput_gpu.sh run died on that)."""
    try:
        return b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
