"""Probes, the exact CPU storage tracker, and the emulated capacity."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from batchpilot.app.models import MLP, SmallCNN
from batchpilot.find.snapshot import StateSnapshot
from batchpilot.memory.oom import is_oom
from batchpilot.memory.probes import emulate_capacity, get_probe, track_peak
from batchpilot.memory.tracker import StorageTracker, active_tracker, untracked
from batchpilot.memory.units import format_bytes, parse_bytes, resolve_device


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def make(kind: str, foreach: bool | None = False):
    torch.manual_seed(0)
    if kind == "mlp":
        model, x = MLP(64, 256, 2), torch.randn(4, 64)
    else:
        model, x = SmallCNN(3, (16, 32, 64)), torch.randn(2, 3, 8, 8)
    opt = torch.optim.Adam(model.parameters(), foreach=foreach)
    y = torch.randint(0, 10, (x.shape[0],))

    def step():
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()

    return model, opt, x, y, step


@pytest.mark.parametrize("kind", ["mlp", "cnn"])
def test_tracked_peak_equals_hand_computation(kind):
    model, opt, x, y, step = make(kind)
    step()  # Adam creates its state lazily: measure the steady state
    with track_peak("cpu", track=(model, opt, x, y)) as m:
        step()
    params = list(model.parameters())
    sizes = [nbytes(p) for p in params]
    k = sizes.index(max(sizes))
    # With a tiny batch the peak is inside single-tensor Adam's update of the largest
    # parameter p_k: params + grads + exp_avg + exp_avg_sq (4 x P), one 4-byte step
    # counter per parameter, the buffers, the batch, the 4-byte loss, sqrt(v) and
    # sqrt(v)/c for p_k, and the previous parameter's `denom`, which the Python loop
    # keeps alive until it is rebound.
    hand = (
        4 * sum(sizes) + 4 * len(params) + sum(nbytes(b) for b in model.buffers())
        + nbytes(x) + nbytes(y) + 4 + 2 * sizes[k] + sizes[k - 1]
    )
    assert m.peak_bytes == hand
    assert m.start_bytes == m.end_bytes  # nothing leaked by a step


@pytest.mark.parametrize("kind", ["mlp", "cnn"])
@pytest.mark.parametrize("foreach", [False, True])
def test_tracked_peak_equals_torch_memtracker(kind, foreach):
    from torch.distributed._tools.mem_tracker import MemTracker

    model, opt, x, y, step = make(kind, foreach)
    step()
    with track_peak("cpu", track=(model, opt, x, y)) as m:
        step()
    mt = MemTracker()
    mt.track_external(model, opt, x, y)
    with mt:
        step()
    assert m.peak_bytes == mt.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]


def test_views_count_once_and_frees_are_seen():
    with StorageTracker() as tr:
        a = torch.empty(1000)
        v = a[10:20].view(2, 5)
        assert tr.live == 4000
        b = a * 2
        assert tr.live == 8000
        del a, v
        assert tr.live == 4000
        del b
    assert tr.peak == 8000


def test_base_released_only_when_last_view_dies():
    with StorageTracker() as tr:
        a = torch.zeros(256)
        v = a[:1]
        del a
        assert tr.live == 1024
        del v
        assert tr.live == 0


def test_pre_existing_tensors_count_when_read():
    x = torch.ones(100)
    with StorageTracker() as tr:
        y = x + 1
        assert tr.live == 800
        del y


def test_nested_track_peak_windows():
    with track_peak("cpu") as outer:
        a = torch.empty(100)
        with track_peak("cpu") as inner:
            b = torch.empty(50)
            del b
        del a
    assert inner.start_bytes == 400 and inner.peak_bytes == 600
    assert outer.peak_bytes == 600 and outer.end_bytes == 0


def test_a_storage_freed_on_another_thread_is_named_as_the_race_in_the_peak():
    # what gloo's worker threads do with a collective's buffers: the last reference dies there
    import threading

    with track_peak("cpu") as m:
        held = [torch.empty(300)]  # 1200 bytes
        kept = torch.empty(50)
        t = threading.Thread(target=held.clear)
        t.start()
        t.join()
        del kept  # freed here: no race
    tr_bytes = m.extra["foreign_release_bytes"]
    assert (m.peak_bytes, m.end_bytes, tr_bytes) == (1400, 0, 1200)
    with track_peak("cpu") as quiet:
        x = torch.empty(10)
        del x
    assert quiet.extra["foreign_release_bytes"] == 0


def test_paused_counts_nothing_but_sees_frees():
    with StorageTracker() as tr:
        a = torch.empty(100)
        b = torch.empty(50)
        with tr.paused() as same:
            assert same is tr and tr.is_paused
            host = torch.empty(1000)
            c = a * 2  # reads a counted tensor, makes a new one: neither changes the count
            assert tr.live == 600 and tr.peak == 600
            del b  # a counted storage freed inside still leaves the count
            assert tr.live == 400
            with tr.paused():  # nests
                more = torch.empty(10)
            assert tr.is_paused
        assert not tr.is_paused
        assert tr.live == 400 and tr.peak == 600
        d = a + 1  # counting is back
        assert tr.live == 800
        # a tensor made inside counts like one made before the tracker: by the view an operator
        # reads (host data: only what a step reads would be on a device), or whole when tracked
        e = host[:1] + 0
        assert tr.live == 800 + 4 + 4
        f = host[:10] * 1  # a wider view of the same storage charges up to it
        assert tr.live == 800 + 40 + 4 + 40
        tr.track(c, host)
        assert tr.live == 800 + 4000 + 4 + 40 + 400
        del a, c, d, e, f, host, more
        assert tr.live == 0


def test_a_slice_of_host_data_counts_like_its_clone():
    X = torch.randn(4096, 64)  # a dataset tensor: 1 MiB that lives outside the step
    view, clone = X[:8], X[:8].clone()  # made outside the step, as a loader's batch would be
    with track_peak("cpu") as sliced:
        (view * 2).sum()
    with track_peak("cpu") as cloned:
        (clone * 2).sum()
    with track_peak("cpu") as sliced_inside:
        (X[:8] * 2).sum()
    assert sliced.peak_bytes == cloned.peak_bytes == sliced_inside.peak_bytes == 2 * 8 * 64 * 4 + 4
    # a DataLoader over a TensorDataset stacks per-sample views of X: only the batch is charged
    data = torch.utils.data.TensorDataset(X, torch.zeros(len(X), dtype=torch.long))
    with emulate_capacity(64 * 1024) as probe:
        xb, yb = next(iter(torch.utils.data.DataLoader(data, batch_size=16)))
        assert probe.current() < 16 * 1024
    assert xb.shape == (16, 64)


def test_without_host_data_a_slice_of_data_already_held_costs_nothing():
    # a host's real memory already holds the dataset: its slices add nothing, what is made of them does
    X = torch.randn(4096, 64)
    with track_peak("cpu", host_data=False) as sliced:
        (X[:8] * 2).sum()
    with track_peak("cpu", host_data=False) as read_whole:
        (X * 2).sum()
    assert sliced.peak_bytes == 8 * 64 * 4 + 4 and sliced.end_bytes == 0
    assert read_whole.peak_bytes == 4096 * 64 * 4 + 4
    with track_peak("cpu") as charged:  # the default: a device would hold the slice
        (X[:8] * 2).sum()
    assert charged.peak_bytes == sliced.peak_bytes + 8 * 64 * 4


def test_fake_tensors_beneath_the_tracker_are_never_charged():
    # fake modes run after user modes: a FakeTensorMode entered inside a tracker (as DTensor's
    # sharding propagation does, at the full unsharded shape) hands it fake outputs, which own no memory
    from torch._subclasses.fake_tensor import FakeTensorMode

    held = torch.ones(1000)
    with emulate_capacity("1MiB", track=(held,)) as probe:
        start = probe.current()
        with FakeTensorMode():
            big = torch.empty(4 * 2**20)  # 16 MiB, fake
            (big * 2).sum()
        assert probe.current() == probe.peak() == start == 4000
        with pytest.raises(torch.OutOfMemoryError):  # real tensors are still limited
            torch.empty(4 * 2**20)


def test_untracked_leaves_nested_windows_untouched():
    with track_peak("cpu") as outer:
        a = torch.empty(100)
        with track_peak("cpu") as inner:
            with untracked() as paused:
                assert paused == [active_tracker()]
                big = torch.empty(10_000)
                del big
            b = torch.empty(50)
            del b
        del a
    assert inner.start_bytes == 400 and inner.peak_bytes == 600 and inner.end_bytes == 400
    assert outer.peak_bytes == 600 and outer.end_bytes == 0


def test_untracked_does_not_enforce_the_capacity():
    x = torch.ones(10)
    with emulate_capacity(1000, track=(x,)) as probe:
        tr = active_tracker()
        with untracked("cpu"):
            host = x.repeat(1000)  # 40 kB, far past the 1000-byte device
        assert tr.live == 40 and tr.peak == 40 and probe.capacity() == 1000
        with pytest.raises(torch.OutOfMemoryError):
            x.repeat(1000)
    assert host.numel() == 10_000


def test_untracked_pauses_only_the_named_device_and_is_a_no_op_without_trackers():
    with untracked() as none:
        assert none == []
        torch.empty(10)
    with StorageTracker() as tr:
        with untracked("cuda") as other:
            assert other == [] and not tr.is_paused
            a = torch.empty(10)
        assert tr.live == 40
        with untracked(None) as every:
            assert every == [tr] and tr.is_paused
        del a


def test_snapshot_copies_are_never_counted_and_restored_state_is():
    model, opt, x, y, step = make("mlp")
    step()  # Adam state exists: the snapshot copies it, the restore replaces it
    with emulate_capacity("1GiB", track=(model, opt, x, y)):
        tr = active_tracker()
        live, peak = tr.live, tr.peak
        tr.capacity = live + 1  # the snapshot (as large as model + state) would not fit
        snap = StateSnapshot([model, opt])
        assert (tr.live, tr.peak) == (live, peak)
        tr.capacity = 2**30
        step()
        snap.restore()  # load_state_dict makes new state tensors: counted, the host copies not
        assert tr.live == live
        counted = sum(nbytes(t) for s in opt.state.values() for t in s.values())
        assert counted > 0 and all(tr.charged(t) == t.untyped_storage().nbytes() for s in opt.state.values() for t in s.values())


def test_probe_inside_tracker_is_exact():
    probe = get_probe("cpu")
    with track_peak("cpu"):
        a = torch.empty(1000)
        assert probe.current() == 4000
        probe.reset()
        b = torch.empty(10)
        assert probe.peak() == 4040
        del a, b


def test_cpu_capacity_is_physical_or_cgroup():
    cap = get_probe("cpu").capacity()
    assert 0 < cap <= 2**50


@pytest.mark.parametrize("kind", ["mlp", "cnn"])
def test_emulated_capacity_exact_boundary(kind):
    model, opt, x, y, step = make(kind)
    step()
    with track_peak("cpu", track=(model, opt, x, y)) as m:
        step()
    peak = m.peak_bytes
    with emulate_capacity(peak, track=(model, opt, x, y)) as probe:
        assert probe.capacity() == peak
        step()
    with pytest.raises(torch.OutOfMemoryError) as info:
        with emulate_capacity(peak - 1, track=(model, opt, x, y)):
            step()
    assert is_oom(info.value)
    msg = str(info.value)
    assert "emulated" in msg and f"({peak - 1} bytes)" in msg and "tried to allocate" in msg
    assert active_tracker() is None


def test_emulated_oom_in_backward_is_a_real_oom_error():
    model = MLP(64, 512, 2)
    x = torch.randn(64, 64)
    with emulate_capacity("1GiB", track=(model, x)):
        tr = active_tracker()
        out = model(x).sum()
        tr.capacity = tr.live + 1024  # the forward fits; the gradients cannot
        with pytest.raises(torch.OutOfMemoryError) as info:
            out.backward()
    assert is_oom(info.value)


def test_emulated_capacity_nested_in_tracker_restores_capacity():
    with track_peak("cpu"):
        tr = active_tracker()
        with emulate_capacity(10_000):
            assert tr.capacity == 10_000
            with pytest.raises(torch.OutOfMemoryError):
                torch.empty(5000)
        assert tr.capacity is None
        torch.empty(5000)


@pytest.mark.parametrize("bad", [0, -5, "0GiB", "-1MiB", "12 parsecs", "lots", True])
def test_bad_capacity(bad):
    with pytest.raises(ValueError, match="size"):
        with emulate_capacity(bad):
            pass


@pytest.mark.parametrize("bad", ["tpu", "gpu:0", "banana"])
def test_unknown_device(bad):
    with pytest.raises(ValueError, match="cpu, cuda, xpu, mps"):
        get_probe(bad)


@pytest.mark.parametrize(
    "text,expected",
    [("2GiB", 2 * 2**30), ("512MiB", 512 * 2**20), ("1.5GB", 1_500_000_000), ("2G", 2 * 2**30), (4096, 4096), ("100", 100)],
)
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


def test_format_bytes():
    assert format_bytes(512) == "512 B"
    assert format_bytes(3 * 2**30) == "3.00 GiB"


def test_resolve_device():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device(None).type in ("cpu", "cuda", "xpu", "mps")


@pytest.mark.gpu
def test_cuda_track_peak_and_emulated_fraction():
    dev = torch.device("cuda", 0)
    total = torch.cuda.get_device_properties(dev).total_memory
    with track_peak(dev) as m:
        a = torch.empty(2**28, dtype=torch.uint8, device=dev)
        del a
    assert m.peak_bytes - m.start_bytes >= 2**28
    with emulate_capacity(total // 4, dev) as probe:
        assert probe.capacity() == total // 4
        with pytest.raises(torch.OutOfMemoryError):
            torch.empty(total // 2, dtype=torch.uint8, device=dev)
    torch.empty(total // 2, dtype=torch.uint8, device=dev)
