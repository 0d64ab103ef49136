"""cost_model.alternatives: the implementation choices of a program, priced and sorted."""
import cost_model
from cost_model.program import Builder


def rms(lead, H, dt="float16"):
    b = Builder(lead)
    x, w = b.input(dt, tuple(lead) + (H,)), b.input(dt, (H,))
    xf = b.cast(x, dtype="float32")
    r = b.rsqrt(b.add(b.reduce(b.mul(xf, xf), kind="mean"), 1e-6))
    b.output(b.mul(b.cast(b.mul(xf, r), dtype=dt), w), dt)
    return b.build()


def test_alternatives_are_priced_and_sorted():
    alts = cost_model.alternatives(rms((4096,), 4096))
    names = [n for n, _ in alts]
    assert "vector_program" in names and "vector_program/one pass" in names
    assert any(n.startswith("vector_program/chunked") for n in names)
    assert [e.cycles for _, e in alts] == sorted(e.cycles for _, e in alts)
    b = Builder((4096,))
    x, c = b.input("float16", (4096, 128)), b.input("float16", (4096, 128))
    rot = b.cat(b.neg(b.slice(x, start=64, stop=128)), b.slice(x, start=0, stop=64))
    b.output(b.add(b.mul(x, c), b.mul(rot, c)), "float16")
    names = {n for n, _ in cost_model.alternatives(b.build(), "ascend910b")}
    assert {"vector_program", "rope on Cube", "rope on Cube, fused"} <= names


def test_epilogue_alternatives():
    b = Builder((512,))
    b.output(b.gelu(b.input("float16", (512, 1024))), "float16")
    alts = dict(cost_model.epilogue_alternatives(((512, 256), "float16"), ((256, 1024), "float16"), b.build()))
    assert set(alts) == {"matmul_epilogue", "matmul + vector_program"}
    two = alts["matmul + vector_program"]
    assert len(two.notes) == 2 and two.cycles == sum(int(n.split(": ")[1].split(" ")[0].replace(",", ""))
                                                     for n in two.notes)
