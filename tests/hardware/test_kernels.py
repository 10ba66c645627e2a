"""A kernel table read into a hardware file's compute rates (hardware/kernels.py, calibrate
--from-kernels): against rows made from chosen rates, and the shipped H100 file against the
measurement it says it came from."""

import json
import subprocess
import sys

import pytest

from megatron_dynapipe.hardware import load_hardware
from megatron_dynapipe.hardware.kernels import KernelTableError, read_kernel_table
from project import ROOT

PEAK, BANDWIDTH = 1000.0, 3000.0  # TFLOP/s and GB/s of a made-up device


def _attention_rows(backend, forward, backward):
    rows = []
    for seq in (2048, 4096, 8192):
        for heads in (8, 32):
            causal = seq * seq * 128 * heads  # 2 s^2 d / 2 per GEMM and head
            rows.append(dict(kind="attention", backend=backend, seq=seq, head_dim=128, heads=heads,
                             forward_ms=2 * causal / (forward[0] * PEAK * 1e9) + forward[1] / 1e3,
                             backward_ms=5 * causal / (backward[0] * PEAK * 1e9) + backward[1] / 1e3))
    return rows


def _made_table(path, *, gemm=0.7, copy=0.9, forward=(0.6, 50.0), backward=(0.5, 200.0), flash=None):
    """Rows a device of these rates would measure: large GEMMs at ``gemm`` of the peak (small ones
    slower, which the rate must not see), copies at ``copy`` of the bandwidth and below, and causal
    attention taking its FLOPs at the phase's rate plus its latency (forward 2 GEMMs over the
    causal half, backward 5)."""
    rows = [dict(kind="gemm", m=m, n=8192, k=8192, tflops=PEAK * gemm, measured_over_roofline=1.0)
            for m in (8192, 16384, 32768)]
    rows += [dict(kind="gemm", m=256, n=1024, k=1024, tflops=PEAK * gemm / 3, measured_over_roofline=1.4)]
    rows += [dict(kind="copy", GBps=BANDWIDTH * copy), dict(kind="copy", GBps=BANDWIDTH * copy / 2)]
    rows += _attention_rows("CUDNN_ATTENTION", forward, backward)
    rows += _attention_rows("FLASH_ATTENTION", *flash) if flash else []
    rows.append(dict(kind="attention", backend="FLASH_ATTENTION", seq=16384, error="out of memory"))
    path.write_text(json.dumps(dict(device="made-up", peak_tflops=PEAK, rows=rows)))
    return path


def test_the_rates_are_those_the_rows_were_made_with(tmp_path):
    table = read_kernel_table(_made_table(tmp_path / "k.json"))
    compute = table.compute_section({"sms": 100, "gemm_tile": [128, 128]}, BANDWIDTH)
    assert (compute["sms"], compute["gemm_tile"]) == (100, [128, 128])  # the device's own, kept
    assert (compute["gemm_efficiency"], compute["memory_efficiency"]) == (0.7, 0.9)
    assert compute["fused_attention"] == pytest.approx(dict(forward_efficiency=0.6, forward_latency_us=50.0,
                                                            backward_efficiency=0.5, backward_latency_us=200.0))
    assert "sdpa_attention" not in compute  # torch's flash kernel failed on its one shape: SDPA priced as fused
    with pytest.raises(KernelTableError, match="needs GEMMs of at least 1 TFLOP, a copy and flash_attention "
                                               r"attention rows \(its attention backends: cudnn_attention\)"):
        table.compute_section({}, BANDWIDTH, backend="flash_attention")  # it failed on its one shape
    with pytest.raises(KernelTableError, match="ran above this hardware file's peaks .* give --hardware the file of "
                                               "the device measured"):
        table.compute_section({}, BANDWIDTH / 1.4)  # measured on a device of more bandwidth than the file says


def test_torchs_flash_kernel_where_measured_prices_the_sdpa_core(tmp_path):
    table = read_kernel_table(_made_table(tmp_path / "k.json", flash=((0.3, 80.0), (0.25, 300.0))))
    compute = table.compute_section({"sms": 100, "sdpa_attention": {"forward_efficiency": 0.9}}, BANDWIDTH)
    assert compute["sdpa_attention"] == pytest.approx(dict(forward_efficiency=0.3, forward_latency_us=80.0,
                                                           backward_efficiency=0.25, backward_latency_us=300.0))
    assert compute["fused_attention"]["forward_efficiency"] == pytest.approx(0.6)


def test_the_shipped_h100_rates_are_what_calibrate_reads_from_its_kernel_table(tmp_path):
    """hardware/h100-80gb-sxm.json says its compute rates were measured into
    benchmarks/results/h100-kernels.json: calibrate --from-kernels reads them back, to the file's
    rounding."""
    out = tmp_path / "h100.json"
    run = subprocess.run([sys.executable, "-m", "megatron_dynapipe.cli", "calibrate", "--from-kernels",
                          str(ROOT / "benchmarks/results/h100-kernels.json"), "--hardware", "h100", "-o", str(out)],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    shipped, measured = load_hardware("h100"), load_hardware(out)
    for key in ("gemm_efficiency", "memory_efficiency"):
        assert measured.compute[key] == pytest.approx(shipped.compute[key], abs=0.005)
    for line in ("fused_attention", "sdpa_attention"):
        assert measured.compute[line] == pytest.approx(shipped.compute[line], abs=0.1)
    assert "NVIDIA H100 80GB HBM3" in measured.source and measured.source.startswith(shipped.source)
    assert measured.peak_tflops == shipped.peak_tflops and measured.inter_node == shipped.inter_node


@pytest.mark.parametrize("text,says", [
    ("not json", "is not JSON"),
    ("[1, 2]", "a kernel table is an object with 'rows'"),
    ('{"rows": [], "peak_tflops": 0}', "a kernel table is an object with 'rows'"),
    ('{"rows": [{"kind": "gemm", "m": 1}], "peak_tflops": 989}', "row 0 is not a gemm, attention or copy"),
])
def test_a_table_that_is_not_one_is_refused_in_one_line(tmp_path, text, says):
    path = tmp_path / "k.json"
    path.write_text(text)
    run = subprocess.run([sys.executable, "-m", "megatron_dynapipe.cli", "calibrate", "--from-kernels", str(path),
                          "-o", str(tmp_path / "out.json")], capture_output=True, text=True)
    assert run.returncode == 2 and says in run.stderr and run.stderr.count("\n") == 1, run.stderr
    assert not (tmp_path / "out.json").exists()
