"""Test device selection. CPU runs (CI) use the Triton interpreter, which must be switched on before any
detkit kernel is imported; GPU runs set DETKIT_TEST_DEVICE=cuda and run the `gpu`-marked tests."""

import os

import pytest

# Under pytest-xdist each worker gets its share of the cores for torch's (and the processes it starts') CPU threads:
# two workers of two threads each on CI's two cores made OpenMP threads wait on each other (two copies of a file of
# model tests at once took 124 s, 101 s with one thread each; of an interpreter file 53 s against 45 s). A value the
# caller set is kept.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
if _WORKERS:
    _cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, _cores // _WORKERS)))

import torch  # noqa: E402 - after the thread count, which torch reads when it starts its thread pool

if _WORKERS:
    _threads = os.environ["OMP_NUM_THREADS"]
    if not _threads.isdigit() or int(_threads) < 1:
        raise pytest.UsageError(f"OMP_NUM_THREADS={_threads!r}; supported: a positive integer")
    torch.set_num_threads(int(_threads))

TEST_DEVICE = os.environ.get("DETKIT_TEST_DEVICE", "cpu")
if TEST_DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"
elif TEST_DEVICE != "cuda":
    raise pytest.UsageError(f"DETKIT_TEST_DEVICE={TEST_DEVICE!r}; supported: cpu, cuda")


# Tests whose gloo ranks hold CPU tensors: the kernels run in the Triton interpreter, which DETKIT_TEST_DEVICE=cpu
# selects. The NCCL form of these checks is the two-GPU run (tools/run_x2_suite.sh).
cpu_ranks_only = pytest.mark.skipif(TEST_DEVICE != "cpu", reason="gloo ranks on CPU tensors need the Triton "
                                    "interpreter (DETKIT_TEST_DEVICE=cpu); the NCCL form is the two-GPU run")


def hopper_available() -> bool:
    return TEST_DEVICE == "cuda" and torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def pytest_collection_modifyitems(config, items):
    if hopper_available():
        return
    reason = ("needs a Hopper GPU: run with DETKIT_TEST_DEVICE=cuda on an sm_90 host"
              if TEST_DEVICE != "cuda" else "DETKIT_TEST_DEVICE=cuda but no sm_90 GPU is visible")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture
def device() -> torch.device:
    return torch.device(TEST_DEVICE)


def backend_of(device: torch.device) -> str:
    """The backend the kernels run on for tensors on ``device`` in the tests (kernels.backend names)."""
    return "triton_interpreter" if device.type == "cpu" else "cuda_sm90"


def two_cuda_gpus() -> bool:
    """Two CUDA GPUs on this host (the NCCL tests' pair)."""
    return torch.cuda.is_available() and torch.cuda.device_count() >= 2


def assert_bits_equal(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Raw bits equal (+0 and -0 differ, NaN fails), naming ``what``, the mismatch count and the first index."""
    from detkit.toolkit.contract import compare_bits

    result = compare_bits(got, want)
    assert result.equal, f"{what}: {result.mismatches}/{result.elements} differ, first at {result.first_mismatch}"
