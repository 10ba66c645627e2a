"""A plan's point-to-point transfers between two real gloo ranks: an activation forward and its
gradient back, each on its own group; two interleaved stages, whose transfers of each kind go both
ways, on a group per kind and direction; and a receive whose sender never comes fails in one line
naming the stage, the peer and the micro-batch instead of hanging."""

import pytest
import torch
import torch.distributed as dist

from megatron_dynapipe.local_ranks import run_local_ranks
from megatron_dynapipe.planning.plan import Instruction, Op
from megatron_dynapipe.runtime.p2p import PipelineChannels, PipelineCommError


def _forward_and_back(rank, world_size):
    channels = PipelineChannels(dist.group.WORLD, device=torch.device("cpu"), timeout=120)
    assert (channels.stage, channels.num_stages, channels.peer_rank(1 - rank)) == (rank, 2, 1 - rank)
    if rank == 0:
        send = channels.transfer(Instruction(Op.SEND_ACT_START, 5, peer=1), torch.arange(6.0).reshape(2, 3))
        recv = channels.transfer(Instruction(Op.RECV_GRAD_START, 5, peer=1), torch.empty(2, 3))
        channels.post([send, recv])  # both before either finishes, as the lowering places them
        channels.finish(send)
        return channels.finish(recv).tolist()
    recv = channels.transfer(Instruction(Op.RECV_ACT_START, 5, peer=0), torch.empty(2, 3))
    channels.post([recv])
    activation = channels.finish(recv)
    send = channels.transfer(Instruction(Op.SEND_GRAD_START, 5, peer=0), -activation)
    channels.post([send])
    channels.finish(send)
    return activation.tolist()


def _waits_for_a_gradient_never_sent(rank, world_size):
    channels = PipelineChannels(dist.group.WORLD, device=torch.device("cpu"), timeout=2)
    message = None
    if rank == 0:
        recv = channels.transfer(Instruction(Op.RECV_GRAD_START, 3, peer=1), torch.empty(4), where="RecvGradFinish(3<-s1)")
        channels.post([recv])
        with pytest.raises(PipelineCommError) as info:
            channels.finish(recv, where="RecvGradFinish(3<-s1)")
        message = str(info.value)
    dist.barrier()  # stage 1 stays up until stage 0 has given up
    return message


@pytest.mark.slow
def test_an_activation_goes_forward_and_its_gradient_comes_back():
    sent = [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]
    gradient, activation = run_local_ranks(_forward_and_back, 2, timeout=600)
    assert activation == sent and gradient == [[-v for v in row] for row in sent]


@pytest.mark.slow
def test_a_receive_whose_sender_never_comes_names_what_it_waited_for():
    message, _ = run_local_ranks(_waits_for_a_gradient_never_sent, 2, timeout=600)
    assert message.startswith("pipeline stage 0 (global rank 0) failed receiving the gradient of micro-batch 3 "
                              "from stage 1 (global rank 1) [RecvGradFinish(3<-s1)]")
    assert "stage 1 has probably died or stalled; check its log" in message and "\n" not in message


def _both_ways(rank, world_size):
    """Two stages of two model chunks: activations and gradients each travel both ways between
    the same two ranks.  Each rank posts its receives before its sends, and in the opposite order
    to its peer, all at once; returns what arrived and which group carried each kind of transfer."""
    channels = PipelineChannels(dist.group.WORLD, device=torch.device("cpu"), timeout=120, chunks=2)
    peer = 1 - rank
    starts = [Op.RECV_ACT_START, Op.RECV_GRAD_START, Op.SEND_ACT_START, Op.SEND_GRAD_START]
    if rank == 1:
        starts = starts[1::-1] + starts[:1:-1]
    transfers = {op: channels.transfer(Instruction(op, 7, peer=peer, chunk=rank),
                                       torch.full((3,), 10.0 * rank + op.value) if op.is_send else torch.empty(3))
                 for op in starts}
    channels.post(list(transfers.values()))
    arrived = {op.name: channels.finish(t)[0].item() for op, t in transfers.items()}
    arrived = {name: value for name, value in arrived.items() if name.startswith("RECV")}
    sender_receiver = {op: (rank, peer) if op.is_send else (peer, rank) for op in starts}
    groups = {(op.is_activation, *sender_receiver[op]): channels.groups.index(channels._group(op, peer))
              for op in starts}
    plain = PipelineChannels(dist.group.WORLD, device=torch.device("cpu"), timeout=120)
    dist.barrier()
    return arrived, groups, len(channels.groups), len(plain.groups), transfers[Op.RECV_ACT_START].describe()


@pytest.mark.slow
def test_two_interleaved_stages_keep_each_kind_and_direction_on_its_own_group():
    (arrived0, groups0, n0, plain0, text0), (arrived1, groups1, _, _, text1) = run_local_ranks(_both_ways, 2,
                                                                                              timeout=600)
    assert arrived0 == {"RECV_ACT_START": 10.0 + Op.SEND_ACT_START.value, "RECV_GRAD_START": 10.0 + Op.SEND_GRAD_START.value}
    assert arrived1 == {"RECV_ACT_START": float(Op.SEND_ACT_START.value), "RECV_GRAD_START": float(Op.SEND_GRAD_START.value)}
    assert groups0 == groups1  # sender and receiver pick the same group for each transfer
    assert sorted(groups0.values()) == [0, 1, 2, 3] and (n0, plain0) == (4, 2)
    assert text0 == "receiving the activation of micro-batch 7 from stage 1 (global rank 1)"
    assert text1 == "receiving the activation of micro-batch 7 (model chunk 1) from stage 0 (global rank 0)"
