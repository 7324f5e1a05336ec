"""Where the TP code path's time goes at world size 1 (issue #51 part 4): the plain Qwen3 (8B widths, 2 layers) and
the same model sharded by parallelize_module on a mesh of 1 and prepared by detkit, one forward+backward step each
under detkit mode (4 x 512 tokens, log-prob sum), profiled by torch.profiler after two warm-up steps. Writes each
path's operator table (by device time, then by host time) and the step's device and wall time to OUT.

    python -m tools.world1_profile --out /path/to/world1-profile.md      # one CUDA GPU (NCCL, world size 1)
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import torch

ROWS = 25


def _step(model, ids):
    from detkit.audits.model_parallel import logprobs

    import detkit

    model.zero_grad(set_to_none=True)
    with detkit.batch_invariant_mode():
        lp = logprobs(model(input_ids=ids).logits, ids)
        (-lp.sum()).backward()


def _profile(name: str, model, ids, steps: int) -> str:
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    for _ in range(2):
        _step(model, ids)
    torch.cuda.synchronize()
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            _step(model, ids)
        torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - start) * 1e3 / steps
    events = prof.key_averages()
    # The kernels' own rows only: an op's row carries its kernels' time again (as the table's footer counts).
    device_ms = sum(e.self_device_time_total for e in events
                    if e.device_type == DeviceType.CUDA and not e.is_user_annotation) / 1e3 / steps
    return "\n".join([
        f"## {name}", "",
        f"- per step under the profiler: wall {wall_ms:.2f} ms, device {device_ms:.2f} ms (the kernels' own time)",
        "", "### by device time", "", "```",
        events.table(sort_by="self_device_time_total", row_limit=ROWS, max_name_column_width=70), "```", "",
        "### by host time", "", "```",
        events.table(sort_by="self_cpu_time_total", row_limit=ROWS, max_name_column_width=70), "```", ""])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU (NCCL process group of world size 1)")
    import torch.distributed as dist
    from detkit.audits.model_parallel import MODELS, build_model, torch_plan
    from detkit.mode.parallel import prepare
    from detkit.toolkit.models import QWEN3_8B_WIDTHS
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    torch.cuda.set_device(0)
    init = Path(tempfile.mkdtemp()) / "init"
    dist.init_process_group("nccl", init_method=f"file://{init}", rank=0, world_size=1)
    try:
        device = torch.device("cuda", 0)
        MODELS["_gpu"] = ("qwen3", dict(QWEN3_8B_WIDTHS))
        ids = torch.randint(0, 151936, (4, 512), generator=torch.Generator().manual_seed(0)).to(device)
        parts = [(f"# TP path at world size 1 against the plain model ({torch.cuda.get_device_name()}, torch "
                 f"{torch.__version__})"), ""]
        plain = build_model("_gpu", device, 0)
        parts.append(_profile("plain", plain, ids, args.steps))
        del plain
        tp = build_model("_gpu", device, 0)
        parallelize_module(tp, init_device_mesh("cuda", (1,)), torch_plan("qwen3"))
        prepare(tp, torch_plan("qwen3"))
        parts.append(_profile("tp_world1", tp, ids, args.steps))
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text("\n".join(parts))
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
