"""Megatron-core's placement of layers on pipeline stages, worked out by hand for published
layouts, and its refusals in one line."""

import pytest

from megatron_dynapipe.config.megatron_options import MegatronOptions, add_megatron_options, megatron_options_from_args


def test_llama3_405b_takes_one_layer_off_the_first_and_last_of_16_stages():
    # Llama 3 (Dubey et al. 2024, section 3.3.2): 126 layers on PP 16, the embedding and the
    # loss each in place of a layer -> 7 + 14 x 8 + 7
    options = MegatronOptions(account_for_embedding=True, account_for_loss=True)
    assert options.layout_problem(tp=8, pp=16, num_layers=126) is None
    assert options.chunk_layers(126, 16) == [7] + [8] * 14 + [7]


def test_first_and_last_stage_counts_split_the_rest_evenly():
    # BLOOM's 70 layers on PP 12: 5 first, 5 last, 60 over the 10 middle stages
    options = MegatronOptions(first_stage_layers=5, last_stage_layers=5)
    assert options.chunk_layers(70, 12) == [5] + [6] * 10 + [5]
    assert MegatronOptions(first_stage_layers=2).chunk_layers(8, 3) == [2, 3, 3]


def test_interleaved_chunks_split_each_ranks_layers_and_lose_the_embedding_and_loss_at_the_ends():
    # 14 layers + 2 accounted over 2 ranks of 2 chunks: 4 a chunk, minus one at either end;
    # chunk c of rank s is virtual stage c * 2 + s
    options = MegatronOptions(account_for_embedding=True, account_for_loss=True, virtual_stages=2)
    assert options.chunk_layers(14, 2) == [3, 4, 4, 3]
    assert options.rank_chunk_layers(14, 2, 1) == [4, 3]
    uneven = MegatronOptions(first_stage_layers=2, last_stage_layers=4, virtual_stages=2)
    assert uneven.chunk_layers(10, 4) == [1, 1, 1, 2, 1, 1, 1, 2]
    assert uneven.busiest_rank_layers(10, 4) == [2, 2]


@pytest.mark.parametrize("options, pp, layers, message", [
    (dict(), 16, 126, "do not split evenly into pp = 16 pipeline stages: use pp among 1, 2, 3, 6, 7, 9, 14"),
    (dict(first_stage_layers=7), 16, 126, "the 119 layers left for the 15 middle stages do not split evenly"),
    (dict(first_stage_layers=4, last_stage_layers=4), 2, 10, "leave 2 of 10 for 0 middle stage(s)"),
    (dict(first_stage_layers=4, last_stage_layers=4), 1, 8, "need pipeline parallelism (PP > 1)"),
    (dict(account_for_embedding=True), 4, 8, "do not split evenly into PP = 4"),
    (dict(first_stage_layers=3, virtual_stages=2), 3, 9, "the 3 layers of pipeline stage 0 do not split into 2"),
    (dict(first_stage_layers=2, last_stage_layers=4, virtual_stages=2), 2, 6,
     "give only --decoder-first-pipeline-num-layers or --decoder-last-pipeline-num-layers at PP = 2"),
])
def test_splits_megatron_core_refuses_are_refused_in_one_line(options, pp, layers, message):
    found = MegatronOptions(**options).layout_problem(tp=1, pp=pp, num_layers=layers, num_microbatches=pp)
    assert found is not None and message in found and "\n" not in found


@pytest.mark.parametrize("options, message", [
    (dict(first_stage_layers=0), "--decoder-first-pipeline-num-layers must be a positive integer"),
    (dict(last_stage_layers=2, account_for_loss=True), "cannot be combined"),
    (dict(first_stage_layers=2, layers_per_virtual_stage=1), "take --num-virtual-stages-per-pipeline-rank"),
])
def test_flags_megatron_refuses_whatever_the_model_are_refused(options, message):
    with pytest.raises(ValueError, match=message):
        MegatronOptions(**options)


def test_the_split_flags_are_megatron_lms_and_print_back():
    import argparse

    parser = argparse.ArgumentParser()
    add_megatron_options(parser)
    argv = ["--decoder-first-pipeline-num-layers", "3", "--decoder-last-pipeline-num-layers", "5"]
    options = megatron_options_from_args(parser.parse_args(argv))
    assert options == MegatronOptions(first_stage_layers=3, last_stage_layers=5)
    assert options.megatron_args() == argv
    assert options.transformer_fields()["num_layers_in_last_pipeline_stage"] == 5
    accounted = megatron_options_from_args(parser.parse_args(["--account-for-embedding-in-pipeline-split"]))
    assert megatron_options_from_args(parser.parse_args(accounted.megatron_args())) == accounted
