"""The in-memory hand-off reference (the GPU sweep's yardstick for P/D pairs whose layouts
differ): latents moved by position between layouts decode to the tokens of the same model run
whole, bit for bit where prefill and decode share a layout."""

from __future__ import annotations

import pytest

from pdd_sidecar.engine.generate import generate
from pdd_sidecar.engine.handoff_reference import handoff_generate

pytestmark = pytest.mark.dataplane

PROMPTS = [list(range(40, 45)), list(range(40, 77))]  # within one block of 4; ten blocks
BLOCK = 4
STEPS = 12


@pytest.mark.parametrize("prefill,decode", [((2, 2), (2, 1)), ((1, 1), (2, 2)),
                                            ((2, 1), (1, 1)), ((2, 2), (1, 1))])
def test_pairs_of_layouts_give_the_single_rank_tokens_in_fp32(
        prefill: tuple[int, int], decode: tuple[int, int]) -> None:
    got = handoff_generate("builtin", PROMPTS, STEPS, prefill, decode, block_size=BLOCK)
    want = [generate("builtin", p, STEPS, block_size=BLOCK) for p in PROMPTS]
    assert got == want


@pytest.mark.parametrize("layout", [(2, 2), (2, 1)])
def test_one_layout_on_both_sides_equals_its_single_instance_in_bf16(
        layout: tuple[int, int]) -> None:
    """bf16 keeps every rounding: a latent in a wrong slot or rank would change the tokens."""
    got = handoff_generate("builtin", PROMPTS, STEPS, layout, layout, dtype="bfloat16",
                           block_size=BLOCK)
    want = [generate("builtin", p, STEPS, *layout, dtype="bfloat16", block_size=BLOCK)
            for p in PROMPTS]
    assert got == want


def test_bad_layout_names_the_side() -> None:
    with pytest.raises(ValueError, match="decode: dcp must be 1 or tp"):
        handoff_generate("builtin", PROMPTS, STEPS, (2, 2), (2, 3))
    with pytest.raises(ValueError, match="max_tokens"):
        handoff_generate("builtin", PROMPTS, 0, (1, 1), (1, 1))
