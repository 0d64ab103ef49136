"""Chrome trace export of a launch: one process per core, one thread per unit, and a ``launch`` process whose
``launch`` events are the launch overhead (open in Perfetto).

:class:`~autofuse.npu.machine.Stats` counts a launch's cycles as its body plus the device's launch overhead,
booked after the body (the next launch starts after this one and its overhead). The trace shows that overhead
as an event of its own, from the end of the body to ``Stats.cycles``, so the trace spans exactly the launch's
cycles at the device's clock; a launch that runs launches in sequence (``matmul_per_group``) shows the
overheads between them too."""
from __future__ import annotations

import json

import numpy as np

from autofuse.npu.machine import ALL_UNITS as UNITS


class Trace:
    """The instruction timeline of one launch. ``to_json()`` gives Chrome trace events; ``save(path)``."""

    def __init__(self, launch_name: str, device, events, groups, cycles: int | None = None, overheads=()):
        self.name = launch_name
        self.device = device
        self._events = events
        self._groups = groups
        self.cycles = cycles            # Stats.cycles: the launch's own overhead ends the trace there
        self._overheads = list(overheads)

    def __len__(self) -> int:
        return len(self._events)

    def events(self) -> list[dict]:
        us = 1e6 / self.device.clock_hz
        pid_base, out = {}, []
        next_pid = 0
        for g in self._groups:
            pid_base[id(g)] = next_pid
            for c in range(g.n):
                out.append({"ph": "M", "name": "process_name", "pid": next_pid + c,
                            "args": {"name": f"{g.kind} {c}"}})
                for u in g.units:
                    out.append({"ph": "M", "name": "thread_name", "pid": next_pid + c, "tid": UNITS.index(u),
                                "args": {"name": u}})
            next_pid += g.n
        for g, unit, name, start, end, active in self._events:
            base, tid = pid_base[id(g)], UNITS.index(unit)
            cores = range(g.n) if active is None else np.flatnonzero(active)
            for c in cores:
                dur = float(end[c] - start[c])
                if dur <= 0:
                    continue
                out.append({"ph": "X", "name": name, "pid": base + int(c), "tid": tid,
                            "ts": float(start[c]) * us, "dur": dur * us})
        launches = self.launch_overheads()
        if launches:
            out.append({"ph": "M", "name": "process_name", "pid": next_pid, "args": {"name": "launch"}})
            out.append({"ph": "M", "name": "thread_name", "pid": next_pid, "tid": 0, "args": {"name": "overhead"}})
            for start, end in launches:
                out.append({"ph": "X", "name": "launch", "pid": next_pid, "tid": 0, "ts": start * us,
                            "dur": (end - start) * us, "args": {"cycles": end - start}})
        return out

    def launch_overheads(self) -> list[tuple[float, float]]:
        """``(start, end)`` cycles of each launch overhead: those between launches run in sequence, then the
        launch's own, from the end of its body to ``cycles``."""
        out = list(self._overheads)
        if self.cycles is not None and self.device.launch_cycles:
            out.append((float(self.cycles - self.device.launch_cycles), float(self.cycles)))
        return out

    def to_json(self) -> str:
        return json.dumps({"traceEvents": self.events(), "displayTimeUnit": "ns",
                           "otherData": {"kernel": self.name, "device": self.device.name,
                                         **({"cycles": self.cycles, "launch_cycles": self.device.launch_cycles,
                                             "clock_hz": self.device.clock_hz} if self.cycles is not None else {})}})

    def save(self, path) -> None:
        with open(path, "w") as f:
            f.write(self.to_json())
