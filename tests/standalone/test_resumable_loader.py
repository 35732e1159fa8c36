"""`ResumableLoader` behaves like a DataLoader epoch by epoch (`len()`, one epoch per
`iter()`, a peek costs no batch) and still resumes at the exact next batch."""

from __future__ import annotations

from trainer.api.data import ResumableLoader


def loader(**kw) -> ResumableLoader:
    return ResumableLoader(list(range(40)), 4, seed=1, **kw)


def epoch(ld: ResumableLoader) -> list[list[int]]:
    return [b.tolist() for b in ld]


def test_len_is_the_number_of_batches_in_one_epoch_like_a_dataloaders():
    assert len(loader()) == 10
    assert len(ResumableLoader(list(range(42)), 4)) == 10  # the incomplete batch is dropped


def test_a_peek_at_the_first_batch_before_each_epoch_drops_no_batch():
    peeked, plain = loader(), loader()
    for _ in range(3):
        first = next(iter(peeked))
        assert len(first) == 4
        got = epoch(peeked)
        assert got == epoch(plain) and len(got) == 10
        assert got[0] == first.tolist()


def test_each_iteration_to_the_end_is_the_next_epoch_in_a_new_order():
    ld = loader()
    one, two = epoch(ld), epoch(ld)
    assert sorted(sum(one, [])) == sorted(sum(two, [])) == list(range(40))
    assert one != two and ld.epoch == 1


def test_a_restored_loader_continues_its_epoch_at_the_next_batch_even_after_a_peek():
    ld = loader()
    whole = epoch(ld)
    ld = loader()
    it = iter(ld)
    taken = [next(it).tolist() for _ in range(3)]
    state = ld.state_dict()
    resumed = loader()
    resumed.load_state_dict(state)
    peek = next(iter(resumed)).tolist()
    rest = epoch(resumed)
    assert peek == rest[0] and taken + rest == whole


def test_a_loader_restored_one_batch_before_its_epochs_end_yields_that_batch_after_a_peek():
    # The class-based DDP port peeks at each epoch's first batch: restored at 9 of 10, the
    # peek takes the epoch's last batch, and the loop after it must still get that batch.
    whole, ld = epoch(loader()), loader()
    it = iter(ld)
    for _ in range(9):
        next(it)
    resumed = loader()
    resumed.load_state_dict(ld.state_dict())
    assert resumed.epoch == 0
    peek = next(iter(resumed)).tolist()
    assert epoch(resumed) == [peek] == whole[9:]
    assert resumed.epoch == 0 and epoch(resumed) == _second(loader())  # then the next epoch


def _second(ld: ResumableLoader) -> list[list[int]]:
    epoch(ld)
    return epoch(ld)


def test_an_abandoned_iterator_ends_once_a_newer_one_took_the_epoch_over():
    ld = loader()
    old = iter(ld)
    next(old)
    new = iter(ld)
    assert next(new).tolist() == epoch(loader())[0]
    assert list(old) == []
    assert len(list(new)) == 9 and ld.position == 10
