"""One export for a signature's sizes (autofuse.sizes): a call at new sizes of a structure already seen is
specialised from one symbolic export, and gives the graph and the outputs a fresh export gives; where the
export's constraints or the model's modules say otherwise, it is exported again."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils._pytree as pytree

from autofuse import AutoFusionEngine
from autofuse.capture import capture
from autofuse.sizes import SizeFamilies


def _served(fused) -> int:
    return fused._sizes.served if fused._sizes is not None else 0


def _structure(gm):
    """Each node's op, target and value's shape and dtype: what planning reads of a captured graph."""
    def val(v):
        if isinstance(v, torch.Tensor):
            return tuple(v.shape), v.dtype, tuple(v.stride()), v.storage_offset(), v.requires_grad
        if isinstance(v, (list, tuple)):
            return [val(x) for x in v]
        return type(v).__name__
    return [(n.op, str(n.target), val(n.meta.get("val"))) for n in gm.graph.nodes if n.op != "output"]


class _Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x, mask):
        h = torch.softmax(x @ x.transpose(-1, -2) + mask, dim=-1) @ x
        return self.down(torch.nn.functional.gelu(self.up(h))) + x


@pytest.mark.parametrize("training", [False, True])
def test_a_specialised_export_is_the_fresh_export(training):
    """The graph specialised from the symbolic export at a third size has the fresh export's nodes, values'
    shapes, dtypes, strides and requires_grad, and the same outputs; the planned model's outputs (and in training
    mode its gradients) are eager's at each size."""
    model = _Mlp().train(training)
    sizes = SizeFamilies()

    def inputs(n):
        return torch.randn(2, n, 16), torch.randn(2, n, n)

    capture(model, inputs(5), sizes=sizes)
    capture(model, inputs(7), sizes=sizes)            # the first two are exported by themselves
    x, m = inputs(11)
    got, fresh = capture(model, (x, m), sizes=sizes), capture(model, (x, m))     # the symbolic export, at 11
    assert sizes.served == 1
    assert _structure(got.graph_module) == _structure(fresh.graph_module)
    with torch.no_grad():
        torch.testing.assert_close(got(x, m), fresh(x, m), rtol=0, atol=0)   # the same ops on the same inputs

    fused = AutoFusionEngine.fuse(model)
    for n in (5, 7, 11, 3):
        x, m = inputs(n)
        out, want = fused(x, m), model(x, m)
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)  # fp32, other kernels: a few ulps of |out| ~ 1
        if training:
            grads = [torch.autograd.grad(o.sum(), list(model.parameters())) for o in (out, want)]
            for g, w in zip(*grads):
                torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)   # sums of up to 2·11·32 fp32 products
    assert len(fused.plans) == 4 and _served(fused) == 2
    assert all(p.report.applied for p in fused.plans.values())


def test_a_dimension_kept_static_that_changes_widens_the_export():
    """The symbolic export made at the third size keeps the batch static (it had not changed). A call at another
    batch makes one symbolic export more, with the batch symbolic too, which serves that batch's later sizes; the
    first program still serves the first batch. Every graph is the fresh export's."""
    model = _Mlp().eval()
    sizes = SizeFamilies()

    def inputs(b, n):
        return torch.randn(b, n, 16), torch.randn(b, n, n)

    for n in (5, 7, 11):
        capture(model, inputs(2, n), sizes=sizes)
    (fam,) = sizes.families.values()
    assert sizes.served == 1 and len(fam.programs) == 1
    for b, n, served, programs in ((3, 4, 2, 2), (3, 6, 3, 2), (2, 9, 4, 2), (5, 3, 5, 2)):
        x, m = inputs(b, n)
        got, fresh = capture(model, (x, m), sizes=sizes), capture(model, (x, m))
        assert (sizes.served, len(fam.programs), fam.widened) == (served, programs, 1), (b, n)
        assert _structure(got.graph_module) == _structure(fresh.graph_module)
        with torch.no_grad():
            torch.testing.assert_close(got(x, m), fresh(x, m), rtol=0, atol=0)   # the same ops on the same inputs


def _llama_step():
    tf = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(tf.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                               num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                                               max_position_embeddings=64)).eval()

    def inputs(past):
        ids = torch.randint(1, 128, (2, past + 1))
        with torch.no_grad():
            cache = model(ids[:, :past], use_cache=True).past_key_values
        return (ids[:, past:],), {"past_key_values": cache, "use_cache": True}
    return model, inputs


def _mistral_past_window_step():
    """A decode step past a 4-key sliding window: the cache's length (past + 0) is not its keys' (3), so capture
    lifts it into an input of its own (autofuse.caches.Length), which the symbolic export keeps symbolic."""
    tf = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = tf.MistralForCausalLM(tf.MistralConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                                   num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                                                   sliding_window=4, max_position_embeddings=64)).eval()

    def inputs(past):
        ids = torch.randint(1, 128, (2, past + 1))
        with torch.no_grad():
            cache = model(ids[:, :past], use_cache=True).past_key_values
        assert cache.layers[0].cumulative_length == past and cache.layers[0].keys.shape[-2] == 3
        return (ids[:, past:],), {"cache": cache, "use_cache": True}
    return model, inputs


def _mlp_step():
    torch.manual_seed(0)
    return _Mlp().train(), lambda n: ((torch.randn(2, n, 16, requires_grad=True), torch.randn(2, n, n)), {})


class _Slices(nn.Module):
    """Views whose offsets and strides are expressions of the length: halves at n // 2, a strided slice, a padded
    slice, unfold, and constructors of the length."""

    def forward(self, x):
        n = x.shape[1]
        first, second = x[:, : n // 2], x[:, n // 2:]
        padded = F.pad(x, (0, 0, 1, 2))[:, 1:-2]
        flat = torch.cat([second, first], 1).transpose(1, 2).contiguous().view(x.shape[0], -1)
        return padded + x, x.unfold(1, 2, 1).sum(-1), flat, x[:, ::2] * 2, torch.arange(n * 3).view(n, 3)


def _slices_step():
    return _Slices().eval(), lambda n: ((torch.randn(2, n, 4),), {})


@pytest.mark.parametrize("make", [_llama_step, _mistral_past_window_step, _mlp_step, _slices_step],
                         ids=["llama decode step", "mistral decode step past its window (an int input symbolic)",
                              "training, input with grad", "views at offsets of the length"])
def test_a_specialised_graph_has_the_values_propagating_its_inputs_op_by_op_gives(make, monkeypatch):
    """The values a specialised graph's nodes get from the symbolic export's, evaluated at the call's sizes, are those
    torch's FakeTensorProp gives propagating the inputs through the same graph op by op: shapes, dtypes, strides,
    storage offsets (RoPE's second half is a view at one) and requires_grad, node by node. The outputs are a fresh
    export's."""
    import autofuse.sizes as sizes_module
    from autofuse import caches
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    sizes = SizeFamilies()
    model, inputs = make()
    for n in (5, 6, 7):                     # the third makes the symbolic export
        capture(model, *inputs(n), sizes=sizes)
    args, kwargs = inputs(11)
    (program,) = [p for f in sizes.families.values() for p in f.programs]
    with caches.lengths_tied(model):        # the leaves as capture flattens them (a cache's length lifted)
        leaves = pytree.tree_leaves((args, kwargs))
    lifted = [n for n in program.graph.nodes if n.op == "placeholder" and isinstance(n.meta["val"], torch.SymInt)]
    assert len(lifted) == (make is _mistral_past_window_step)
    got = sizes_module.specialise(program, leaves, model).graph_module

    def propagated(gm, values, real, mode):
        real = [int(x) if type(x) is caches.Length else x for x in real]     # a fresh export's int placeholder
        FakeTensorProp(gm, mode).propagate(*real)
        for node, x in zip((n for n in gm.graph.nodes if n.op == "placeholder"), real):
            if isinstance(x, torch.Tensor) and x.requires_grad:     # what an export's placeholders keep
                node.meta["val"] = mode.from_tensor(x)
    monkeypatch.setattr(sizes_module, "_values_at", propagated)
    want = sizes_module.specialise(program, leaves, model).graph_module
    assert _structure(got) == _structure(want)
    assert any(isinstance(n.meta.get("val"), torch.Tensor) and n.meta["val"].storage_offset()
               for n in got.graph.nodes) == (make is not _mlp_step)
    assert any(isinstance(n.meta.get("val"), torch.Tensor) and n.meta["val"].requires_grad
               for n in got.graph.nodes) == (make is not _slices_step)  # parameters, and the input with grad
    monkeypatch.undo()
    served, fresh = capture(model, args, kwargs, sizes=sizes), capture(model, args, kwargs)
    with torch.no_grad():
        torch.testing.assert_close(served.graph_module(*served.flatten_inputs(*args, **kwargs)),
                                   fresh.graph_module(*fresh.flatten_inputs(*args, **kwargs)), rtol=0, atol=0)


def test_generate_at_another_batch_size_is_served_after_one_more_export():
    """A second generate() with a batch of another size: its first decode step makes one symbolic export with the
    batch symbolic, and its later steps are served from it (not exported each by itself); the tokens are
    eager's."""
    tf = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(tf.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                               num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                                               max_position_embeddings=64)).eval()
    fused = AutoFusionEngine.fuse(model)
    # 5 decode steps each: at batch 2 the last four served; at batch 3 all five (after one more export), and its
    # prefill, the prefill family's second signature, exported by itself (met once in a generate(): the default)
    for batch, tokens, served in ((2, 6, 4), (3, 6, 9)):
        ids = torch.randint(1, 128, (batch, 8))
        settings = dict(max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, pad_token_id=0)
        with torch.no_grad():
            want = model.generate(ids, **settings)
            got = fused.generate(ids, **settings)
        assert torch.equal(got, want)
        assert _served(fused) == served, batch
    decode = [f for f in fused._sizes.families.values() if f.programs]
    assert len(decode) == 1 and decode[0].widened == 1


class _Branchy(nn.Module):
    """A forward that branches on a size: torch.export records the branch taken as a constraint."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        if x.shape[0] > 4:
            return torch.relu(self.lin(x)) * 2
        return torch.sigmoid(self.lin(x)) + 1


def test_sizes_outside_the_exports_constraints_are_exported_again():
    """Sizes 2 and 3 are exported by themselves; 4 makes the symbolic export, whose branch holds up to 4: 4 and 1
    are served from it, 6 takes the other branch and is exported again. Every output is eager's."""
    model = _Branchy().eval()
    fused = AutoFusionEngine.fuse(model)
    for n, served in ((2, 0), (3, 0), (4, 1), (6, 1), (1, 2)):
        x = torch.randn(n, 8)
        with torch.no_grad():
            torch.testing.assert_close(fused(x), model(x), rtol=1e-6, atol=1e-6)
        assert _served(fused) == served, n


def test_a_keyword_input_past_the_first_that_breaks_the_exports_constraints_is_exported_again():
    # position_ids [1, S] first, then input_ids [B, S] and a flag: a later batch breaks the export held (its batch
    # kept static); torch's own check of that later input must not end the capture: the call is exported again
    tf = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(tf.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                               num_hidden_layers=1, num_attention_heads=4,
                                               num_key_value_heads=2)).eval()
    fused = AutoFusionEngine.fuse(model)
    for b, s in ((2, 5), (2, 6), (2, 7), (3, 5)):
        kw = dict(position_ids=torch.arange(s)[None], input_ids=torch.randint(3, 128, (b, s)), use_cache=False)
        with torch.no_grad():
            torch.testing.assert_close(fused(**kw).logits, model(**kw).logits, rtol=1e-5, atol=1e-5)
    assert len(fused.plans) == 4


class _Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.scale = 2.0

    def forward(self, x):
        return torch.tanh(self.lin(x)) * self.scale


def test_a_changed_module_attribute_is_not_served_from_the_old_export():
    """Capture bakes a module's plain attribute into the graph: after it changes, a new size is exported again
    (the symbolic export captured the old value), and the output is eager's with the new value."""
    model = _Scaled().eval()
    fused = AutoFusionEngine.fuse(model)
    with torch.no_grad():
        for n in (2, 3, 4):
            fused(torch.randn(n, 8))
        assert _served(fused) == 1                # 4: the symbolic export, with scale 2.0
        model.scale = 5.0
        x = torch.randn(5, 8)
        torch.testing.assert_close(fused(x), model(x), rtol=1e-6, atol=1e-6)
    assert _served(fused) == 0                    # the family started again at size 5: nothing served since


def test_generate_exports_the_decode_step_once_for_its_lengths():
    """transformers' generate() passes ``return_dict`` into the forward's ``**kwargs``; the symbolic export
    names it (a torch 2.13 export with dynamic shapes fails otherwise). generate() says how many decode steps
    come: with five, the first is exported by itself and the next four are served by one symbolic export made at
    the second; with four, each is exported by itself (the symbolic export, 2.4 to 3.5 plain ones, would cost more
    than it saves). The tokens are eager's."""
    tf = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(tf.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                               num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                                               max_position_embeddings=64)).eval()
    ids = torch.randint(1, 128, (2, 8))
    for tokens, served, given in ((6, 4, "keyword"), (5, 0, "keyword"), (6, 4, "generation_config")):
        fused = AutoFusionEngine.fuse(model)
        settings = dict(max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, pad_token_id=0)
        if given == "generation_config":          # the count read where transformers reads it
            settings = {"generation_config": tf.GenerationConfig(**settings)}
        with torch.no_grad():
            want = model.generate(ids, **settings)
            got = fused.generate(ids, **settings)
        assert torch.equal(got, want)
        assert len(fused.plans) == tokens and _served(fused) == served, (tokens, given)
        assert fused._sizes._window is None                       # as it was, once generate() returned


def test_share_exports_off_exports_every_signature():
    model = _Scaled().eval()
    fused = AutoFusionEngine.fuse(model, share_exports=False)
    for n in (2, 3, 4):
        x = torch.randn(n, 8)
        with torch.no_grad():
            torch.testing.assert_close(fused(x), model(x), rtol=1e-6, atol=1e-6)
    assert fused._sizes is None and len(fused.plans) == 3


class _TwoParts(nn.Module):
    """A block whose sizes never change (the projection of ``x``) beside one whose sizes do (the softmax over
    ``y``'s rows)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x, y):
        return torch.nn.functional.gelu(self.lin(x)) * 2 + 1, torch.softmax(y * 0.5, dim=-1)


def test_a_block_verified_in_one_plan_is_not_verified_again_in_the_next(monkeypatch):
    """The verifier's verdicts are kept across a fused module's plans by block (its captured ops and shapes and
    its fused call): the second size re-checks only the block whose shapes changed. A guard that fires (the model
    changed) clears them."""
    import autofuse.verify as verify
    calls = []
    real = verify.verify_block
    monkeypatch.setattr(verify, "verify_block", lambda *a, **k: calls.append(1) or real(*a, **k))
    model = _TwoParts().eval()
    fused = AutoFusionEngine.fuse(model)
    x = torch.randn(4, 16)
    counts = []
    for n in (8, 12):
        calls.clear()
        y = torch.randn(3, n)
        with torch.no_grad():
            for g, w in zip(fused(x, y), model(x, y)):
                torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)
        counts.append(len(calls))
        assert len(fused.report.applied) == 2, fused.report.summary()
    assert counts[0] == 2 and counts[1] == 1
    model.lin = nn.Linear(16, 16).eval()          # a module replaced (in the same mode): the plan's guard fires
    calls.clear()
    with torch.no_grad():
        fused(x, y)
    assert len(calls) == 2
    assert "module lin was replaced" in fused.report.replanned_because


def test_share_exports_takes_a_bool():
    with pytest.raises(ValueError, match=r"share_exports='no'; give True .* or False"):
        AutoFusionEngine.fuse(_Scaled(), share_exports="no")


class _Parity(nn.Module):
    """A forward that branches on a size's parity: the export's guard (``T % 2 != 0``) is neither a range
    constraint nor an assertion in its graph."""

    def forward(self, x):
        if x.shape[1] % 2 == 0:
            return x.sigmoid()
        return x.tanh()


class _NotFive(nn.Module):
    """A forward that branches on one size: the export's guard is ``T != 5``."""

    def forward(self, x):
        if x.shape[1] == 5:
            return x * 100
        return x


@pytest.mark.parametrize("model, lengths, served", [(_Parity(), (3, 5, 7, 6, 4, 9), (0, 0, 1, 1, 1, 2)),
                                                    (_NotFive(), (3, 4, 7, 5, 8), (0, 0, 1, 1, 2))])
def test_a_size_that_breaks_a_guard_of_the_symbolic_export_is_exported_again(model, lengths, served):
    """The symbolic export made at the third length took one branch, and its shape environment guards it (a
    parity, a ``!=``). A later length that breaks the guard takes eager's other branch: it is exported by itself,
    not served from that export; lengths that keep the guard are still served. Every output is eager's."""
    fused = AutoFusionEngine.fuse(model)
    for t, n in zip(lengths, served):
        x = torch.randn(2, t, 16)
        with torch.no_grad():
            torch.testing.assert_close(fused(x), model(x), rtol=1e-6, atol=1e-6)
        assert _served(fused) == n, t


def test_an_exported_programs_guard_refuses_a_size_its_module_refuses():
    """fuse() of an ExportedProgram made with Dim.AUTO: the sizes its guard allows are served from one export
    (as ep.module() runs them); a size its guard refuses (ep.module() raises) is refused naming the guard, with
    the advice to export again, not run through the branch the program took."""
    from autofuse.capture import CaptureError
    ep = torch.export.export(_Parity(), (torch.randn(2, 7, 16),),
                             dynamic_shapes={"x": {1: torch.export.Dim.AUTO}}, strict=False)
    fused = AutoFusionEngine.fuse(ep)
    with torch.no_grad():
        for t in (7, 9, 11):
            x = torch.randn(2, t, 16)
            torch.testing.assert_close(fused(x), x.tanh(), rtol=1e-6, atol=1e-6)
        assert _served(fused) == 1
        with pytest.raises(AssertionError, match="Guard failed"):
            ep.module()(torch.randn(2, 6, 16))
        with pytest.raises(CaptureError, match=r"(?s)Guard failed: x\.size\(\)\[1\] % 2 != 0.*branches on the "
                                                r"size.*export again at these sizes"):
            fused(torch.randn(2, 6, 16))


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_generate_still_shares_one_export_with_the_guards_checked(kind):
    """A control: a decode step's export holds guards too (a length that is not 1, relations of the cache and
    the mask), and they hold at every later length: a tiny Llama's and GPT-2's generate() serve all decode steps
    after the first from one symbolic export, with eager's tokens."""
    tf = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if kind == "llama":
        model = tf.LlamaForCausalLM(tf.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                                   num_hidden_layers=1, num_attention_heads=4,
                                                   num_key_value_heads=2, max_position_embeddings=64))
    else:
        model = tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=128, n_layer=1, n_embd=64, n_head=4, n_positions=64))
    model.eval()
    ids = torch.randint(1, 128, (2, 5))
    fused = AutoFusionEngine.fuse(model)
    settings = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        want = model.generate(ids, **settings)
        got = fused.generate(ids, **settings)
    assert torch.equal(got, want)
    decode = [f for f in fused._sizes.families.values() if f.programs]
    assert len(decode) == 1 and len(decode[0].programs) == 1
    assert len(fused.plans) == 8 and _served(fused) == 6          # the prompt, the first decode step alone, 6 served
