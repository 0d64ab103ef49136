"""What a user changes on the model after fuse() is honoured: a parameter set to None, a plain tensor or list
attribute edited, a module's class swapped or its class's forward patched, torch's global hooks, a dtype change
after a symbolic export was made, ``2`` against ``2.0``, and a float64 model refused at any plan."""
import copy
import warnings
from fractions import Fraction

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from autofuse import AutoFusionEngine


class Block(nn.Module):
    def __init__(self, d=32):
        super().__init__()
        self.ln, self.q, self.k, self.v, self.o = nn.LayerNorm(d), nn.Linear(d, d), nn.Linear(d, d), \
            nn.Linear(d, d), nn.Linear(d, d)
        self.t = torch.tensor(2.0)               # a plain tensor attribute (no buffer)
        self.lst = [1.0, 3.0]                    # a plain list attribute
        self.cfg = {"shift": 0.5}                # a plain dict attribute

    def forward(self, x):
        h = self.ln(x) * self.t + self.lst[1] + self.cfg["shift"]
        a = torch.softmax(self.q(h) @ self.k(h).transpose(-1, -2) * 0.25, -1) @ self.v(h)
        return x + self.o(F.gelu(a))


class Scaled(nn.Linear):
    def forward(self, x):
        return super().forward(x) * 3


def _setup():
    torch.manual_seed(0)
    model, x = Block().eval(), torch.randn(2, 8, 32)
    return model, x, AutoFusionEngine.fuse(model, (x,))


class Options:
    def __init__(self):
        self.residual = True


class Knobs(nn.Module):
    """A forward that reads attributes of every kind a model keeps: private, a function, a dtype, a nested tuple, a
    held object's field (a config), one it may not have, and tied weights."""

    def __init__(self, d=32):
        super().__init__()
        self.emb, self.ln, self.head = nn.Embedding(64, d), nn.LayerNorm(d), nn.Linear(d, 64, bias=False)
        self.head.weight = self.emb.weight
        self._scale, self.act, self.cdtype, self.clamp, self.opts = 2.0, F.gelu, torch.float32, ((-1.0, 1.0),), \
            Options()

    def forward(self, ids):
        h = self.act(self.ln(self.emb(ids)) * self._scale).to(self.cdtype).float().clamp(*self.clamp[0])
        h = h * getattr(self, "extra", 1.0)
        return self.head(h + 1 if self.opts.residual else h)


KNOBS = {
    "private": lambda m: setattr(m, "_scale", 0.5),
    "function": lambda m: setattr(m, "act", F.relu),
    "dtype": lambda m: setattr(m, "cdtype", torch.bfloat16),
    "nested_tuple": lambda m: setattr(m, "clamp", ((-0.1, 0.1),)),
    "held_object_field": lambda m: setattr(m.opts, "residual", False),
    "added": lambda m: setattr(m, "extra", 3.0),
    "untied": lambda m: setattr(m.head, "weight", nn.Parameter(torch.randn(64, 32))),
}


class Holds(nn.Module):
    """Attributes a forward does not read as values: a list of objects (transformers keeps hook handles so), a
    logger with a handler (it cannot be deep-copied), a large table."""

    def __init__(self):
        super().__init__()
        import logging
        self.l = nn.Linear(16, 16)
        self.handles, self.log = [object()], logging.getLogger("autofuse-test-holds")
        self.log.addHandler(logging.NullHandler())
        self.vocab = {f"t{i}": i for i in range(5000)}

    def forward(self, x):
        return F.gelu(self.l(x)) * 2


def test_attributes_that_hold_objects_or_large_tables_neither_crash_nor_replan():
    """A list of objects was deep-copied and compared by identity (a new plan at every call), a logger's handler
    could not be deep-copied (fuse() raised), and a large table was compared at every call: objects in containers
    are not plain values, and a table of more than 4096 values is kept by identity."""
    torch.manual_seed(0)
    model, x = Holds().eval(), torch.randn(2, 16)
    fused = AutoFusionEngine.fuse(model, (x,))
    for _ in range(3):
        with torch.no_grad():
            torch.testing.assert_close(fused(x), model(x), atol=1e-6, rtol=1e-5)     # fp32 reassociation only
    assert len(fused.plans) == 1 and not fused.report.replanned_because
    model.vocab = dict(model.vocab)             # another table: planned again
    fused(x)
    assert "vocab was replaced" in fused.report.replanned_because


@pytest.mark.parametrize("edit", list(KNOBS))
def test_an_edit_to_any_attribute_the_forward_reads_replans(edit):
    """Each of these edits left the old plan running before (0.2 to 40 off eager): private attributes and
    functions, dtypes, held objects and added attributes were not guarded, and untied weights were read under
    the name the plan read both through."""
    torch.manual_seed(0)
    model, ids = Knobs().eval(), torch.randint(0, 64, (2, 8))
    fused = AutoFusionEngine.fuse(model, (ids,))
    torch.manual_seed(1)
    KNOBS[edit](model)
    with torch.no_grad():
        torch.testing.assert_close(fused(ids), model(ids), atol=1e-5, rtol=1e-4)   # fp32 reassociation only
    assert fused.report.replanned_because
    fused(ids)
    assert len(fused.plans) == 1                    # planned once more, then kept


def test_a_value_proven_constant_replans_when_it_starts_to_require_grad():
    """A frozen zero attention bias is proven empty and left out of the fused call; unfrozen, it must get its
    gradient (before, it stayed None for good)."""
    class Biased(nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv, self.bias = nn.Linear(32, 96), nn.Parameter(torch.zeros(1, 2, 8, 8), requires_grad=False)

        def forward(self, x):
            q, k, v = (t.view(2, 8, 2, 16).transpose(1, 2) for t in self.qkv(x).split(32, -1))
            return ((q @ k.transpose(-1, -2)) * 0.25 + self.bias).softmax(-1) @ v

    torch.manual_seed(0)
    model, x = Biased(), torch.randn(2, 8, 32)
    ref = copy.deepcopy(model)
    fused = AutoFusionEngine.fuse(model, (x,))
    for m in (model, ref):
        m.bias.requires_grad_(True)
    fused(x).square().sum().backward()
    ref(x).square().sum().backward()
    assert "requires grad" in fused.report.replanned_because
    torch.testing.assert_close(model.bias.grad, ref.bias.grad, atol=1e-6, rtol=1e-4)   # fp32 sums of 16


EDITS = {
    "bias_none": lambda m: setattr(m.o, "bias", None),
    "tensor_in_place": lambda m: m.t.fill_(5.0),
    "tensor_replaced": lambda m: setattr(m, "t", torch.tensor(7.0)),
    "list_in_place": lambda m: m.lst.__setitem__(1, 10.0),
    "dict_in_place": lambda m: m.cfg.__setitem__("shift", -4.0),
    "class_swapped": lambda m: setattr(m.o, "__class__", Scaled),
}


@pytest.mark.parametrize("edit", list(EDITS))
def test_an_edit_after_fuse_replans(edit):
    model, x, fused = _setup()
    fused(x)
    EDITS[edit](model)
    with torch.no_grad():
        torch.testing.assert_close(fused(x), model(x), atol=1e-5, rtol=1e-4)     # fp32 reassociation only
    assert fused.report.replanned_because


def test_a_patched_class_forward_and_a_global_hook_replan(monkeypatch):
    model, x, fused = _setup()
    monkeypatch.setattr(nn.LayerNorm, "forward", lambda self, t: F.layer_norm(t, self.normalized_shape) * 0.5)
    with torch.no_grad():
        torch.testing.assert_close(fused(x), model(x), atol=1e-5, rtol=1e-4)
    assert "class" in fused.report.replanned_because
    monkeypatch.undo()
    with torch.no_grad():
        fused(x)                                  # the class's own forward again: planned again
    handle = nn.modules.module.register_module_forward_hook(
        lambda m, i, o: o * 2 if isinstance(m, nn.Linear) else None)
    try:
        with torch.no_grad():
            torch.testing.assert_close(fused(x), model(x), atol=1e-5, rtol=1e-4)
        assert "global module hooks" in fused.report.replanned_because
    finally:
        handle.remove()


class Full(nn.Module):
    def forward(self, x, k):
        return x * 2, torch.full((2,), k)


@pytest.mark.parametrize("first,then", [(2, 2.0), (2.0, 2)])
def test_an_int_and_an_equal_float_are_other_signatures(first, then):
    model, x = Full(), torch.randn(4)
    fused = AutoFusionEngine.fuse(model)
    fused(x, first)
    assert fused(x, then)[1].dtype == model(x, then)[1].dtype


def test_float64_after_fuse_is_refused_by_name():
    model, x, fused = _setup()
    model.double()
    with pytest.raises(TypeError, match=r"^fused model: parameter 'ln.weight' of Block is float64.*model.float\(\)"):
        fused(x.double())


def test_a_float64_input_at_a_call_is_refused_as_the_calls():
    """A parameter-free module runs float64 in eager; the fused one refuses it, naming the call's input (not
    fuse() and its example inputs)."""
    class Free(nn.Module):
        def forward(self, x):
            return torch.softmax(x * 2.0, -1) * x

    fused = AutoFusionEngine.fuse(Free(), (torch.randn(4, 64),))
    with pytest.raises(TypeError, match=r"^fused model: this call's input 0 is float64; the NPU target ascend910 "):
        fused(torch.randn(4, 64, dtype=torch.float64))


def test_a_dtype_change_after_a_shared_export_replans_new_lengths():
    """From the third length on, one symbolic export serves the others (made at the third, 10, and serving it): a
    model.half() after it must not be served from the fp32 export."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(num_hidden_layers=1, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=128)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    fused = AutoFusionEngine.fuse(model)
    with torch.no_grad():
        for s in (8, 9, 10):
            fused(torch.randint(0, 128, (2, s)))
        assert fused._sizes.served == 1          # the third length served from the symbolic export
        model.half()
        ids = torch.randint(0, 128, (2, 12))
        got, want = fused(ids).logits, model(ids).logits
    assert got.dtype == want.dtype == torch.float16
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)   # fp16 logits: a few ulps


def test_threads_calling_with_new_sizes_plan_one_at_a_time():
    """torch.export is not thread-safe: concurrent first calls at new sizes are planned one after another
    (they failed with unrelated capture errors, and could leave a traced tensor in the user's model)."""
    import threading
    model, _, fused = _setup()
    got, errors = {}, []

    def run(s):
        try:
            z = torch.randn(2, s, 32)
            with torch.no_grad():
                got[s] = (z, fused(z))
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)
    threads = [threading.Thread(target=run, args=(s,)) for s in (5, 6, 7, 9)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and sorted(got) == [5, 6, 7, 9]
    with torch.no_grad():        # eager after the threads: a capture traces the model's own modules meanwhile
        for z, out in got.values():
            torch.testing.assert_close(out, model(z), atol=1e-5, rtol=1e-4)
    assert all(type(p) is nn.Parameter for p in model.parameters())
    # a thread's no_grad block entered while another thread captured left the tracer's (process-wide) metadata
    # marked grad-free: every later capture in the process then detached its outputs
    from torch.fx import traceback as fx_traceback

    from autofuse.capture import GRAD_BLOCK
    assert not fx_traceback.should_preserve_node_meta
    assert GRAD_BLOCK not in (fx_traceback.current_meta.get("custom") or {})
    later = AutoFusionEngine.fuse(nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.LayerNorm(8)), (torch.randn(2, 8),))
    assert later(torch.randn(2, 8)).requires_grad


def test_a_plan_is_made_only_while_no_other_thread_runs_one_and_runs_wait_for_it():
    """The order the process-wide lock of plans and runs keeps (``engine._PlansAndRuns``), step by step with
    events: a non-strict export swaps fake tensors in for the model's parameters and sets torch's process-wide
    exporting flag, so a plan run by one thread while another captured returned a FakeTensor (or ran the model
    eagerly on the fake parameters). Timeouts only bound a hang; the order is checked by the log."""
    import threading

    from autofuse.engine import _PlansAndRuns
    lock, log = _PlansAndRuns(), []
    running, release_run, planned = threading.Event(), threading.Event(), threading.Event()

    def runner():
        with lock.running():
            log.append("run starts")
            running.set()
            release_run.wait(10)
            log.append("run ends")

    def planner():
        with lock.planning():
            log.append("plan")
            planned.set()

    def late_runner():
        with lock.running():
            log.append("late run")
    first = threading.Thread(target=runner)
    first.start()
    running.wait(10)
    second = threading.Thread(target=planner)
    second.start()
    for _ in range(1000):                           # until the planner waits (the count only bounds a hang)
        if lock._waiting or planned.wait(0.01):
            break
    assert lock._waiting and not planned.is_set()   # the planner waits for the other thread's run
    third = threading.Thread(target=late_runner)    # a run that comes while a planner waits waits for the plan
    third.start()
    release_run.set()
    for t in (first, second, third):
        t.join(10)
    assert log == ["run starts", "run ends", "plan", "late run"]
    # a thread that plans inside its own run (a fused module inside a plan's code), or runs inside its own
    # planning, goes on: it would otherwise wait for itself
    with lock.running():
        with lock.planning():
            with lock.running():
                log.append("nested")
    assert log[-1] == "nested"


def test_a_simulation_of_a_fused_call_holds_plans_back_as_a_call_does(monkeypatch):
    """fused.simulate(...) runs the plan's graph on the model's parameters: like a fused call, it counts as a run,
    so no other thread's capture swaps fake tensors in for them meanwhile."""
    import importlib
    import threading

    from autofuse import engine
    sim = importlib.import_module("autofuse.simulate")     # (autofuse.simulate is also the package's function)
    model, x, fused = _setup()
    held, run = [], sim.simulate_graph

    def simulate_graph(*args, **kwargs):
        held.append(threading.get_ident() in engine._PLANNING._runs)
        return run(*args, **kwargs)
    monkeypatch.setattr(sim, "simulate_graph", simulate_graph)
    fused.simulate(x, values=False)
    assert held == [True]


def test_an_empty_batch_runs_as_captured():
    model, _, fused = _setup()
    z = torch.randn(0, 8, 32)
    with torch.no_grad():
        assert fused(z).shape == model(z).shape == (0, 8, 32)
    assert not fused.report.applied and "is empty" in fused.report.summary()


def test_deepcopy_gives_a_fused_copy_and_pickle_says_what_to_save():
    import pickle
    model, x, fused = _setup()
    twin = copy.deepcopy(fused)
    assert twin.model is not model and not twin.plans
    with torch.no_grad():
        torch.testing.assert_close(twin(x), model(x), atol=1e-5, rtol=1e-4)     # fp32 reassociation only
        twin.model.o.weight.mul_(2)                       # the copy's weights are its own
        torch.testing.assert_close(fused(x), model(x), atol=1e-5, rtol=1e-4)
    assert twin.report.applied
    with pytest.raises(TypeError, match=r"save the model \(fused.model"):
        pickle.dumps(fused)


def test_hooks_are_warned_of():
    """Capture runs forward hooks once, into the graph; backward hooks do not fire through fused calls: the
    report says so."""
    model, x, fused = _setup()
    assert not any("hooks" in w for w in fused.report.warnings)
    model.o.register_full_backward_hook(lambda m, gi, go: None)
    with pytest.warns(UserWarning, match=r"backward hooks of module\(s\) o do not fire"):
        fused(x)                # with grad: said as a Python warning too (a hook may change a gradient)
    assert any(w.startswith("module(s) o have hooks") for w in fused.report.warnings)


class Counting(nn.Module):
    """A forward that keeps a step count: as a plain attribute (refused), or in a buffer (written back)."""

    def __init__(self, in_buffer):
        super().__init__()
        self.l = nn.Linear(8, 8)
        if in_buffer:
            self.register_buffer("step", torch.zeros((), dtype=torch.long))
        else:
            self.step, self.history = 0, []

    def forward(self, x):
        self.step += 1
        if isinstance(self.step, int):
            self.history.append(self.step)
        return torch.softmax(self.l(x) * self.step, -1) * 2 + 1


def test_a_forward_changing_a_plain_attribute_is_refused_and_the_model_left_as_it_was():
    """A captured graph keeps the count the capture saw (fused calls returned the first call's values, and fuse()
    itself moved the count to 1): refused by name, the attributes put back."""
    from autofuse.capture import CaptureError
    model = Counting(in_buffer=False)
    with pytest.raises(CaptureError, match=r"step \(0 -> 1\).*history \(\[\] -> \[1\]\) of the model at every "
                                           r"call.*register_buffer"):
        AutoFusionEngine.fuse(model, (torch.randn(2, 8),))
    assert model.step == 0 and model.history == []


class KeepsTensors(nn.Module):
    """A forward that keeps tensors in attributes: attention weights for inspection (a new attribute), a lazily
    built table (a private attribute None before), a list of every call's output, a tensor attribute replaced."""
    def __init__(self, spelling):
        super().__init__()
        self.l = nn.Linear(8, 8)
        self.spelling = spelling
        self._table = None
        self.history = []
        self.offset = torch.zeros(8)

    def forward(self, x):
        a = torch.softmax(self.l(x), -1)
        if self.spelling == "new":
            self.weights = a
        elif self.spelling == "lazy" and self._table is None:
            self._table = torch.arange(8.0) * 2
        elif self.spelling == "list":
            self.history.append(a)
        elif self.spelling == "replaced":
            self.offset = self.offset + a.mean()
        return a * 2 + 1


@pytest.mark.parametrize("spelling,named", [("new", r"weights \(new: a tensor \[2, 8\] float32\)"),
                                            ("lazy", r"_table \(None -> a tensor \[8\] float32\)"),
                                            ("list", r"history \(\[\] -> a list of 1 holding tensors\)"),
                                            ("replaced", r"offset \(a tensor \[8\] float32 -> a tensor")])
def test_a_forward_keeping_tensors_in_attributes_is_refused_and_the_model_left_as_it_was(spelling, named):
    """The trace left a traced (functional) tensor in the user's model, which then failed at its next eager call
    ("Attempting to use FunctionalTensor on its own"), and fused calls would never update it. Refused by name,
    every attribute put back."""
    from autofuse.capture import CaptureError
    model = KeepsTensors(spelling)
    offset, history = model.offset, model.history
    with pytest.raises(CaptureError, match=named + ".*register_buffer.*one more output.*torch.compile"):
        AutoFusionEngine.fuse(model, (torch.randn(2, 8),))
    assert "weights" not in vars(model) and model._table is None and model.history is history == []
    assert model.offset is offset
    model(torch.randn(2, 8))          # eager still works


def test_a_table_built_at_the_first_call_is_refused_with_the_eager_call_that_settles_it():
    """A tensor the forward builds once and keeps (transformers' LongRoPE keeps its long_inv_freq so): the refusal
    says that one eager call settles it, and after that call the model fuses and equals eager."""
    from autofuse.capture import CaptureError
    model, x = KeepsTensors("lazy"), torch.randn(2, 8)
    with pytest.raises(CaptureError, match="builds such a tensor once.*run the model once eagerly before fuse"):
        AutoFusionEngine.fuse(model, (x,))
    with pytest.raises(CaptureError) as e:           # a tensor made at every call: no such advice
        AutoFusionEngine.fuse(KeepsTensors("replaced"), (x,))
    assert "builds such a tensor once" not in str(e.value)
    model(x)
    fused = AutoFusionEngine.fuse(model, (x,))
    torch.testing.assert_close(fused(x), model(x))


@pytest.mark.parametrize("spelling", ["new", "lazy", "list", "replaced"])
def test_a_forward_keeping_tensors_in_attributes_compiles_as_eager(spelling):
    """The refusal's hint holds: through torch.compile, Dynamo replays the attribute updates after the fused
    graph, so outputs and attributes are eager's over several calls."""
    torch.manual_seed(0)
    model = KeepsTensors(spelling)
    ref = copy.deepcopy(model)
    compiled = torch.compile(model, backend="autofuse")
    kept = {"new": lambda m: m.weights, "lazy": lambda m: m._table, "list": lambda m: torch.stack(m.history),
            "replaced": lambda m: m.offset}[spelling]
    x = torch.randn(2, 8)
    for _ in range(2):
        torch.testing.assert_close(compiled(x), ref(x), atol=1e-6, rtol=1e-5)     # fp32 reassociation only
        torch.testing.assert_close(kept(model), kept(ref), atol=1e-6, rtol=1e-5)


class Settles(nn.Module):
    """Sets plain attributes to values it then keeps (as Swin sets its shift to 0 where the image is no larger than
    its window), after reading the old value once."""
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(8, 8)
        self.shift = 2
        self.sizes = [4]

    def forward(self, x):
        y = self.l(x) * self.shift
        if x.shape[-1] <= 8:
            self.shift = 0
            self.sizes = [x.shape[-1]]
        return torch.softmax(y + self.shift, -1) * 2 + 1


def test_a_forward_that_settles_a_plain_attribute_runs_as_eager():
    """Refused before (Swin in training mode failed to fuse). The first call runs the graph captured from the
    attributes as they were and leaves them as eager's call does; the next call plans again from the settled
    values, once."""
    torch.manual_seed(0)
    model = Settles()
    ref = copy.deepcopy(model)
    x = torch.randn(2, 8)
    fused = AutoFusionEngine.fuse(model, (x,))
    assert (model.shift, model.sizes) == (2, [4])            # fuse() itself changes nothing
    with torch.no_grad():
        for _ in range(3):
            torch.testing.assert_close(fused(x), ref(x), atol=1e-6, rtol=1e-5)     # fp32 reassociation only
            assert (model.shift, model.sizes) == (ref.shift, ref.sizes) == (0, [8])
    assert fused.report.replanned_because.startswith("shift changed from 2 to 0")
    assert len(fused.plans) == 1


def test_a_count_kept_in_a_buffer_counts_as_eager():
    torch.manual_seed(0)
    model = Counting(in_buffer=True)
    ref = copy.deepcopy(model)
    x = torch.randn(2, 8)
    fused = AutoFusionEngine.fuse(model, (x,))
    assert int(model.step) == 0
    with torch.no_grad():
        for _ in range(3):
            torch.testing.assert_close(fused(x), ref(x), atol=1e-6, rtol=1e-5)     # fp32 reassociation only
    assert int(model.step) == int(ref.step) == 3


class UpdatesItsInput(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(8, 8)

    def forward(self, a, b):
        a.add_(1.0)
        return self.l(a) + b


@pytest.mark.parametrize("aliasing", ["same_tensor", "overlapping_views"])
def test_an_input_updated_in_place_that_aliases_another_runs_as_eager(aliasing):
    """The graph takes a and b as independent values; eager's b sees a's update when they share memory (fused
    missed the +1: 1.0 apart). Such a call runs the model eagerly, and says so."""
    torch.manual_seed(0)
    model = UpdatesItsInput()
    with torch.no_grad():
        fused = AutoFusionEngine.fuse(model, (torch.randn(2, 8), torch.randn(2, 8)))
        base = torch.randn(3, 8)
        mine, theirs = base.clone(), base.clone()
        pick = (lambda t: (t[:2], t[:2])) if aliasing == "same_tensor" else (lambda t: (t[:2], t[1:]))
        with pytest.warns(UserWarning, match="shares memory with another input"):
            got = fused(*pick(mine))
        torch.testing.assert_close(got, model(*pick(theirs)), atol=0, rtol=0)
        torch.testing.assert_close(mine, theirs, atol=0, rtol=0)
        a, b = torch.randn(2, 8), torch.randn(2, 8)             # apart: the fused graph, its update written back
        a2 = a.clone()
        torch.testing.assert_close(fused(a, b), model(a2, b), atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(a, a2)


def test_a_swapped_module_that_changes_the_signature_says_why_and_drops_the_stale_plan():
    """A new module comes in training mode, which changes the plan's key itself: the call planned anew but said
    nothing, and kept the plan of the old module."""
    model = nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 16), nn.GELU()).eval()
    x = torch.randn(2, 4, 16)
    fused = AutoFusionEngine.fuse(model, (x,))
    model[2] = nn.Tanh()
    torch.testing.assert_close(fused(x), model(x))
    assert fused.report.replanned_because == "module 2 was replaced or removed (the plan captured the old one)"
    assert len(fused.plans) == 1


def test_state_dict_keys_are_the_models_and_checkpoints_load_either_way():
    """A checkpoint of the model loads into the fused module and back (keys had a "model." prefix), also where the
    fused module is itself a submodule."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 16))
    fused = AutoFusionEngine.fuse(model, (torch.randn(2, 16),))
    assert list(fused.state_dict()) == list(model.state_dict())
    other = nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 16))
    fused.load_state_dict(other.state_dict())
    assert torch.equal(model[1].weight, other[1].weight)
    fresh = nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 16))
    fresh.load_state_dict(fused.state_dict())
    assert torch.equal(fresh[1].weight, model[1].weight)
    inner = nn.ModuleDict({"model": nn.Linear(4, 4), "head": nn.Linear(4, 2)})    # a submodule named "model",
    fused_inner = AutoFusionEngine.fuse(inner)                                  # as transformers' models have
    other = nn.ModuleDict({"model": nn.Linear(4, 4), "head": nn.Linear(4, 2)})
    fused_inner.load_state_dict(other.state_dict())
    assert torch.equal(inner["model"].weight, other["model"].weight)
    partial = {k: v for k, v in other.state_dict().items() if k != "model.weight"} | {"extra": torch.zeros(1)}
    got = fused_inner.load_state_dict(partial, strict=False)         # the model's keys, as the model itself says
    assert (got.missing_keys, got.unexpected_keys) == (["model.weight"], ["extra"])
    with pytest.raises(RuntimeError, match='Missing key.*"model.weight"'):
        fused_inner.load_state_dict(partial)
    parent = nn.ModuleDict({"body": fused})
    assert list(parent.state_dict()) == ["body." + k for k in model.state_dict()]
    state = {k: torch.zeros_like(v) for k, v in parent.state_dict().items()}
    parent.load_state_dict(state)
    assert not model[1].weight.any()


class Optional(nn.Module):
    """A forward that reads optional state: a bias left out (``bias=False``), a buffer registered as None, and a
    parameter, buffer or submodule it looks for by name."""

    def __init__(self):
        super().__init__()
        self.fc, self.ln = nn.Linear(16, 16, bias=False), nn.LayerNorm(16)
        self.register_buffer("scale", None)

    def forward(self, x):
        h = self.fc(x)
        if self.scale is not None:
            h = h * self.scale
        extra = getattr(self, "extra", None)
        if extra is not None:
            h = h + extra
        if hasattr(self, "post"):
            h = self.post(h)
        return self.ln(h)


SLOTS = {
    "bias_filled": (lambda m: setattr(m.fc, "bias", nn.Parameter(torch.linspace(-3, 3, 16))), "fc.bias was None"),
    "buffer_filled": (lambda m: setattr(m, "scale", torch.linspace(-3, 3, 16)), "scale was None"),
    "buffer_added": (lambda m: m.register_buffer("extra", torch.linspace(-3, 3, 16)), "added to the model as a buffer"),
    "parameter_added": (lambda m: setattr(m, "extra", nn.Parameter(torch.linspace(-3, 3, 16))),
                        "added to the model as a parameter"),
    "submodule_added": (lambda m: setattr(m, "post", nn.Tanh()), "added to the model as a submodule"),
}


@pytest.mark.parametrize("edit", list(SLOTS))
def test_a_parameter_buffer_or_submodule_slot_filled_or_added_after_fuse_replans(edit):
    """A slot that held None at plan time and was given a tensor, or a parameter or buffer registered since, kept
    the plan captured without it (3 to 4.5 off eager): only the names in a module's ``__dict__`` were guarded, not
    those in its ``_parameters``, ``_buffers`` and ``_modules``."""
    torch.manual_seed(0)
    model, x = Optional().eval(), torch.randn(2, 4, 16)
    fused = AutoFusionEngine.fuse(model, (x,))
    edit_model, why = SLOTS[edit]
    edit_model(model)
    with torch.no_grad():
        torch.testing.assert_close(fused(x), model(x), atol=1e-5, rtol=1e-4)     # fp32 reassociation only
    assert why in fused.report.replanned_because


class Shared(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.act3 = nn.Linear(16, 16), nn.Linear(16, 16), nn.Tanh()
        self.act1 = self.act2 = nn.GELU()                # one module under two names

    def forward(self, x):
        return self.act3(self.fc2(self.act2(self.fc1(self.act1(x)))))


def test_a_module_registered_under_two_names_repointed_replans():
    """Only the first name of a module held under two was guarded: ``act2`` pointed at the model's Tanh kept the
    plan with the GELU (0.28 off eager)."""
    torch.manual_seed(0)
    model, x = Shared().eval(), torch.randn(2, 4, 16)
    fused = AutoFusionEngine.fuse(model, (x,))
    model.act2 = model.act3
    with torch.no_grad():
        torch.testing.assert_close(fused(x), model(x), atol=1e-5, rtol=1e-4)     # fp32 reassociation only
    assert "module act2 was replaced" in fused.report.replanned_because


def test_a_global_hook_replaced_by_one_at_the_same_address_replans():
    """The global-hook guard kept ``id()`` of each hook only: once the captured hook was removed and freed, a new
    one allocated at its address passed, and the plan ran the old hook's effect (3.0 off eager at the first try)."""
    from torch.nn.modules.module import register_module_forward_hook

    def make_hook(scale):
        return lambda mod, inp, out: out * scale if isinstance(mod, nn.GELU) else None

    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 16)), torch.randn(2, 4, 16)
    handle = register_module_forward_hook(make_hook(2.0))
    try:
        fused = AutoFusionEngine.fuse(model, (x,))
    finally:
        handle.remove()                          # the captured hook is freed, and a new one may take its address
    for _ in range(3):
        handle = register_module_forward_hook(make_hook(-3.0))
        try:
            with torch.no_grad():
                torch.testing.assert_close(fused(x), model(x), atol=1e-5, rtol=1e-4)
            assert "global module hooks" in fused.report.replanned_because
        finally:
            handle.remove()


class Values(nn.Module):
    """A forward that reads an attribute of a type other than Python's own numbers and containers."""

    def __init__(self, val):
        super().__init__()
        self.fc, self.val = nn.Linear(16, 16), val

    def forward(self, x):
        h, v = self.fc(x), self.val
        if isinstance(v, (slice, range)):
            return h[..., v] if isinstance(v, slice) else h[..., list(v)]
        if isinstance(v, bytes):
            return h * len(v)
        if isinstance(v, dict):
            return h * v["cos"] + v["sin"]
        if isinstance(v, list):
            return h * v[0]
        if isinstance(v, Fraction):
            return h * float(v)
        return h * (torch.from_numpy(v) if isinstance(v, np.ndarray) else v)


VALUES = {
    "np.float32": (np.float32(0.5), lambda m: setattr(m, "val", np.float32(7))),
    "np.int64": (np.int64(2), lambda m: setattr(m, "val", np.int64(7))),
    "np.ndarray_replaced": (np.linspace(0, 1, 16, dtype=np.float32),
                            lambda m: setattr(m, "val", np.linspace(5, 6, 16, dtype=np.float32))),
    "np.ndarray_in_place": (np.linspace(0, 1, 16, dtype=np.float32), lambda m: m.val.__imul__(5)),
    "slice": (slice(0, 16), lambda m: setattr(m, "val", slice(0, 16, 2))),
    "range": (range(16), lambda m: setattr(m, "val", range(0, 16, 2))),
    "Fraction": (Fraction(1, 2), lambda m: setattr(m, "val", Fraction(7, 2))),
    "bytes": (b"ab", lambda m: setattr(m, "val", b"abcde")),
}


@pytest.mark.parametrize("kind", list(VALUES))
def test_a_numpy_slice_range_fraction_or_bytes_attribute_changed_after_fuse_replans(kind):
    """Only Python's own numbers, strings and containers were guarded: a numpy scalar or array, a slice, a range,
    a Fraction or bytes changed after fuse() kept the old plan (up to 14 off eager, or another output shape)."""
    torch.manual_seed(0)
    init, edit = VALUES[kind]
    model, x = Values(init).eval(), torch.randn(2, 4, 16)
    fused = AutoFusionEngine.fuse(model, (x,))
    with torch.no_grad():
        fused(x)
        assert len(fused.plans) == 1 and not fused.report.replanned_because       # unchanged: no new plan
        edit(model)
        torch.testing.assert_close(fused(x), model(x), atol=1e-5, rtol=1e-4)     # fp32 reassociation only
    assert fused.report.replanned_because.startswith("val ")


class Tables(nn.Module):
    def __init__(self, kind):
        super().__init__()
        self.fc, self.kind = nn.Linear(16, 16), kind
        t = torch.ones(16)
        self.tables = [t, 2] if kind == "list" else {"scale": t, "shift": (torch.zeros(16), 0.5)}

    def forward(self, x):
        if self.kind == "list":
            return self.fc(x) * self.tables[0] + self.tables[1]
        return self.fc(x) * self.tables["scale"] + self.tables["shift"][0] * self.tables["shift"][1]


TABLE_EDITS = {
    "entry_replaced": lambda t, k: t.__setitem__(k, torch.full((16,), 5.0)),
    "in_place": lambda t, k: t[k].mul_(5.0),
    "through_data": lambda t, k: t[k].data.copy_(torch.full((16,), 5.0)),
    "plain_value": lambda t, k: t.__setitem__(1, 3) if isinstance(t, list) else t.__setitem__("shift", (
        t["shift"][0], 4.0)),
}


@pytest.mark.parametrize("kind", ["list", "dict"])
@pytest.mark.parametrize("edit", list(TABLE_EDITS))
def test_tensors_kept_in_a_list_or_dict_attribute_are_guarded(kind, edit):
    """A list or dict of tensors kept as a plain attribute (RoPE tables in a dict) was not guarded: an entry
    replaced kept the old plan (7 to 9 off eager). Each tensor is guarded as a plain tensor attribute is, and the
    container's structure and plain values too."""
    torch.manual_seed(0)
    model, x = Tables(kind).eval(), torch.randn(2, 4, 16)
    fused = AutoFusionEngine.fuse(model, (x,))
    with torch.no_grad():
        fused(x)
        assert len(fused.plans) == 1 and not fused.report.replanned_because       # unchanged: no new plan
        TABLE_EDITS[edit](model.tables, 0 if kind == "list" else "scale")
        torch.testing.assert_close(fused(x), model(x), atol=1e-5, rtol=1e-4)     # fp32 reassociation only
    assert fused.report.replanned_because.startswith("tables[")


def _class_with_settings():
    class WithSettings(nn.Module):
        scale = 1.0                               # a class-wide setting
        table = [1.0, 0.0]                        # a class-wide table

        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(16, 16)

        def act(self, h):                         # a helper method
            return torch.relu(h)

        def forward(self, x):
            return self.act(self.fc(x)) * self.scale * self.table[0] + self.table[1]
    return WithSettings


CLASS_EDITS = {
    "attribute": (lambda c: setattr(c, "scale", 3.0), "WithSettings.scale changed from 1.0 to 3.0"),
    "method": (lambda c: setattr(c, "act", lambda self, h: torch.tanh(h)), "WithSettings.act was replaced"),
    "added": (lambda c: setattr(c, "extra", 1.0), "WithSettings.extra was added to the class"),
    "table_in_place": (lambda c: c.table.__setitem__(1, 2.0), "WithSettings.table changed from [1.0, 0.0]"),
}


@pytest.mark.parametrize("edit", list(CLASS_EDITS))
def test_a_class_attribute_or_method_changed_after_fuse_replans(edit):
    """Only a class's forward was guarded: a class-level setting or a helper method patched on the class kept the
    old plan (0.9 to 2.6 off eager)."""
    torch.manual_seed(0)
    cls = _class_with_settings()
    model, x = cls().eval(), torch.randn(2, 4, 16)
    fused = AutoFusionEngine.fuse(model, (x,))
    with torch.no_grad():
        fused(x)
        assert len(fused.plans) == 1 and not fused.report.replanned_because       # unchanged: no new plan
        change, why = CLASS_EDITS[edit]
        change(cls)
        torch.testing.assert_close(fused(x), model(x), atol=1e-5, rtol=1e-4)     # fp32 reassociation only
    assert why in fused.report.replanned_because


def test_assigning_a_models_attribute_on_the_fused_module_reaches_the_model():
    """``fused.o`` reads the model's ``o``, but ``fused.o = nn.Linear(...)`` registered a second module on the fused
    one: calls kept the model's old ``o`` and ``state_dict()`` held both under one key. A name the model does not
    have is still set on the fused module."""
    model, x, fused = _setup()
    torch.manual_seed(3)
    new = nn.Linear(32, 32)
    fused.o = new
    assert model.o is new and fused.o is new and "o" not in fused._modules
    with torch.no_grad():
        torch.testing.assert_close(fused(x), model(x), atol=1e-5, rtol=1e-4)     # fp32 reassociation only
    assert "module o was replaced" in fused.report.replanned_because
    assert torch.equal(fused.state_dict()["o.weight"], new.weight)
    fused.tag = "mine"                            # not the model's: the fused module's own
    assert fused.__dict__["tag"] == "mine" and not hasattr(model, "tag")


def test_deepcopy_keeps_the_fused_modules_hooks_mode_and_attributes():
    """copy.deepcopy(fused) built a fused module from scratch: hooks registered on the fused module, its training
    flag and attributes set on it were dropped (copy.deepcopy of any other nn.Module keeps them)."""
    model, x, fused = _setup()
    fused.register_forward_hook(lambda mod, i, o: o * 0)
    fused.eval()
    fused.tag = "mine"
    twin = copy.deepcopy(fused)
    assert twin.model is not model and not twin.plans
    with torch.no_grad():
        assert bool((twin(x) == 0).all())
    assert not twin.training and not twin.model.training and twin.__dict__["tag"] == "mine"


class Big(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.head = nn.Linear(8, 16), nn.Linear(16, 4)
        self.block = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))

    def forward(self, x):
        return self.head(self.block(self.emb(x)))


@pytest.mark.parametrize("route", ["export", "symbolic_trace"])
def test_a_model_holding_a_fused_module_fuses_again_at_new_shapes(route):
    """A fused module inside a model fused again planned (and exported) its own model while the outer capture
    traced it: at a new shape the outer call failed. Traced by another capture, a fused module runs its model,
    which the outer capture sees and fuses with the rest."""
    torch.manual_seed(0)
    big, x = Big().eval(), torch.randn(2, 3, 8)
    ref = copy.deepcopy(big)
    big.block = AutoFusionEngine.fuse(big.block, (big.emb(x),))
    inner = len(big.block.plans)
    outer = AutoFusionEngine.fuse(big, (x,), route=route)
    with torch.no_grad():
        for shape in ((2, 3, 8), (5, 3, 8)):
            x = torch.randn(shape)
            torch.testing.assert_close(outer(x), ref(x), atol=1e-5, rtol=1e-4)   # fp32 reassociation only
    assert len(big.block.plans) == inner                  # the inner module did not plan inside the outer capture
    assert outer.report.applied                           # the outer plan fuses the block's ops itself
    assert all(isinstance(p, nn.Parameter) for p in big.parameters())


def test_a_global_hook_does_not_fire_for_the_fused_modules_internal_graph():
    """A global forward hook fired at fused calls for autofuse's internal GraphModule too, given its tuple of
    outputs: a hook that records what it sees saw a module eager never runs (and one that doubled any output
    repeated the tuple)."""
    from torch.nn.modules.module import register_module_forward_hook
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(16, 16), nn.GELU()), torch.randn(2, 16)
    seen = []

    def hook(mod, inp, out):
        seen.append(type(mod).__name__)
        return out * 2 if isinstance(out, torch.Tensor) else None
    handle = register_module_forward_hook(hook)
    try:
        fused = AutoFusionEngine.fuse(model, (x,))
        seen.clear()
        with torch.no_grad():
            got = fused(x)
        assert "GraphModule" not in seen, seen
        with torch.no_grad():
            torch.testing.assert_close(got, model(x), atol=1e-5, rtol=1e-4)
    finally:
        handle.remove()


def test_a_global_forward_hook_is_applied_once_per_module_as_eager_applies_it():
    """A global forward hook is captured into the graph for every module, the model itself included; the fused
    module's own call fired it once more (an output transform applied one extra time at the top)."""
    from torch.nn.modules.module import register_module_forward_hook
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 16)), torch.randn(2, 16)
    fused = AutoFusionEngine.fuse(model, (x,))
    handle = register_module_forward_hook(lambda mod, inp, out: out * 1.5 if isinstance(out, torch.Tensor) else None)
    try:
        with torch.no_grad():
            torch.testing.assert_close(fused(x), model(x), atol=1e-5, rtol=1e-4)
    finally:
        handle.remove()
    seen = []
    fused.register_forward_hook(lambda mod, inp, out: seen.append(mod))     # the fused module's own hooks fire
    fused(x)
    assert seen == [fused]


def test_the_fused_modules_own_hooks_fire_without_firing_global_hooks_once_more():
    """With a hook of its own, the fused module was called through torch's Module.__call__, which fired the global
    hooks for it too: an output transform registered globally was applied once more than in eager."""
    from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 16)), torch.randn(2, 16)
    fused = AutoFusionEngine.fuse(model, (x,))
    calls = []
    fused.register_forward_pre_hook(lambda mod, inp: (inp[0] * 2,))
    fused.register_forward_hook(lambda mod, inp, kw, out: out + 1, with_kwargs=True)
    fused.register_forward_hook(lambda mod, inp, out: calls.append(type(mod).__name__))
    handles = [register_module_forward_hook(lambda mod, inp, out: out * 1.5 if isinstance(out, torch.Tensor) else None),
               register_module_forward_pre_hook(lambda mod, inp: calls.append("pre " + type(mod).__name__))]
    try:
        with torch.no_grad():
            fused(x)                        # new global hooks: planned again, capture runs them into the graph
            calls.clear()
            got = fused(x)
            calls_fused = list(calls)
            calls.clear()
            want = model(x * 2) + 1         # eager: the global hooks once per module of the model
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
        assert calls_fused == ["FusedModule"], calls_fused      # the pre-hook ran in capture, not per call
    finally:
        for h in handles:
            h.remove()


def test_an_always_call_hook_of_the_fused_module_runs_when_its_forward_raises():
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(16, 16), nn.GELU()), torch.randn(2, 16)
    fused = AutoFusionEngine.fuse(model, (x,))
    seen = []
    fused.register_forward_hook(lambda mod, inp, out: seen.append(out), always_call=True)
    with pytest.raises(Exception):
        fused(torch.randn(2, 7))            # the Linear refuses 7 features, in capture as in eager
    assert seen == [None]


class _DivideBy(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = 0.0

    def forward(self, x, scale=None):
        return torch.sigmoid(x / (self.scale if scale is None else scale)) * 2 + 1


def test_a_negative_zero_is_not_served_the_plan_of_a_positive_zero():
    """-0.0 == 0.0 in Python, so a float argument or attribute changed from 0.0 to -0.0 was served the old plan,
    though x / s tells them apart (every output on the other side of the sigmoid); a NaN argument missed the plan
    it had at every call, a new NaN object equalling no other."""
    x = torch.tensor([[1.0, -1.0, 2.0, -3.0]])
    model = _DivideBy()
    fused = AutoFusionEngine.fuse(model)
    with torch.no_grad():
        for s in (0.0, -0.0, 0.0):
            assert torch.equal(fused(x, s), model(x, s)), s
        assert len(fused.plans) == 2
        fused(x, float("nan"))
        fused(x, float("nan"))
        assert len(fused.plans) == 3
        fused(x)
        model.scale = -0.0
        assert torch.equal(fused(x), model(x))
        assert "scale changed from 0.0 to -0.0" in fused.report.replanned_because


def test_a_recording_forward_hook_is_warned_of_where_the_user_sees_it():
    """A forward hook that records activations fires while a plan is captured, with the trace's tensors, and
    never at fused calls; only the report said so. transformers' output recorder, whose records the model
    returns, is not warned of."""
    import transformers
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(16, 16), nn.GELU()), torch.randn(2, 16)
    fused = AutoFusionEngine.fuse(model, (x,))
    seen = []
    model[0].register_forward_hook(lambda mod, inp, out: seen.append(out))
    with pytest.warns(UserWarning, match=r"forward hooks of module\(s\) 0 ran while this plan was captured"):
        fused(x)
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                   num_key_value_heads=1, vocab_size=64)
    llama, ids = transformers.LlamaForCausalLM(cfg).eval(), torch.randint(0, 64, (1, 6))
    with torch.no_grad():
        llama(ids, output_hidden_states=True)         # leaves its output recorder's hooks on the layers
        assert any(m._forward_hooks for m in llama.modules())
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = AutoFusionEngine.fuse(llama)(ids, output_hidden_states=True)
        assert not [w for w in caught if "forward hooks" in str(w.message)]
        torch.testing.assert_close(out.hidden_states[-1], llama(ids, output_hidden_states=True).hidden_states[-1],
                                   atol=1e-5, rtol=1e-4)
