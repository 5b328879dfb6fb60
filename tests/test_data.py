"""ShardSampler, shard_kwargs and reduce_metric on one process (workers are simulated)."""
from __future__ import annotations

import collections
import math

import mxnet as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mxnet import gluon

import dist_gluon.data
from dist_gluon.backends import Backend
from dist_gluon.data import ShardSampler, reduce_metric, shard_kwargs

lengths = st.integers(min_value=0, max_value=300)
workers = st.integers(min_value=1, max_value=9)
seeds = st.integers(min_value=0, max_value=2**32)
epochs = st.integers(min_value=0, max_value=1000)
PROPERTY = settings(max_examples=150, deadline=None)


class FakeJob(Backend):
    """Rank ``rank`` of a simulated job of ``num_workers``: a sum adds ``others`` (what
    the other ranks contribute) and records what this rank sent."""

    _type = "fake"

    def __init__(self, rank: int = 0, num_workers: int = 2, others=None):
        self._rank, self._num_workers, self._others = rank, num_workers, others
        self.sent = []
        super().__init__()

    rank = property(lambda self: self._rank)
    num_workers = property(lambda self: self._num_workers)
    local_rank = property(lambda self: 0)

    def _allreduce_(self, names, arrays, priority):
        for arr in arrays:
            self.sent.append(arr.asnumpy().copy())
            if self._others is not None:
                arr += mx.nd.array(self._others, dtype=arr.dtype)


def shards(length, num_workers, **kwargs) -> list[list[int]]:
    return [list(ShardSampler(length, num_workers=num_workers, rank=r, **kwargs))
            for r in range(num_workers)]


def real_parts(length, num_workers, **kwargs) -> list[list[int]]:
    """Each rank's indices without its padding."""
    parts = []
    for r in range(num_workers):
        sampler = ShardSampler(length, num_workers=num_workers, rank=r, **kwargs)
        parts.append(list(sampler)[:len(sampler) - sampler.num_padded])
    return parts


# ------------------------------------------------------------------ sharding properties
@PROPERTY
@given(lengths, workers, seeds, epochs, st.sampled_from(["pad", "drop"]), st.booleans())
def test_every_rank_gets_the_same_number_of_indices_and_len_matches(
        length, num_workers, seed, epoch, last_batch, shuffle):
    expected = (math.ceil if last_batch == "pad" else math.floor)(length / num_workers)
    for r in range(num_workers):
        sampler = ShardSampler(length, num_workers=num_workers, rank=r, seed=seed,
                               shuffle=shuffle, last_batch=last_batch)
        sampler.set_epoch(epoch)
        assert len(sampler) == len(list(sampler)) == expected


@PROPERTY
@given(lengths, workers, seeds, epochs, st.booleans())
def test_pad_covers_every_sample_and_repeats_exactly_the_shortfall(
        length, num_workers, seed, epoch, shuffle):
    parts = []
    for r in range(num_workers):
        sampler = ShardSampler(length, num_workers=num_workers, rank=r, seed=seed,
                               shuffle=shuffle)
        sampler.set_epoch(epoch)
        parts.append(list(sampler))
    counts = collections.Counter(i for part in parts for i in part)
    assert set(counts) == set(range(length))
    shortfall = num_workers * math.ceil(length / num_workers) - length
    assert sum(counts.values()) - length == shortfall


@PROPERTY
@given(lengths, workers, seeds, epochs, st.booleans())
def test_pad_without_the_padded_tail_is_an_exact_partition(
        length, num_workers, seed, epoch, shuffle):
    padded = [ShardSampler(length, num_workers=num_workers, rank=r).num_padded
              for r in range(num_workers)]
    assert sum(padded) == num_workers * math.ceil(length / num_workers) - length
    assert set(padded) <= {0, 1}
    parts = []
    for r in range(num_workers):
        sampler = ShardSampler(length, num_workers=num_workers, rank=r, seed=seed,
                               shuffle=shuffle)
        sampler.set_epoch(epoch)
        parts.append(list(sampler)[:len(sampler) - sampler.num_padded])
    assert sorted(i for part in parts for i in part) == list(range(length))


@PROPERTY
@given(lengths, workers, seeds, epochs, st.booleans())
def test_drop_gives_disjoint_shards_of_in_range_indices(
        length, num_workers, seed, epoch, shuffle):
    parts = []
    for r in range(num_workers):
        sampler = ShardSampler(length, num_workers=num_workers, rank=r, seed=seed,
                               shuffle=shuffle, last_batch="drop")
        sampler.set_epoch(epoch)
        assert sampler.num_padded == 0
        parts.append(list(sampler))
    flat = [i for part in parts for i in part]
    assert len(flat) == len(set(flat)) == num_workers * (length // num_workers)
    assert all(0 <= i < length for i in flat)


def epoch_shards(length, num_workers, seed, epoch) -> list[list[int]]:
    samplers = [ShardSampler(length, num_workers=num_workers, rank=r, seed=seed)
                for r in range(num_workers)]
    for sampler in samplers:
        sampler.set_epoch(epoch)
    return [list(sampler) for sampler in samplers]


@PROPERTY
@given(st.integers(min_value=20, max_value=300), workers, seeds, epochs)
def test_set_epoch_reshuffles_and_the_order_depends_only_on_seed_and_epoch(
        length, num_workers, seed, epoch):
    this_epoch = epoch_shards(length, num_workers, seed, epoch)
    next_epoch = epoch_shards(length, num_workers, seed, epoch + 1)
    assert this_epoch != next_epoch  # 20! orders: equal by chance with p < 1e-18
    # the same sampler moved to another epoch and back agrees with a fresh one
    sampler = ShardSampler(length, num_workers=num_workers, rank=num_workers - 1, seed=seed)
    sampler.set_epoch(epoch + 1)
    assert list(sampler) == next_epoch[-1]
    sampler.set_epoch(epoch)
    assert list(sampler) == this_epoch[-1]
    # all ranks agree on each epoch's order: without padding they hold everything once
    for shards_of_epoch in (this_epoch, next_epoch):
        real = [i for r, part in enumerate(shards_of_epoch)
                for i in part[:len(part) - ShardSampler(length, num_workers=num_workers,
                                                        rank=r).num_padded]]
        assert sorted(real) == list(range(length))


@PROPERTY
@given(st.integers(min_value=20, max_value=300), workers, seeds)
def test_different_seeds_give_different_orders(length, num_workers, seed):
    assert shards(length, num_workers, seed=seed) != shards(length, num_workers,
                                                            seed=seed + 1)


@PROPERTY
@given(lengths, workers, st.sampled_from(["pad", "drop"]))
def test_without_shuffle_rank_r_gets_r_then_every_nth_index(length, num_workers,
                                                            last_batch):
    end = length if last_batch == "pad" else num_workers * (length // num_workers)
    for r, part in enumerate(real_parts(length, num_workers, shuffle=False,
                                        last_batch=last_batch)):
        assert part == list(range(r, end, num_workers))


def test_without_shuffle_padding_wraps_around_to_the_first_indices():
    assert shards(5, 4, shuffle=False) == [[0, 4], [1, 0], [2, 1], [3, 2]]
    assert shards(2, 4, shuffle=False) == [[0], [1], [0], [1]]
    assert [ShardSampler(5, num_workers=4, rank=r).num_padded for r in range(4)] == \
        [0, 1, 1, 1]


def test_without_shuffle_the_order_is_the_same_every_epoch():
    sampler = ShardSampler(11, num_workers=3, rank=1, shuffle=False)
    before = list(sampler)
    sampler.set_epoch(5)
    assert list(sampler) == before == [1, 4, 7, 10]


def test_an_empty_dataset_yields_nothing():
    sampler = ShardSampler(0, num_workers=3, rank=2)
    assert list(sampler) == [] and len(sampler) == 0 and sampler.num_padded == 0


# ------------------------------------------------------------------ arguments
@pytest.mark.parametrize("kwargs, argument", [
    (dict(length=-1), "length"),
    (dict(length=2.5), "length"),
    (dict(length="10"), "length"),
    (dict(num_workers=0), "num_workers"),
    (dict(num_workers=2.0), "num_workers"),
    (dict(num_workers=2, rank=2), "rank"),
    (dict(num_workers=2, rank=-1), "rank"),
    (dict(rank=True), "rank"),
    (dict(last_batch="keep"), "last_batch"),
    (dict(last_batch=None), "last_batch"),
    (dict(seed=-1), "seed"),
    (dict(seed=0.5), "seed"),
])
def test_bad_arguments_raise_value_error_naming_the_argument(kwargs, argument):
    kwargs = dict(dict(length=10, num_workers=2, rank=0), **kwargs)
    with pytest.raises(ValueError, match=rf"^{argument} must be"):
        ShardSampler(**kwargs)


def test_rank_error_states_the_allowed_range():
    with pytest.raises(ValueError, match=r"rank must be an int in \[0, 4\), got 4"):
        ShardSampler(10, num_workers=4, rank=4)


def test_set_epoch_rejects_negative_or_non_int_epochs():
    sampler = ShardSampler(10, num_workers=2, rank=0)
    for bad in (-1, 1.5, "1"):
        with pytest.raises(ValueError, match="^epoch must be"):
            sampler.set_epoch(bad)


def test_numpy_integers_are_accepted():
    sampler = ShardSampler(np.int64(10), num_workers=np.int32(3), rank=np.int64(2),
                           seed=np.uint32(7))
    assert len(sampler) == 4


# ------------------------------------------------------------------ where workers come from
def test_explicit_num_workers_and_rank_create_no_backend(monkeypatch):
    def no_backend(kv):
        raise AssertionError("a backend was created")

    monkeypatch.setattr(dist_gluon.data, "resolve", no_backend)
    sampler = ShardSampler(10, num_workers=3, rank=1)
    assert (sampler.num_workers, sampler.rank, len(sampler)) == (3, 1, 4)


def test_num_workers_and_rank_come_from_the_backend():
    sampler = ShardSampler(10, kv=FakeJob(rank=2, num_workers=3))
    assert (sampler.num_workers, sampler.rank, len(sampler)) == (3, 2, 4)


def test_explicit_values_override_the_backend():
    sampler = ShardSampler(10, kv=FakeJob(rank=1, num_workers=2), num_workers=5, rank=4)
    assert (sampler.num_workers, sampler.rank) == (5, 4)


def test_a_single_process_gets_everything():
    sampler = ShardSampler(7, shuffle=False)
    assert (sampler.num_workers, sampler.rank) == (1, 0)
    assert list(sampler) == list(range(7))


def test_shard_kwargs_give_the_part_of_this_worker():
    assert shard_kwargs(FakeJob(rank=1, num_workers=4)) == {"num_parts": 4, "part_index": 1}
    assert shard_kwargs() == {"num_parts": 1, "part_index": 0}


# ------------------------------------------------------------------ gluon integration
def test_works_as_the_sampler_of_a_dataloader():
    dataset = gluon.data.ArrayDataset(np.arange(23, dtype="float32"),
                                      np.arange(23, dtype="float32"))
    sampler = ShardSampler(len(dataset), num_workers=3, rank=2, seed=4)
    sampler.set_epoch(3)
    loader = gluon.data.DataLoader(dataset, batch_size=4, sampler=sampler)
    seen = [int(i) for data, _ in loader for i in data.asnumpy()]
    assert seen == list(sampler)
    assert len(loader) == math.ceil(len(sampler) / 4) == len(list(loader))


def test_works_inside_a_batch_sampler():
    sampler = ShardSampler(23, num_workers=3, rank=1, seed=4)
    batches = list(gluon.data.BatchSampler(sampler, 3, "keep"))
    assert [i for b in batches for i in b] == list(sampler)
    assert [len(b) for b in batches] == [3, 3, 2]


@PROPERTY
@given(st.integers(min_value=0, max_value=120), workers, st.integers(1, 17), st.booleans())
def test_unpadded_batches_of_all_ranks_hold_every_sample_once(
        length, num_workers, batch_size, shuffle):
    seen = []
    for r in range(num_workers):
        sampler = ShardSampler(length, num_workers=num_workers, rank=r, shuffle=shuffle)
        batches = [(np.array(b), np.array(b) * 10)
                   for b in gluon.data.BatchSampler(sampler, batch_size, "keep")]
        for data, label in sampler.unpadded(batches):
            assert 0 < len(data) == len(label) <= batch_size
            assert (label == data * 10).all()
            seen.extend(data.tolist())
    assert sorted(seen) == list(range(length))


def test_unpadded_cuts_the_padding_out_of_dataloader_batches():
    dataset = gluon.data.ArrayDataset(mx.nd.arange(11), mx.nd.arange(11))
    sampler = ShardSampler(11, num_workers=4, rank=3, shuffle=False)  # 3, 7, then 0
    loader = gluon.data.DataLoader(dataset, batch_size=2, sampler=sampler)
    batches = list(sampler.unpadded(loader))
    assert len(batches) == 1  # the second batch is only padding, so it is skipped
    data, label = batches[0]
    assert data.asnumpy().tolist() == label.asnumpy().tolist() == [3, 7]


def test_unpadded_accepts_a_single_array_per_batch():
    sampler = ShardSampler(5, num_workers=2, rank=1, shuffle=False)  # 1, 3, then 0
    batches = list(sampler.unpadded([mx.nd.array([1, 3, 0])]))
    assert [b.asnumpy().tolist() for b in batches] == [[1, 3]]


def test_unpadded_refuses_batches_that_do_not_come_from_the_sampler():
    dataset = gluon.data.ArrayDataset(mx.nd.arange(11))
    sampler = ShardSampler(11, num_workers=2, rank=0, shuffle=False)
    loader = gluon.data.DataLoader(dataset, batch_size=4, sampler=sampler,
                                   last_batch="discard")
    with pytest.raises(RuntimeError, match="held 4 samples but this ShardSampler yields 6"):
        list(sampler.unpadded(loader))


# ------------------------------------------------------------------ reduce_metric
def predictions(n: int, classes: int = 4, seed: int = 0):
    rng = np.random.RandomState(seed)
    labels = rng.randint(0, classes, size=n).astype("float32")
    scores = rng.rand(n, classes).astype("float32")
    return labels, scores / scores.sum(axis=1, keepdims=True)


def reduce_over_simulated_workers(metrics):
    """What rank 0 gets from reduce_metric when rank r's metric is ``metrics[r]``."""
    senders = [FakeJob(rank=r, num_workers=len(metrics)) for r in range(1, len(metrics))]
    for metric, kv in zip(metrics[1:], senders, strict=True):
        reduce_metric(metric, kv=kv)
    others = sum(kv.sent[0] for kv in senders)
    return reduce_metric(metrics[0], kv=FakeJob(rank=0, num_workers=len(metrics),
                                                 others=others))


def evaluate(make_metric, labels, scores, sampler=None, batch_size=8, skip_padding=True):
    """``make_metric()`` updated with the samples of ``sampler`` (all, without one)."""
    metric = make_metric()
    sampler = sampler or gluon.data.SequentialSampler(len(labels))
    batches = [(labels[b], scores[b])
               for b in gluon.data.BatchSampler(sampler, batch_size, "keep")]
    if isinstance(sampler, ShardSampler) and skip_padding:
        batches = sampler.unpadded(batches)
    for label, score in batches:
        metric.update([mx.nd.array(label)], [mx.nd.array(score)])
    return metric


def sharded_and_reduced(make_metric, labels, scores, num_workers, **kwargs):
    metrics = [evaluate(make_metric, labels, scores,
                        ShardSampler(len(labels), num_workers=num_workers, rank=r, **kwargs))
               for r in range(num_workers)]
    return reduce_over_simulated_workers(metrics)


def composite():
    return mx.metric.CompositeEvalMetric([mx.metric.Accuracy(), mx.metric.TopKAccuracy(2),
                                          mx.metric.CrossEntropy()])


@pytest.mark.parametrize("num_workers", [2, 3, 4])
@pytest.mark.parametrize("shuffle", [False, True])
def test_sharded_and_reduced_metrics_equal_the_single_process_metrics(num_workers, shuffle):
    labels, scores = predictions(101)
    single = evaluate(composite, labels, scores)
    reduced = sharded_and_reduced(composite, labels, scores, num_workers, shuffle=shuffle)
    (acc, top2, ce), (acc1, top21, ce1) = reduced.get()[1], single.get()[1]
    assert (acc, top2) == (acc1, top21)  # exactly
    assert ce == pytest.approx(ce1, rel=1e-6)
    assert [m.num_inst for m in reduced.metrics] == [101] * 3
    assert reduced.get_global()[1][:2] == single.get_global()[1][:2]


def test_counting_the_padding_would_change_the_result():
    labels, scores = predictions(101)
    with_padding = [evaluate(mx.metric.Accuracy, labels, scores,
                             ShardSampler(101, num_workers=4, rank=r), skip_padding=False)
                    for r in range(4)]
    assert reduce_over_simulated_workers(with_padding).num_inst == 104


@pytest.mark.parametrize("make_metric", [
    lambda: mx.metric.F1(average="micro"),
    lambda: mx.metric.MCC(average="micro"),
], ids=["F1", "MCC"])
def test_micro_averaged_f1_and_mcc_are_exact(make_metric):
    labels, scores = predictions(57, classes=2, seed=3)
    single = evaluate(make_metric, labels, scores)
    reduced = sharded_and_reduced(make_metric, labels, scores, 3, shuffle=True)
    assert reduced.get() == single.get()
    assert reduced.get_global() == single.get_global()


def test_reduce_metric_returns_a_copy_and_leaves_the_metric_alone():
    labels, scores = predictions(40)
    metrics = [evaluate(mx.metric.Accuracy, labels[r::2], scores[r::2]) for r in range(2)]
    before = (metrics[0].sum_metric, metrics[0].num_inst)
    once = reduce_over_simulated_workers(metrics)
    twice = reduce_over_simulated_workers(metrics)
    assert (metrics[0].sum_metric, metrics[0].num_inst) == before
    assert once.num_inst == twice.num_inst == 40
    assert once.get() == twice.get() == evaluate(mx.metric.Accuracy, labels, scores).get()


def test_one_float64_pushpull_carries_every_counter():
    kv = FakeJob(rank=1, num_workers=2)
    reduce_metric(composite(), kv=kv)
    assert len(kv.sent) == 1 and kv.sent[0].dtype == np.float64
    assert kv.sent[0].shape == (12,)  # sums and counts, local and global, of 3 metrics


def test_a_single_process_issues_no_collective():
    class NoCollective(FakeJob):
        def pushpull(self, *args, **kwargs):
            raise AssertionError("a single process must not communicate")

    labels, scores = predictions(30)
    metric = evaluate(mx.metric.Accuracy, labels, scores)
    reduced = reduce_metric(metric, kv=NoCollective(rank=0, num_workers=1))
    assert reduced is not metric and reduced.get() == metric.get()
    assert reduce_metric(metric).get() == metric.get()  # kv=None: the local backend


@pytest.mark.parametrize("metric", [mx.metric.PCC(),
                                    mx.metric.PearsonCorrelation(average="micro")],
                         ids=["PCC", "PearsonCorrelation"])
def test_metrics_that_are_not_sums_are_refused(metric):
    with pytest.raises(ValueError, match="cannot be reduced exactly"):
        reduce_metric(metric, kv=FakeJob())


def test_reduce_metric_wants_an_eval_metric():
    with pytest.raises(TypeError, match="must be an mx.metric.EvalMetric"):
        reduce_metric(0.5, kv=FakeJob())
