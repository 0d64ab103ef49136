"""The networkx pattern engine: variants generated from one declaration (optional nodes and groups bypassed,
chains of every length), matching seeded at the anchor, constraint functions deciding, DOT drawing."""
import operator

import torch
import torch.fx as fx

from patterns.template import Template, graph_view

aten = torch.ops.aten


def _chain_template():
    return (Template("t", anchor="out")
            .node("src", aten.matmul.default)
            .chain("mid", {aten.mul.Tensor, aten.add.Tensor}, "src", "out", max_len=3, arg=0)
            .node("out", aten.softmax.int)
            .node("opt", aten.neg.default, optional=True).edge("opt", "src", 0))


def test_variants_cover_every_chain_length_and_optional_choice():
    t = _chain_template()
    vs = t.variants()
    sizes = sorted(g.number_of_nodes() for g in vs)
    # chains of 0..3 members, the optional node in or out: 8 variants, from 2 to 6 nodes
    assert sizes == [2, 3, 3, 4, 4, 5, 5, 6]
    assert vs[0].number_of_nodes() == 6 and list(vs[0].nodes)[0] == "out"     # largest first, anchor first
    for g in vs:                                                               # a bypassed chain still connects
        members = sorted((n for n in g if n.startswith("mid")), key=lambda n: int(n[3:]))
        path = ["src"] + members + ["out"]
        assert all(g.has_edge(a, b) for a, b in zip(path, path[1:]))
        assert g.edges[path[-2], "out"]["arg"] == 0


def test_optional_group_is_kept_or_left_out_together():
    t = (Template("g", anchor="b").node("a", aten.exp.default).node("b", aten.log.default)
         .node("x", aten.neg.default, optional="grp").node("y", aten.abs.default, optional="grp")
         .edge("a", "x", 0).edge("x", "y", 0).edge("y", "b", 0))
    vs = t.variants()
    assert sorted(sorted(g.nodes) for g in vs) == [["a", "b"], ["a", "b", "x", "y"]]
    small = next(g for g in vs if g.number_of_nodes() == 2)
    assert small.has_edge("a", "b") and small.edges["a", "b"]["arg"] == 0         # bypassed at y's position


class _Chain(torch.nn.Module):
    def __init__(self, n_ops):
        super().__init__()
        self.n_ops = n_ops

    def forward(self, a, b):
        s = a @ b
        for i in range(self.n_ops):
            s = s * 2.0 if i % 2 == 0 else s + 1.0
        return torch.softmax(s, -1)



def _aten(module, *args):
    from autofuse.capture import capture
    return capture(module, args).graph_module


def test_match_finds_the_exact_chain_length_and_the_constraint_decides():
    t = _chain_template()
    a, b = torch.randn(4, 4), torch.randn(4, 4)
    for n_ops in range(4):
        gm = _aten(_Chain(n_ops), a, b)
        seen = []
        found = t.match(graph_view(gm), lambda m: seen.append(m) or sorted(m))
        assert len(found) == 1 and sum(k.startswith("mid") for k in found[0]) == n_ops
        assert seen[0]["out"].target == aten.softmax.int and seen[0]["src"].target == aten.matmul.default
    gm = _aten(_Chain(2), a, b)
    assert t.match(graph_view(gm), lambda m: None) == []                          # rejected by the constraint


def test_a_chain_longer_than_declared_does_not_match():
    t = _chain_template()
    gm = _aten(_Chain(5), torch.randn(4, 4), torch.randn(4, 4))
    assert t.match(graph_view(gm), lambda m: m) == []


def test_edge_argument_positions_are_checked():
    # sub(x, y) reads the matmul at position 1: a template asking for position 0 must not match
    t = (Template("p", anchor="s").node("m", aten.matmul.default).node("s", aten.sub.Tensor).edge("m", "s", 0))

    class M(torch.nn.Module):
        def forward(self, a, b):
            return a.sum() - a @ b

    gm = _aten(M(), torch.randn(3, 3), torch.randn(3, 3))
    assert t.match(graph_view(gm), lambda m: m) == []
    t2 = (Template("p", anchor="s").node("m", aten.matmul.default).node("s", aten.sub.Tensor).edge("m", "s", 1))
    assert len(t2.match(graph_view(gm), lambda m: m)) == 1


def test_to_dot_names_every_node_and_marks_the_anchor():
    dot = _chain_template().to_dot()
    assert dot.startswith('digraph "t"') and '"out"' in dot and "bold" in dot and "dashed" in dot
    assert dot.count("->") == 5


def test_getitem_predicates_work_on_multi_output_ops():
    def item(i):
        return lambda n: n.args[1] == i
    t = (Template("k", anchor="top").node("top", aten.topk.default)
         .node("v", operator.getitem, where=item(0)).edge("top", "v", 0)
         .node("i", operator.getitem, where=item(1)).edge("top", "i", 0))

    class M(torch.nn.Module):
        def forward(self, x):
            v, i = x.topk(2)
            return v * 2, i

    gm = _aten(M(), torch.randn(5, 7))
    (m,) = t.match(graph_view(gm), lambda m: m)
    assert m["v"].args[1] == 0 and m["i"].args[1] == 1
