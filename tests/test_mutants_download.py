"""The stall rule of `elmokit.sources.download` on a clock the test drives (a mutant of `StallWatch` that
tests/test_download_trust.py could only notice by hanging; scripts/mutation.py): a window of
`seconds` that receives less than `min_bytes` is a stall, one that receives enough opens the next
window, and nothing is judged before a window ends."""

from __future__ import annotations

from elmokit.sources.download import StallWatch


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_window_with_too_few_bytes_is_a_stall_and_one_with_enough_opens_the_next():
    clock = Clock()
    watch = StallWatch(seconds=60, min_bytes=1000, clock=clock)
    watch.add(10)
    clock.now += 59.9
    assert not watch.stalled() and watch.left() > 0  # the window has not ended: not judged yet
    watch.add(990)  # exactly the minimum within the window
    clock.now += 0.1
    assert not watch.stalled()  # enough: the next window starts here, empty
    assert watch.window_bytes == 0 and watch.left() == 60
    watch.add(999)
    clock.now += 60
    assert watch.stalled()  # one byte short over a whole window
    assert "less than 1,000 bytes in 60 s" in watch.rule()


def test_nothing_received_for_a_window_is_a_stall():
    clock = Clock()
    watch = StallWatch(seconds=2, min_bytes=1, clock=clock)
    clock.now += 2
    assert watch.stalled()


def test_a_waiter_counts_only_what_the_download_writes_while_it_waits(tmp_path, monkeypatch):
    """A wedged download that had already written 3 MB (more than the stall rule's 1 MB) before a
    second process came to wait for it: the waiter gives up when its first window ends with nothing
    new, not a window later (those 3 MB are not progress it saw)."""
    import pytest

    from elmokit.sources import download
    from elmokit.sources.cache import PARTIAL_SUFFIX, file_lock

    target = tmp_path / "host" / "weights.hdf5"
    staging = target.parent / f".{target.name}.wedged{PARTIAL_SUFFIX}"
    staging.mkdir(parents=True)
    (staging / target.name).write_bytes(bytes(3_000_000))
    clock = Clock()

    def ticking() -> float:  # a second a look, whatever the machine's speed
        clock.now += 1.0
        return clock.now

    monkeypatch.setattr(download, "StallWatch", lambda: StallWatch(seconds=2, min_bytes=1_000_000, clock=ticking))
    holder = file_lock(target)
    holder.acquire()  # the wedged downloader
    try:
        started = clock.now
        with pytest.raises(download.DownloadError, match="gave up waiting"):
            download._acquire(target, "https://example.org/weights.hdf5")
    finally:
        holder.release()
    assert clock.now - started < 4, "the waiter counted the bytes written before it came as progress"
