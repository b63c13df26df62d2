"""StorageLedger: the counting the CPU tracker and the planner's fake counter share."""

from __future__ import annotations

import gc

import torch

from torch.utils._pytree import tree_flatten

from batchpilot.memory.tracker import StorageLedger, tensor_leaves


def test_a_storage_counts_once_resizes_by_the_difference_and_leaves_when_it_dies():
    released = []
    ledger = StorageLedger(on_release=lambda key, nbytes: released.append((key, nbytes)))
    a = torch.empty(100)  # 400 bytes
    st = a.untyped_storage()
    assert ledger.charge(st, st.nbytes()) == 400
    assert ledger.charge(a[10:].untyped_storage(), 400) == 0  # a view: the same storage
    assert (ledger.live, ledger.peak, ledger.size(id(st))) == (400, 0, 400)  # the peak waits for bump_peak
    assert ledger.bump_peak() and not ledger.bump_peak() and ledger.peak == 400
    st.resize_(800)
    assert ledger.charge(st, st.nbytes()) == 400 and ledger.live == 800
    key = id(st)
    del a, st
    gc.collect()
    assert (ledger.live, ledger.size(key), released) == (0, None, [(key, 800)])
    assert ledger.peak == 400  # not bumped since the resize
    ledger.reset_peak()
    assert ledger.peak == 0


def test_host_data_is_charged_by_the_widest_view_then_forgotten():
    ledger = StorageLedger()
    data = torch.zeros(1000)  # 4000 bytes of a dataset
    st = data.untyped_storage()
    ledger.charge_view(st, data[:10])
    assert (ledger.live, ledger.is_host(id(st))) == (40, True)
    ledger.charge_view(st, data[:5])  # a narrower view changes nothing
    ledger.charge_view(st, data[:100])
    assert (ledger.live, ledger.host_bytes) == (400, 400)
    assert ledger.forget_host() == 400 and ledger.live == 0 and ledger.size(id(st)) is None
    ledger.charge_view(st, data)  # read whole: charged whole, and still host data
    assert (ledger.live, ledger.is_host(id(st))) == (4000, True)
    assert ledger.forget_host() == 4000 and ledger.live == 0


def test_a_storage_charged_whole_is_no_host_data_and_outlives_forget_host():
    ledger = StorageLedger()
    data = torch.zeros(1000)
    st = data.untyped_storage()
    ledger.charge_view(st, data[:10])
    ledger.charge(st, st.nbytes())  # tracked whole (a model's tensor): the step's own memory
    assert (ledger.live, ledger.is_host(id(st)), ledger.host_bytes) == (4000, False, 0)
    ledger.charge_view(st, data[:1])  # a storage charged whole stays as it is
    assert ledger.forget_host() == 0 and ledger.live == 4000


def test_a_storage_made_host_data_is_charged_again_by_the_views_read_of_it():
    ledger = StorageLedger()
    batch = torch.zeros(1000)  # a loader's stacked batch, made while a tracker ran
    st = batch.untyped_storage()
    ledger.charge(st, st.nbytes())
    assert ledger.make_host(st) == 4000 and (ledger.live, ledger.is_host(id(st))) == (0, True)
    assert ledger.make_host(st) == 0  # nothing charged
    ledger.charge_view(st, batch[100:200])  # one micro-batch
    assert (ledger.live, ledger.host_bytes) == (400, 400)
    assert ledger.make_host(st) == 400 and ledger.live == 0  # the step is over: its views leave the device
    ledger.charge_view(st, batch[:100])
    assert ledger.make_host(torch.zeros(3).untyped_storage()) == 0 and ledger.live == 400  # unseen: nothing to release


def test_tensor_leaves_are_tree_flattens_tensors_for_what_operators_take_and_return():
    a, b, c, d = (torch.randn(2) for _ in range(4))
    m = torch.randn(3, 4).max(dim=1)  # a torch.return_types result
    cases = [
        a, None, 3, (), [],
        ((a, 1, None, torch.float32, torch.Size([2])), {"out": b, "alpha": 2.0}),
        ([a, [b, (c,)], {"x": [d]}], {}),
        (m, {"dim": 1}), m,
    ]
    for tree in cases:
        expected = [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]
        got = tensor_leaves(tree)
        assert len(got) == len(expected) and all(x is y for x, y in zip(got, expected)), tree
