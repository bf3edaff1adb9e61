"""How long jobs report progress: the one policy every command and library loop uses.

    progress_bar(total, desc=..., unit=...)   what `tqdm(...)` would be, chosen by the policy:

    stderr a terminal          a tqdm bar on stderr, its rate and ETA measured after the first
                               update (`RateEstimate`)
    stderr a file or a pipe    a log line every `log_interval()` seconds (ELMOKIT_PROGRESS_INTERVAL,
                               default 30) on the `elmokit.progress` logger, at INFO:
                               "embedding: 12,300/61,000 tokens (20%), 1,210 tokens/s, 40s left"
    enabled=False, or the      nothing (a disabled tqdm, so the caller's code is the same)
    `elmokit` logger set above
    INFO (`elmo -q`)

The rate leaves out the time up to the first update: that update pays for loading, lazy
initialisation and the first allocations, and where work arrives in bursts (`elmo embed` runs
up to 16 batches at once) the first burst would otherwise count one item over the whole wait
(an ETA of 52 hours for a 10-minute job). Until a second update there is no rate: the ETA shows
"?". Callers update once per unit of work they finish (a batch, a burst), never item by item
inside a burst that finished at once.

Messages go through `logging` (`logging.getLogger(__name__)` in each module); the command line
installs `LogHandler`, which writes between the lines of a bar (`configure_logging`).

A stop asked by a signal (`request_stop`, SIGTERM's handler in `elmo embed`) is kept here too, and
loops call `check_stop` between units of work: the handler's KeyboardInterrupt can land inside a
finalizer (a weakref callback, a `__del__`), where Python prints "Exception ignored" and goes on.
"""

from __future__ import annotations

import io
import logging
import os
import sys
import time
from collections.abc import Iterable, Iterator
from typing import Any

from tqdm import tqdm

log = logging.getLogger(__name__)
PACKAGE_LOGGER = "elmokit"
DEFAULT_LOG_INTERVAL_S = 30.0


_stop = {"reason": None}  # why a signal asked the run to stop (None: it did not)


def request_stop(reason: str) -> None:
    """Remember that a signal asked the run to stop (`check_stop` raises from then on)."""
    _stop["reason"] = reason


def clear_stop() -> None:
    _stop["reason"] = None


def check_stop() -> None:
    """KeyboardInterrupt if a stop was requested: a point where stopping is safe."""
    if _stop["reason"] is not None:
        raise KeyboardInterrupt(_stop["reason"])


def log_interval() -> float:
    """Seconds between two progress lines when stderr is not a terminal."""
    value = os.environ.get("ELMOKIT_PROGRESS_INTERVAL", "")
    try:
        return max(0.0, float(value)) if value else DEFAULT_LOG_INTERVAL_S
    except ValueError:
        raise ValueError(f"ELMOKIT_PROGRESS_INTERVAL must be a number of seconds, got {value!r}") from None


def stderr_is_terminal() -> bool:
    return hasattr(sys.stderr, "isatty") and sys.stderr.isatty()


def terminal_columns() -> int:
    """The width of the terminal on stderr; 0 where it says none (a pseudo-terminal of size 0)."""
    try:
        return os.get_terminal_size(sys.stderr.fileno()).columns
    except (AttributeError, ValueError, OSError, io.UnsupportedOperation):
        return 0


def quiet() -> bool:
    """True when the `elmokit` logger was set above INFO (`elmo -q`, or by the program using the
    library): then no bar and no progress line. Unset (a library's default), progress shows."""
    level = logging.getLogger(PACKAGE_LOGGER).level
    return level > logging.INFO


# ---------------------------------------------------------------------------------------------
# Rate and time left
# ---------------------------------------------------------------------------------------------
class RateEstimate:
    """Items per second since the first update (which is left out as warm-up), and time left."""

    def __init__(self) -> None:
        self.base: tuple[float, float] | None = None  # (n, time) at the first update

    def observe(self, n: float, now: float) -> None:
        """Note that `n` items are done at `now` (call after every update)."""
        if self.base is None:
            self.base = (n, now)

    def rate(self, n: float, now: float) -> float | None:
        """Items per second after the first update; None before a second one."""
        if self.base is None or n <= self.base[0] or now <= self.base[1]:
            return None
        return (n - self.base[0]) / (now - self.base[1])

    def seconds_left(self, n: float, total: float | None, now: float) -> float | None:
        rate = self.rate(n, now)
        if rate is None or not total:
            return None
        return max(0.0, total - n) / rate


def format_seconds(seconds: float | None) -> str:
    """"?" for None; "45s", "12m05s", "3h07m"."""
    if seconds is None:
        return "?"
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def format_count(value: float) -> str:
    return f"{value:,.0f}" if value >= 100 or value == int(value) else f"{value:,.2f}"


# ---------------------------------------------------------------------------------------------
# The two reporters
# ---------------------------------------------------------------------------------------------
class TerminalBar(tqdm):
    """A tqdm bar whose rate (and so its ETA) leaves out the first update (`RateEstimate`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._estimate = RateEstimate()
        super().__init__(*args, **kwargs)

    def update(self, n: float = 1) -> bool | None:
        self._estimate.observe(self.n + n, self._time())
        return super().update(n)

    @property
    def format_dict(self) -> dict:
        values = super().format_dict
        if hasattr(self, "_estimate"):
            values["rate"] = self._estimate.rate(self.n, self._time()) or 0  # 0: tqdm prints "?"
        return values


class LogProgress:
    """Progress as log lines every `interval` seconds, for a stderr that is a file or a pipe.

    Offers what elmokit's loops use of a tqdm bar: iteration, update, set_postfix,
    set_description, write, close and `with`.
    """

    def __init__(self, iterable: Iterable | None = None, total: float | None = None, desc: str = "",
                 unit: str = "it", initial: float = 0, interval: float | None = None,
                 clock: Any = time.monotonic, **_ignored: Any) -> None:
        self.iterable = iterable
        if total is None and iterable is not None and hasattr(iterable, "__len__"):
            total = len(iterable)
        self.total, self.desc, self.unit, self.n = total, desc, unit.strip(), initial
        self.interval = log_interval() if interval is None else interval
        self.postfix = ""
        self.clock = clock
        self.start = self.last_line = clock()
        self.lines = 0
        self.closed = False
        self._estimate = RateEstimate()

    def __iter__(self) -> Iterator:
        for item in self.iterable:
            yield item
            self.update(1)

    def __len__(self) -> int:
        return int(self.total or 0)

    def __enter__(self) -> LogProgress:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def update(self, n: float = 1) -> None:
        self.n += n
        now = self.clock()
        self._estimate.observe(self.n, now)
        if now - self.last_line >= self.interval:
            self.last_line = now
            self.lines += 1
            log.info(self.status(now))

    def status(self, now: float) -> str:
        done = f"{format_count(self.n)}/{format_count(self.total)}" if self.total else format_count(self.n)
        percent = f" ({100 * self.n / self.total:.0f}%)" if self.total else ""
        rate = self._estimate.rate(self.n, now)
        speed = f", {format_count(rate)} {self.unit}/s" if rate is not None else ""
        left = f", {format_seconds(self._estimate.seconds_left(self.n, self.total, now))} left" if self.total else ""
        return f"{self.desc}: {done} {self.unit}{percent}{speed}{left}{self.postfix}"

    def set_postfix(self, ordered_dict: dict | None = None, refresh: bool = True, **values: Any) -> None:
        values = {**(ordered_dict or {}), **values}
        self.postfix = "".join(f", {name} {value}" for name, value in values.items())

    def set_postfix_str(self, text: str = "", refresh: bool = True) -> None:
        self.postfix = f", {text}" if text else ""

    def set_description(self, desc: str | None = None, refresh: bool = True) -> None:
        self.desc = desc or ""

    def refresh(self) -> None:
        pass

    def write(self, text: str, file: Any = None, end: str = "\n") -> None:
        log.info(text)

    def close(self) -> None:
        """A last line with the count, the time and the rate, when the job was long enough to
        have had progress lines (or the interval is 0)."""
        if self.closed:
            return
        self.closed = True
        seconds = self.clock() - self.start
        if self.lines or self.interval == 0 or seconds >= self.interval:
            rate = self.n / seconds if seconds > 0 else 0.0
            log.info(f"{self.desc}: {format_count(self.n)} {self.unit} in {format_seconds(seconds)} "
                     f"({format_count(rate)} {self.unit}/s){self.postfix}")


def progress_bar(iterable: Iterable | None = None, total: float | None = None, *, desc: str = "",
                 unit: str = "it", enabled: bool = True, initial: float = 0, unit_scale: bool = False,
                 leave: bool = True, smoothing: float | None = None, **kwargs: Any) -> tqdm | LogProgress:
    """A progress reporter, as the module docstring says: a bar, log lines, or nothing.

    Takes tqdm's arguments (`iterable`, `total`, `desc`, `unit`, `initial`, `unit_scale`, `leave`);
    `enabled=False` (a command's --no-progress) gives a disabled tqdm, which does nothing.
    """
    if not enabled or quiet():
        return tqdm(iterable, total=total, initial=initial, disable=True)
    if stderr_is_terminal():
        log.debug(f"{desc}: a progress bar (total {total})")
        width = {"dynamic_ncols": True} if terminal_columns() else {"ncols": 100, "nrows": 40}  # size unknown (0 x 0)
        return TerminalBar(iterable, total=total, desc=desc, unit=unit, initial=initial, unit_scale=unit_scale,
                           leave=leave, mininterval=0.5, file=sys.stderr, **width, **kwargs)
    log.debug(f"{desc}: a progress line every {log_interval():g} s (total {total}; stderr is not a terminal)")
    return LogProgress(iterable, total=total, desc=desc, unit=unit, initial=initial)


def write(message: str) -> None:
    """A line of information a loop always reports (a task's epoch line): through logging where
    the `elmokit` logger has a handler (the command line), else on stderr between a bar's lines
    (a library's user, who set up no logging, sees it); nothing when `quiet()`."""
    if quiet():
        return
    if logging.getLogger(PACKAGE_LOGGER).handlers:
        log.info(message)
    else:
        tqdm.write(message, file=sys.stderr)


# ---------------------------------------------------------------------------------------------
# Logging for the command line
# ---------------------------------------------------------------------------------------------
class LogHandler(logging.Handler):
    """Writes records to the current sys.stderr through `tqdm.write`, so that a message does
    not break a bar's line; INFO as the bare message, other levels prefixed
    ("elmo embed: warning: ...")."""

    def __init__(self, prefix: str = "elmo") -> None:
        super().__init__()
        self.prefix = prefix

    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage()
        if record.exc_info:
            message += "\n" + logging.Formatter().formatException(record.exc_info)
        if record.levelno == logging.INFO:
            return message
        return f"{self.prefix}: {record.levelname.lower()}: {message}"

    def emit(self, record: logging.LogRecord) -> None:
        try:
            tqdm.write(self.format(record), file=sys.stderr)
            sys.stderr.flush()
        except Exception:  # noqa: BLE001 - logging must never raise
            self.handleError(record)


def configure_logging(verbosity: int, prefix: str = "elmo") -> None:
    """The `elmokit` logger for a command: verbosity -1 (-q) errors only, 0 information and
    progress (the default), 1 (-v) debugging detail too. Replaces a handler an earlier call
    installed (tests call `main` many times in one process)."""
    level = logging.ERROR if verbosity < 0 else logging.DEBUG if verbosity > 0 else logging.INFO
    logger = logging.getLogger(PACKAGE_LOGGER)
    for handler in [h for h in logger.handlers if isinstance(h, LogHandler)]:
        logger.removeHandler(handler)
    logger.addHandler(LogHandler(prefix))
    logger.setLevel(level)
    logger.propagate = False
