"""Run one kernel on every rank of an in-process world (threads, numpy only): the helper the link tests share."""
import threading

from autofuse import npu
from autofuse.npu.link import ThreadWorld


def world_run(kernel, per_rank, device="ascend910b", **params):
    """``npu.run(kernel, *per_rank[r], comm=rank r)`` on every rank at once; returns the results by rank."""
    p = len(per_rank)
    world = ThreadWorld(p)
    results, errors = [None] * p, []

    def go(r):
        try:
            results[r] = npu.run(kernel, *per_rank[r], device=device, comm=world.comm(r), **params)
        except BaseException as e:          # re-raised below, in the test's thread
            errors.append(e)

    threads = [threading.Thread(target=go, args=(r,)) for r in range(p)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results
