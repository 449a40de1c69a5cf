"""FP8 runs pad every trajectory so that each rank's linear layers get a token count FP8 GEMMs take
(``ParallelDims.seq_multiple`` with ``token_align``, from ``learner.precision``): 16 (32 for MXFP8)
tokens per rank's GEMM, on top of the TP (SP) and 2 x CP multiples. That the extra padding leaves
the gradient unchanged: ``tests/distributed/test_fp8_padding.py``."""

from __future__ import annotations

import math

import pytest

from megathunder.config import load_config
from megathunder.learner.micro_batches import padded_length
from megathunder.learner.parallel import ParallelDims, fp8_token_align

FP8 = ["learner.precision.layer_spec=transformer_engine", "learner.precision.fp8=e4m3"]


def test_fp8_runs_get_the_fp8_multiple_and_others_do_not():
    assert fp8_token_align(load_config(None, FP8).learner.precision) == 16
    assert fp8_token_align(load_config(None, [*FP8, "learner.precision.fp8_recipe=mxfp8"]).learner.precision) == 32
    assert fp8_token_align(load_config(None, []).learner.precision) == 1
    assert ParallelDims.of(load_config(None, FP8).learner, 1).seq_multiple == 16
    assert ParallelDims.of(load_config(None, []).learner, 1).seq_multiple == 1


@pytest.mark.parametrize("tp,sp,cp", [(1, False, 1), (2, True, 1), (4, True, 1), (8, True, 1), (32, True, 1),
                                      (1, False, 2), (2, True, 2), (1, False, 4), (4, True, 3)])
@pytest.mark.parametrize("align", [16, 32])
def test_each_ranks_gemm_tokens_are_a_multiple_of_the_fp8_alignment(tp, sp, cp, align):
    """Every padded length L keeps the layout's own multiple (SP splits L over TP; CP cuts 2 CP
    chunks) and gives each CP rank L / CP tokens -- what its GEMMs see, SP gathering the rest -- a
    multiple of the alignment; and no more padding than the least common multiple needs."""
    dims = ParallelDims(tp, 1, 1, cp=cp, sp=sp, token_align=align)
    own = ParallelDims(tp, 1, 1, cp=cp, sp=sp).seq_multiple
    m = dims.seq_multiple
    assert m == math.lcm(own, align * cp)
    for num_targets in range(1, 3 * m + 2):
        length = padded_length(num_targets, m)
        assert length >= num_targets and length % own == 0
        assert (length // cp) % align == 0 and length - num_targets < m
