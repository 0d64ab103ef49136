"""How planning on meta tensors scales with model size: ``autofuse report --meta`` on Llama configurations and
four MoE models: Mixtral-8x7B (8 experts of 14336, top-2), Qwen3-MoE-30B-A3B (128 experts of 768, top-8),
GPT-OSS-120B's shapes (``GptOssConfig``'s defaults: 36 layers, attention sinks, sliding windows every other
layer, 128 experts of 2880 with biases and a clamped SwiGLU, top-4) and Llama 4 Scout's (``Llama4TextConfig``'s
defaults: 48 layers, 16 experts of 8192 in the dense form, top-1, a shared expert); and Mistral-7B v0.1 at 8192
tokens, past its 4096-key sliding window (``--long``: the window proven from a mask of 2 x 8192^2 values and run
as the kernel's band).

Each configuration runs in its own process (``autofuse report --model 'transformers:LlamaConfig?...' --seq 2048
--meta``, the command line's own code path); the table gives each stage's wall time and the process's peak
resident memory when the stage ended (a high-water mark: the stage that raised it is the one where it grows),
then the whole run's wall time, CPU time (user + system: less sensitive than wall time to other processes on a
shared machine) and peak memory, and per layer; under each row, the report's predicted whole-graph speed-up.

    python benchmarks/scale.py                     # L = 8, 16, 32 (Llama-7B shapes), the 70B-class shape, the MoE models
    python benchmarks/scale.py --layers 8 16       # only these Llama-7B-shaped depths
    python benchmarks/scale.py --layers --no-70b --no-moe --long    # only Mistral-7B at 8192 tokens
"""
import argparse
import io
import os
import resource
import subprocess
import sys
import time

STAGES = ("build model", "capture", "canonicalize", "match", "plan", "verify", "rewrite")   # verify: within plan
SEVENTY_B = "hidden_size=8192&num_attention_heads=64&num_key_value_heads=8&intermediate_size=28672"


def _worker(model: str, seq: int) -> None:
    """Run the report in this process; print one line per stage: name, seconds, peak RSS (bytes) so far."""
    from autofuse import cli

    def stage(self, name, seconds, detail=""):
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        print(f"STAGE\t{name}\t{seconds:.3f}\t{peak}", file=sys.stderr, flush=True)
        if "of which verify" in detail:          # verify runs inside plan
            print(f"STAGE\tverify\t{detail.split('of which verify')[1].split()[0]}\t{peak}", file=sys.stderr,
                  flush=True)

    cli.Progress.stage = stage
    out = io.StringIO()
    old, sys.stdout = sys.stdout, out
    try:
        status = cli.main(["report", "--model", model, "--seq", str(seq), "--meta", "-v"])
    finally:
        sys.stdout = old
    for line in out.getvalue().splitlines():
        if "whole graph (predicted)" in line:
            print(f"SPEED\t{line.strip()}", file=sys.stderr, flush=True)
    sys.exit(status or 0)


def run(model: str, seq: int) -> dict:
    """One configuration in a child process: its stages, wall time, CPU time and peak memory."""
    t0 = time.perf_counter()
    child = subprocess.Popen([sys.executable, __file__, "--worker", model, "--seq", str(seq)],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    err = child.stderr.read()
    _, status, usage = os.wait4(child.pid, 0)
    wall = time.perf_counter() - t0
    if status:
        raise RuntimeError(f"{model}: the report failed:\n{err[-2000:]}")
    stages, speed = {}, ""
    for line in err.splitlines():
        if line.startswith("STAGE\t"):
            _, name, sec, peak = line.split("\t")
            stages[name] = (float(sec), int(peak))
        elif line.startswith("SPEED\t"):
            speed = line.split("\t", 1)[1]
    return {"stages": stages, "wall": wall, "cpu": usage.ru_utime + usage.ru_stime,
            "peak": usage.ru_maxrss * 1024, "speed": speed}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, nargs="*", default=[8, 16, 32])
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--no-70b", action="store_true", help="skip the 70B-class configuration")
    ap.add_argument("--no-moe", action="store_true",
                    help="skip Mixtral-8x7B, Qwen3-MoE-30B-A3B, GPT-OSS-120B and Llama 4 Scout (MixtralConfig's, "
                         "Qwen3MoeConfig's, GptOssConfig's and Llama4TextConfig's defaults)")
    ap.add_argument("--long", action="store_true", help="add Mistral-7B v0.1 at 8192 tokens (its sliding window)")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        _worker(a.worker, a.seq)
        return
    configs = [(f"Llama-7B shapes, L={L}", L, f"transformers:LlamaConfig?num_hidden_layers={L}", a.seq)
               for L in a.layers]
    if not a.no_70b:
        configs.append(("70B-class, L=80", 80, f"transformers:LlamaConfig?num_hidden_layers=80&{SEVENTY_B}", a.seq))
    if not a.no_moe:
        configs.append(("Mixtral-8x7B, L=32", 32, "transformers:MixtralConfig?num_hidden_layers=32", a.seq))
        configs.append(("Qwen3-MoE-30B-A3B, L=48", 48, "transformers:Qwen3MoeConfig?num_hidden_layers=48", a.seq))
        configs.append(("GPT-OSS-120B, L=36", 36, "transformers:GptOssConfig", a.seq))
        configs.append(("Llama-4-Scout, L=48", 48, "transformers:Llama4TextConfig", a.seq))
    if a.long:
        configs.append(("Mistral-7B, L=32, S=8192", 32, "transformers:MistralConfig", 8192))
    print(f"autofuse report --meta --seq {a.seq}: wall seconds per stage [peak GB when it ended]; load average "
          f"at start {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    head = f"{'configuration':<26}" + "".join(f"{s:>17}" for s in STAGES) + \
        f"{'wall':>8}{'cpu':>8}{'peak GB':>9}{'cpu/layer':>11}"
    print(head)
    for label, layers, model, seq in configs:
        r = run(model, seq)
        cells = "".join(f"{r['stages'][s][0]:>9.2f} [{r['stages'][s][1] / 1e9:4.2f}]" if s in r["stages"]
                        else f"{'-':>17}" for s in STAGES)
        print(f"{label:<26}{cells}{r['wall']:>8.1f}{r['cpu']:>8.1f}{r['peak'] / 1e9:>9.2f}"
              f"{r['cpu'] / layers:>11.2f}", flush=True)
        if r["speed"]:
            print(f"{'':<26}{r['speed']}", flush=True)
    print(f"load average at end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
