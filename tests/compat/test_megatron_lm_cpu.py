"""Megatron-LM's training loop on the CPU: the redirection reaches only the bodies its spots name,
a stale spot patches nothing, and disabling puts everything back.  (Its spots against a real
checkout are checked in tests/megatron_lm/test_megatron_lm.py, with MEGATRON_LM_DIR.)"""

import pytest

from megatron_dynapipe.compat import megatron_lm_cpu
from megatron_dynapipe.compat.patching import Spot, UpstreamChanged

FAKE_SPOTS = '''
import torch

def spot_body():
    t = torch.zeros(2, device="cuda")
    return t.device.type, str(torch.cuda.current_device())

def spot_calling_other():
    torch.zeros(1, device="cuda")
    return not_a_spot()

def not_a_spot():
    return torch.zeros(1, device="cuda").device.type

def needs_cuda():
    raise AssertionError("Megatron requires CUDA.")
'''


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks CPU redirection on a machine without CUDA")
def test_cpu_redirection_reaches_only_the_named_bodies(tmp_path, monkeypatch):
    (tmp_path / "fake_lm_spots.py").write_text(FAKE_SPOTS)
    monkeypatch.syspath_prepend(str(tmp_path))
    import fake_lm_spots as m

    spots = (
        Spot("fake_lm_spots", "spot_body", ('device="cuda"',), "test", kind="body", cuda=("current_device",)),
        Spot("fake_lm_spots", "spot_calling_other", ('device="cuda"',), "test", kind="body"),
        Spot("fake_lm_spots", "needs_cuda", ("Megatron requires CUDA",), "test", kind="replace",
             replacement=lambda original: (lambda: "replaced")),
    )
    stale = Spot("fake_lm_spots", "not_a_spot", ("torch.cuda.Stream()",), "test", kind="body")
    with pytest.raises(UpstreamChanged, match=r"fake_lm_spots\.py:not_a_spot.*torch\.cuda\.Stream.*LM_CPU_SPOTS"):
        megatron_lm_cpu.enable_megatron_lm_cpu_mode(spots + (stale,))
    assert megatron_lm_cpu._cpu.mode is None  # a failed check patches nothing

    import torch

    megatron_lm_cpu.enable_megatron_lm_cpu_mode(spots)
    try:
        assert m.spot_body() == ("cpu", "cpu")
        assert m.needs_cuda() == "replaced"
        with pytest.raises((AssertionError, RuntimeError)):
            m.spot_calling_other()  # its own zeros are redirected; not_a_spot's are not
        with pytest.raises((AssertionError, RuntimeError)):
            m.not_a_spot()
        with pytest.raises((AssertionError, RuntimeError)):
            torch.cuda.current_device()  # only inside spot_body
        calls = megatron_lm_cpu.cpu_spot_calls()
        assert calls["fake_lm_spots.py:spot_body"] == 2 and calls["fake_lm_spots.py:needs_cuda"] == 1
    finally:
        megatron_lm_cpu.disable_megatron_lm_cpu_mode()
    with pytest.raises(AssertionError, match="Megatron requires CUDA"):
        m.needs_cuda()
    with pytest.raises((AssertionError, RuntimeError)):
        m.spot_body()
