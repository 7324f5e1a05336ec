"""Does det_gemm's "tf32" backward get faster when the operand with a strided reduced dim is read as the MMA's A?

wgmma's TF32 form takes K-major operands from shared memory; Triton feeds an operand whose reduced dim is strided by
transposing each tile through shared memory (dA reads nn.Linear's weight [N, K] over N; dB reads both operands over
M). An A operand may instead come from registers, loaded from shared memory in any order. This probe times, at
lm_head shapes and "tf32" products, GPU time (CUDA-graph replay, ``toolkit.timing.time_graphs``) against
torch.matmul at "high":

- ``da``: the direct kernel (``det_gemm_da_launch``, the launchers keep it) against ``det_gemm_fwd(weight.t(),
  grad.t()).t()``, the transposed product [K, M] whose A is the weight's M-major view and whose B is grad, K-major;
- ``db``: the direct kernel (``det_gemm_db_launch``) against ``det_gemm_fwd(grad.t(), x.t().contiguous().t())``,
  [N, K] = grad.T @ x with x copied once so that B is K-major (the copy inside the timed call).

``det_gemm_da`` / ``det_gemm_db`` themselves run the forward products from ``TF32_DA_TRANSPOSED_MIN_ROWS`` /
``TF32_DB_TRANSPOSED_MIN_ROWS`` rows; the probe times both forms so the thresholds can be re-measured.

Each variant's result is compared with torch.matmul's (max relative error) and with the direct kernel's (bits
equal or not). Rows print and land in ``--json``.

    python -m tools.tf32_operand_probe --device cuda --kn 4096,151936 --m 128 1024 4096 --json OUT.json
"""

from __future__ import annotations

import argparse
import json

import torch


def _variants(op: str, x, w, grad):
    from detkit.kernels.det_gemm.launch import det_gemm_da_launch, det_gemm_db_launch, det_gemm_fwd

    if op == "da":
        return {"torch": lambda: grad @ w, "direct": lambda: det_gemm_da_launch(grad, w.t(), precision="tf32")[0],
                "swapped": lambda: det_gemm_fwd(w.t(), grad.t(), "tf32").t()}
    return {"torch": lambda: grad.t() @ x, "direct": lambda: det_gemm_db_launch(grad, x, precision="tf32")[0],
            "swapped": lambda: det_gemm_fwd(grad.t(), x.t().contiguous().t(), "tf32")}


def probe(device: torch.device, k: int, n: int, m: int, rounds: int) -> list[dict]:
    from detkit.toolkit.timing import time_graphs

    gen = torch.Generator(device="cpu").manual_seed(m)
    x = torch.randn(m, k, generator=gen).to(device)
    w = (torch.randn(n, k, generator=gen) * k**-0.5).to(device)
    grad = (torch.randn(m, n, generator=gen) * n**-0.5).to(device)
    rows = []
    for op in ("da", "db"):
        fns = _variants(op, x, w, grad)
        outs = {name: fn() for name, fn in fns.items()}
        ref = outs["torch"].double()
        timings = time_graphs(fns, device, calls_per_fn=2, rounds=rounds)
        for name, out in outs.items():
            err = float((out.double() - ref).abs().max() / ref.abs().max())
            rows.append({"op": op, "k": k, "n": n, "m": m, "impl": name, "graph_us": timings[name].median_us,
                         "ratio_vs_torch": timings[name].median_us / timings["torch"].median_us,
                         "max_rel_err_vs_torch": err,
                         "bits_as_direct": bool(torch.equal(out.contiguous(), outs["direct"].contiguous()))})
            print(f"{op} K={k} N={n} M={m} {name:8s} {rows[-1]['graph_us']:10.1f} us "
                  f"x{rows[-1]['ratio_vs_torch']:.3f} err {err:.2e} bits_as_direct {rows[-1]['bits_as_direct']}",
                  flush=True)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--kn", nargs="+", default=["4096,151936"], metavar="K,N")
    parser.add_argument("--m", nargs="+", type=int, default=[128, 1024, 4096])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    torch.backends.cuda.matmul.allow_tf32 = True  # torch.matmul at "high": the precision the probe compares
    rows = []
    for kn in args.kn:
        k, n = (int(v) for v in kn.split(","))
        for m in args.m:
            rows += probe(device, k, n, m, args.rounds)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
