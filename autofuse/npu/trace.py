"""Chrome trace export of a launch: one process per core, one thread per unit (open in Perfetto)."""
from __future__ import annotations

import json

import numpy as np

from autofuse.npu.machine import ALL_UNITS as UNITS


class Trace:
    """The instruction timeline of one launch. ``to_json()`` gives Chrome trace events; ``save(path)``."""

    def __init__(self, launch_name: str, device, events, groups):
        self.name = launch_name
        self.device = device
        self._events = events
        self._groups = groups

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
        return out

    def to_json(self) -> str:
        return json.dumps({"traceEvents": self.events(), "displayTimeUnit": "ns",
                           "otherData": {"kernel": self.name, "device": self.device.name}})

    def save(self, path) -> None:
        with open(path, "w") as f:
            f.write(self.to_json())
