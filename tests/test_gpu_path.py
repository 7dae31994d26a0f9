"""The GPU path's defects, checked on the CPU: stochastic-rounding seeds per distributed rank, the CPU-only
per-sample 1x1 backward with float32 accumulation, one host synchronisation per training step, no
count-sized compaction off the CPU, and a code version that covers the kernel headers. (The Triton kernels
themselves: tests/test_triton.py under the interpreter; tests/test_cuda.py on a GPU.)"""
import pytest
import torch
import torch.nn as nn

from division import engine
from division.codecs import BitMask, DivisionCodec, base
from division.codecs.compact import compact_relu
from division.codecs.division import DivisionPacked
from division.codecs.quant import QuantizedTensor
from division.compress import linear
from division.methods import build


@pytest.mark.parametrize("backend", ["compiled", "reference"])
def test_stochastic_rounding_differs_per_rank(backend, monkeypatch):
    """Every rank seeds its generators alike; the dither must still differ between ranks (else rounding
    errors are correlated and do not average out in the all-reduce), and stay reproducible per rank."""
    x = torch.randn(2, 4, 16, 16)

    def codes(rank):
        monkeypatch.setattr(base, "process_rank", lambda: rank)
        torch.manual_seed(0)
        return DivisionCodec(backend=backend).encode(x).hfc.packed

    assert torch.equal(codes(0), codes(0)) and torch.equal(codes(1), codes(1))
    assert not torch.equal(codes(0), codes(1)) and not torch.equal(codes(1), codes(2))


def test_rank_zero_keeps_the_plain_draw(monkeypatch):
    """A single process (and rank 0) draws exactly what it drew before ranks were mixed in."""
    monkeypatch.setattr(base, "process_rank", lambda: 0)
    torch.manual_seed(3)
    seed = base.rounding_seed()
    torch.manual_seed(3)
    assert seed == max(int(torch.randint(0, 2 ** 62, (1,)).item()), 2)


def test_per_sample_pointwise_backward_is_cpu_only():
    """The per-sample 1x1 backward was tuned on the CPU; on any other device the library's kernels run."""
    assert linear._runs_per_sample(torch.empty(8, 64, 56, 56), True)
    assert not linear._runs_per_sample(torch.empty(8, 64, 56, 56, device="meta"), True)
    assert not linear._runs_per_sample(torch.empty(8, 64, 14, 14), True)
    assert not linear._runs_per_sample(torch.empty(8, 64, 56, 56), False)


def test_per_sample_weight_gradient_accumulates_in_float32():
    """bf16 inputs (autocast on the CPU): the sum over samples is taken in float32, so the result is the
    float64 product of the same bf16 values to float32 precision (a bf16 accumulation misses by ~1e-2)."""
    torch.manual_seed(0)
    x = torch.randn(64, 8, 30, 30).to(torch.bfloat16)
    g = torch.randn(64, 16, 30, 30).to(torch.bfloat16)
    gw = linear._pointwise_weight_grad(x, g, (1, 1))
    exact = torch.einsum("nopq,nipq->oi", g.double(), x.double()).view(16, 8, 1, 1)
    assert gw.dtype == torch.float32
    # float32 sums of 57,600 products: relative error within 1e-5 of the largest entry
    assert (gw.double() - exact).abs().max() <= 1e-5 * exact.abs().max()


def test_compaction_is_skipped_off_the_cpu():
    """Compacting codes to the positive elements needs their count on the host: off the CPU the codec's
    output is kept as it is (no synchronisation per layer)."""
    meta = dict(device="meta")
    q = QuantizedTensor(torch.empty(16, dtype=torch.uint8, **meta), torch.empty(4, **meta), torch.empty(4, **meta),
                        2, 4, 16, torch.float32)
    packed = DivisionPacked(torch.empty(1, 4, 1, 1, **meta), q, (4, 4), torch.Size([1, 4, 4, 4]), torch.float32)
    mask = BitMask(torch.empty(8, dtype=torch.uint8, **meta), torch.Size([1, 4, 4, 4]))
    assert compact_relu(packed, mask) is packed


def test_one_host_read_per_training_step(monkeypatch):
    """train_one_epoch reads the device once per step (loss and hits together), and train_step makes no
    synchronisation of its own: on a GPU each one stalls the launch queue."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 10))
    method = build({"name": "fp"})
    method.prepare(model)
    batches = [(torch.randn(4, 3, 8, 8), torch.randint(0, 10, (4,))) for _ in range(3)]
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    state = engine.StepState(torch.device("cpu"), progress=False)
    reads, syncs = [], []
    for name in ("item", "tolist"):
        real = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda t, *a, _real=real, **k: (reads.append(1), _real(t, *a, **k))[1])
    monkeypatch.setattr(engine, "synchronize", lambda device: syncs.append(device))
    out = engine.train_one_epoch(model, method, batches, opt, None, state, epoch=0, measure=False)
    monkeypatch.undo()
    assert out["steps"] == 3 and out["throughput_img_s"] > 0
    assert len(reads) == 3 and not syncs, (len(reads), len(syncs))


def test_code_version_covers_kernel_headers(tmp_path):
    """A change to a C header changes the kernels, so it must invalidate cached runs."""
    from division.results import code_version
    header = tmp_path / "kernels" / "bits.h"
    header.parent.mkdir(parents=True)
    header.write_text("#define A 1\n")
    before = code_version(tmp_path)
    header.write_text("#define A 2\n")
    assert code_version(tmp_path) != before
