"""``PDD_PDL`` and the launch arguments it gives the step's Triton kernels: on by default for
launches of up to ``pdl.MAX_ROWS`` rows, never on the CPU (Triton's interpreter has no
grid-dependency instructions)."""

from __future__ import annotations

import pytest
import torch

from pdd_sidecar.model import fusion
from pdd_sidecar.model.kernels import pdl


@pytest.fixture(autouse=True)
def _fresh(monkeypatch: pytest.MonkeyPatch) -> object:
    monkeypatch.delenv(fusion.PDD_PDL, raising=False)
    fusion.set_fused(None)
    yield
    fusion.set_fused(None)


def test_the_default_until_the_environment_says(monkeypatch: pytest.MonkeyPatch) -> None:
    assert fusion.pdl() is fusion.PDL_DEFAULT
    for raw, want in (("0", False), ("1", True)):
        monkeypatch.setenv(fusion.PDD_PDL, raw)
        fusion.set_fused(None)
        assert fusion.pdl() is want
    fusion.set_fused(None, pdl=False)
    assert fusion.pdl() is False


def test_only_small_launches_on_a_capable_device(monkeypatch: pytest.MonkeyPatch) -> None:
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(pdl, "supported", lambda device: device.type == "cuda")
    fusion.set_fused(None, pdl=True)
    assert pdl.launch(cuda, pdl.MAX_ROWS) == {"PDL": True, "launch_pdl": True}
    assert pdl.launch(cuda, pdl.MAX_ROWS + 1) == {"PDL": False}
    fusion.set_fused(None, pdl=False)
    assert pdl.launch(cuda, 1) == {"PDL": False}


def test_a_bad_value_names_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(fusion.PDD_PDL, "yes")
    with pytest.raises(ValueError, match="PDD_PDL: must be 0 or 1, got 'yes'"):
        fusion.pdl()


def test_the_cpu_never_launches_as_a_dependent() -> None:
    fusion.set_fused(None, pdl=True)
    assert pdl.supported(torch.device("cpu")) is False
    assert pdl.launch(torch.device("cpu"), 1) == {"PDL": False}
