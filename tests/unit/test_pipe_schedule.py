"""Pipeline schedules (runtime/pipe/schedule.py): every stage's stream of instructions, checked
against the others' (what one sends, the next receives in the same step) and against its
buffers (no micro-batch's buffer reused while it is still needed)."""

import pytest

from deepspeed.runtime.pipe import schedule as S


def _events(sched, kinds):
    """[(step, instruction)] of the given classes, in order."""
    return [(t, c) for t, cmds in enumerate(sched) for c in cmds if type(c) in kinds]


@pytest.mark.parametrize("stages, micro_batches", [(1, 4), (2, 1), (3, 8), (4, 3), (4, 10)])
def test_train_schedule_pairs_every_send_with_a_receive_and_keeps_buffers_live(stages, micro_batches):
    scheds = [S.TrainSchedule(micro_batches=micro_batches, stages=stages, stage_id=s) for s in range(stages)]
    total = 2 * (micro_batches + stages - 1)
    for s, sched in enumerate(scheds):
        steps = list(sched)
        assert len(steps) == total
        assert steps[-1][-3:] == [S.ReduceTiedGrads(), S.ReduceGrads(), S.OptimizerStep()]
        forwards = _events(sched, {S.ForwardPass})
        backwards = _events(sched, {S.BackwardPass})
        buffers = sched.num_pipe_buffers()
        # Each micro-batch once forward then once backward, in order, in buffer m % buffers.
        assert [c.buffer_id for _, c in forwards] == [m % buffers for m in range(micro_batches)]
        assert [c.buffer_id for _, c in backwards] == [m % buffers for m in range(micro_batches)]
        assert [t for t, _ in forwards] == [2 * m + s for m in range(micro_batches)]
        assert [t for t, _ in backwards] == [2 * m + 2 * stages - 1 - s for m in range(micro_batches)]
        # A buffer is taken again only after the backward of the micro-batch it held.
        for m in range(buffers, micro_batches):
            assert forwards[m][0] > backwards[m - buffers][0]
        # The first and last stages load data; the others receive activations instead.
        loads = _events(sched, {S.LoadMicroBatch})
        assert len(loads) == (micro_batches if s in (0, stages - 1) else 0)
        if s + 1 < stages:  # the activation leaves one step after its forward, into the next stage
            sends = _events(sched, {S.SendActivation})
            recvs = _events(scheds[s + 1], {S.RecvActivation})
            assert [t for t, _ in sends] == [t + 1 for t, _ in forwards] == [t for t, _ in recvs]
        if s > 0:  # the input's gradient goes back one step after the backward
            sends = _events(sched, {S.SendGrad})
            recvs = _events(scheds[s - 1], {S.RecvGrad})
            assert [t for t, _ in sends] == [t + 1 for t, _ in backwards] == [t for t, _ in recvs]


@pytest.mark.parametrize("stages, micro_batches", [(1, 4), (3, 1), (3, 10)])
def test_inference_schedule_forwards_each_micro_batch_one_stage_per_step(stages, micro_batches):
    scheds = [
        S.InferenceSchedule(micro_batches=micro_batches, stages=stages, stage_id=s) for s in range(stages)
    ]
    for s, sched in enumerate(scheds):
        assert len(list(sched)) == micro_batches + stages - 1
        forwards = _events(sched, {S.ForwardPass})
        assert [t for t, _ in forwards] == [m + s for m in range(micro_batches)]
        assert [c.buffer_id for _, c in forwards] == [m % 2 for m in range(micro_batches)]
        assert not _events(sched, {S.BackwardPass, S.OptimizerStep})
        if s + 1 < stages:
            sends = _events(sched, {S.SendActivation})
            assert [t for t, _ in sends] == [t for t, _ in _events(scheds[s + 1], {S.RecvActivation})]


def test_data_parallel_schedule_and_misuse():
    steps = list(S.DataParallelSchedule(micro_batches=2, stages=1, stage_id=0))
    assert steps[0] == [S.LoadMicroBatch(0), S.ForwardPass(0), S.BackwardPass(0)]
    assert steps[1][-2:] == [S.ReduceGrads(), S.OptimizerStep()]
    assert repr(S.RecvGrad(1)) == "RecvGrad(buffer_id=1)"
    with pytest.raises(ValueError, match=r"stage_id=3 must be in \[0, 3\)"):
        S.TrainSchedule(micro_batches=2, stages=3, stage_id=3)
    with pytest.raises(ValueError, match="micro_batches must be an int >= 1, got 0"):
        S.InferenceSchedule(micro_batches=0, stages=1, stage_id=0)
