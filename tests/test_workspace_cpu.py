"""workspace.py on the CPU (the stream handle stubbed): a buffer per (device, stream, dtype,
zeroed), handed out while it is large enough, grown on either dimension alone, the
outgrown one kept alive for graphs that captured it."""

from unittest import mock

import torch

from tileops.kernels import workspace


def test_buffers_are_reused_grown_and_kept_per_stream():
    stream = [7]
    cpu = torch.device("cpu")
    with mock.patch.object(torch._C, "_cuda_getCurrentRawStream",
                           lambda index: stream[0], create=True), \
            mock.patch.dict(workspace._found, clear=True), \
            mock.patch.object(workspace, "_retired", []):
        first = workspace.zeroed_scratch(cpu, 2, 64, torch.uint64)
        assert first.shape == (2, workspace.MIN_COLUMNS) and not first.view(torch.int64).any()
        assert workspace.zeroed_scratch(cpu, 2, 10, torch.uint64) is first  # fits
        assert workspace.scratch(cpu, 2, 10, torch.uint64) is not first  # not zeroed: its own
        wider = workspace.zeroed_scratch(cpu, 2, workspace.MIN_COLUMNS + 1, torch.uint64)
        assert wider.shape == (2, 2 * workspace.MIN_COLUMNS) and workspace._retired == [first]
        taller = workspace.zeroed_scratch(cpu, 5, 8, torch.uint64)
        assert taller.shape == (5, 2 * wider.shape[1])  # (columns double on every growth)
        assert workspace.zeroed_scratch(cpu, 5, wider.shape[1], torch.uint64) is taller
        stream[0] = 8  # another stream: a buffer of its own
        assert workspace.zeroed_scratch(cpu, 2, 64, torch.uint64) is not taller
        stream[0] = 7
        assert workspace.zeroed_scratch(cpu, 3, 64, torch.uint64) is taller
        assert workspace.zeroed_scratch(cpu, 3, 64, torch.int32).dtype == torch.int32
