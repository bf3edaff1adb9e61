"""Writing files so that nothing is ever half-written, lost or written by two processes at once.

    atomic_path / atomic_write_*   a temporary name, flushed to the disk, then renamed into place
    durable_replace                the rename itself: fsync the file, rename, fsync the directory
    refuse_overwrite               the one rule of every command: an existing output is replaced
                                   only with --overwrite
    refuse_output_over_input       and its twin: no output is, holds or sits inside an input
    output_lock                    one writer at a time for an output file or run directory

Why this file is long: every rule of writing a file safely (temporary names and the leftovers of
killed writes, replacing a folder, refusing an output over an input, the lock) sits together, as
each write calls several of them; apart, a reader would hold several files to see what one write does.
"""

from __future__ import annotations

import contextlib
import errno
import glob
import json
import os
import re
import shutil
import socket
import stat
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

from elmokit.progress import quiet


# ---------------------------------------------------------------------------------------------
# Durable, atomic writes
# ---------------------------------------------------------------------------------------------
def fsync_path(path: str | Path) -> None:
    """Flush a written file's data to the disk (after its writer closed it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_directory(path: str | Path) -> None:
    """Flush a directory's entries (a rename into it) to the disk, where the system allows it."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:  # a system that cannot open directories (Windows)
        return
    try:
        os.fsync(fd)
    except OSError as error:
        if error.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):  # not supported there
            raise
    finally:
        os.close(fd)


def durable_replace(source: str | Path, destination: str | Path) -> None:
    """`os.replace` that survives a power cut: the file's data reaches the disk before the rename,
    and the rename before this returns, so the destination is the old file or the whole new one."""
    fsync_path(source)
    os.replace(source, destination)
    fsync_directory(Path(destination).parent)


@contextlib.contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield a temporary path beside `path`; on success it is flushed and renamed onto `path`
    (`durable_replace`).

    On an exception (or a kill) the destination is untouched and the temporary file removed
    (a kill leaves only a `.tmp` file, never a corrupt destination). The temporary file's name
    holds this process's pid, so the next write of `path` removes what killed writers left
    (`abandoned_writes`) and never a live writer's.
    """
    path = Path(path)
    check_replaceable(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    for leftover in abandoned_writes(path):
        with contextlib.suppress(OSError):  # another writer may remove it first
            leftover.unlink()
    handle, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.{os.getpid()}_", suffix=".tmp", dir=path.parent)
    os.close(handle)
    tmp = Path(tmp_name)
    try:
        yield tmp
        if tmp.exists():  # mkstemp made it 0600: give it the permissions a new file normally gets
            tmp.chmod(0o666 & ~_umask())
        durable_replace(tmp, path)
    except OSError as error:
        if error.errno is None or error.strerror != os.strerror(error.errno) or error.filename is not None:
            raise  # it says what failed already
        raise _write_failure(path, error.errno) from error
    except Exception as error:  # a library's failed write (h5py, safetensors) said as the OSError it is
        code = _errno_in(error)
        if code is None:
            raise
        raise _write_failure(path, code) from error
    finally:
        tmp.unlink(missing_ok=True)


def unfinished_writes(path: str | Path) -> list[Path]:
    """The temporary files of `atomic_path(path)` that writers killed before their rename left
    beside `path` (named as atomic_path names them: `.NAME.` + the writer's pid, `_` and mkstemp's
    random letters, or the letters alone before elmokit put the pid there, + `.tmp`), for the next
    writer of `path` to remove (a kill runs no `finally`)."""
    path = Path(path)
    pattern = re.compile(re.escape(f".{path.name}.") + r"[A-Za-z0-9_]+\.tmp")
    found = path.parent.glob(f".{glob.escape(path.name)}.*.tmp")
    return sorted(temporary for temporary in found if pattern.fullmatch(temporary.name))


UNNAMED_LEFTOVER_SECONDS = 24 * 3600  # a temporary file without a pid (an older elmokit's) is abandoned after a day


def abandoned_writes(path: str | Path) -> list[Path]:
    """The `unfinished_writes(path)` that no live process holds: named with the pid of a process
    that has ended (this machine's pids: one output is written from one machine at a time), or,
    named without a pid by an older elmokit, untouched for `UNNAMED_LEFTOVER_SECONDS`."""
    path = Path(path)
    abandoned = []
    for temporary in unfinished_writes(path):
        owner = re.fullmatch(r"(\d+)_[a-z0-9_]{8}", temporary.name[len(path.name) + 2:-len(".tmp")])
        try:
            ended = (not _pid_alive(int(owner.group(1))) if owner else
                     time.time() - temporary.stat().st_mtime > UNNAMED_LEFTOVER_SECONDS)
        except OSError:  # removed meanwhile
            continue
        if ended:
            abandoned.append(temporary)
    return abandoned


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


ERRNO_IN_MESSAGE = re.compile(r"errno = (\d+)|os error (\d+)|\[Errno (\d+)\]")  # h5py, Rust (safetensors), Python


def _errno_in(error: BaseException) -> int | None:
    """The operating system's error number that a library's exception carries in its message."""
    found = ERRNO_IN_MESSAGE.search(str(error))
    return int(next(group for group in found.groups() if group)) if found else None


def _write_failure(path: Path, code: int) -> OSError:
    """The OSError of a failed write of `path`: the file, the reason, and for a full disk its space."""
    disk = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO}
    hint = f"; is the disk full or over its quota? {_free_space(path.parent)}" if code in disk else ""
    return OSError(code, f"writing {path} failed ({os.strerror(code)}){hint}")


def _free_space(folder: Path) -> str:
    try:
        return f"({shutil.disk_usage(folder).free:,} bytes free on the disk of {folder})"
    except OSError:
        return ""


def check_replaceable(path: Path) -> None:
    """Refuse a destination that a file renamed onto it would destroy rather than fill: a
    directory, or a device, pipe or socket (`--overwrite` onto /dev/null would replace the device
    with a file)."""
    if str(path) in ("", "."):
        raise IsADirectoryError("the output is an empty name: give a file name")
    _check_folder_above(path)
    try:
        mode = path.stat().st_mode
    except OSError:  # nothing there (or a dangling link, which the rename replaces)
        return
    if stat.S_ISDIR(mode):
        raise IsADirectoryError(f"{path} is a directory: give a file name for the output")
    if not stat.S_ISREG(mode):
        raise FileExistsError(f"{path} is not a regular file (a device, a pipe or a socket): elmokit writes "
                              "files through a temporary file renamed into place, which would replace it; "
                              "give a file name")


def check_replaceable_folder(path: Path) -> None:
    """Refuse, before any work, an output folder that is replaced whole (renamed into place) but
    cannot be: a file, or a symbolic link (the rename would replace the link, not the folder it
    names, and removing the old folder through a link fails only once everything is written)."""
    path = Path(path)
    _check_folder_above(path)
    if path.is_symlink():
        raise NotADirectoryError(f"output {path} is a symbolic link (to {path.resolve()}): an output folder is "
                                 f"replaced whole, not through a link; give the folder itself")
    if path.exists() and not path.is_dir():
        raise NotADirectoryError(f"output {path} is a file: give a folder name for the output")


def _check_folder_above(path: Path) -> None:
    """NotADirectoryError if the nearest existing path above `path` is not a folder (`t.onnx/x.onnx`
    with t.onnx a file), named, where making the folders would fail with "[Errno 17] File exists"."""
    for parent in path.parents:
        try:
            mode = parent.stat().st_mode
        except (FileNotFoundError, NotADirectoryError):  # not there, or below a file: look further up
            continue
        except OSError:  # unreadable: the write says what is wrong
            return
        if not stat.S_ISDIR(mode):
            raise NotADirectoryError(f"{path}: {parent} is a file, not a folder: the output cannot go inside it")
        return


def staging_folder(target: Path) -> Path:
    """A new empty folder beside `target` (the same file system: renamed onto it once complete),
    with the permissions a new folder normally gets (mkdtemp makes it 0700: private to its owner)."""
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    staging.chmod(0o777 & ~_umask())
    return staging


PROC_STATUS = "/proc/self/status"  # Linux (since 4.7) says the process's umask there: "Umask:\t0022"
_UMASK_LOCK = threading.Lock()


def _umask() -> int:
    """The process's umask, read without changing it where the system says it (Linux): setting it
    to 0 and back, as elsewhere (under a lock, among this module's callers only), gives a file
    that another thread creates meanwhile (elmo serve, a Ray actor) mode 0666."""
    try:
        with open(PROC_STATUS, encoding="ascii", errors="replace") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    with _UMASK_LOCK:
        mask = os.umask(0)
        os.umask(mask)
    return mask


def atomic_write_text(path: str | Path, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)


# ---------------------------------------------------------------------------------------------
# Existing outputs
# ---------------------------------------------------------------------------------------------
def refuse_overwrite(paths: Iterable[str | Path], overwrite: bool, what: str = "output") -> None:
    """FileExistsError naming every path of `paths` that exists, unless `overwrite`: no command
    replaces a file (or a run) the user did not ask it to replace."""
    paths = [Path(path) for path in paths]
    existing = [str(path) for path in paths if path.exists()]
    if existing and not overwrite:
        raise FileExistsError(f"{what} exists: {', '.join(existing)} (overwrite=True replaces it)")


def _real_path(path: str | Path) -> Path:
    """The path with its symbolic links followed; a loop of links is left as it is (absolute),
    for the reader of that path to say what it is."""
    try:
        return Path(path).resolve()
    except (RuntimeError, OSError):  # a symlink loop (RuntimeError before Python 3.13)
        return Path(os.path.abspath(path))


def refuse_output_over_input(inputs: Iterable[str | Path], outputs: Iterable[str | Path]) -> None:
    """ValueError naming the pair if writing one of `outputs` could destroy one of `inputs`: an
    output that is the input (the same path, a symbolic link to it, a hard link), an output folder
    that holds the input (replaced whole with --overwrite, it goes with it), or an output inside an
    input folder (a model's: it would replace what is being read). Every command calls it with all
    it reads and all it writes, before it reads anything; a folder written into rather than
    replaced is given as the files written in it. Symbolic links are followed."""
    given = [(Path(path), _real_path(path)) for path in inputs if str(path)]
    for output in map(Path, outputs):
        where = _real_path(output)
        for path, real in given:
            if where == real or (output.exists() and path.exists() and os.path.samefile(output, path)):
                problem = f"is the input {path}: writing it would replace what is being read"
            elif where in real.parents:
                problem = f"holds the input {path}: replacing it would delete the input with the folder"
            elif real in where.parents:
                problem = f"is inside the input folder {path}: writing it would change what is being read"
            else:
                continue
            raise ValueError(f"output {output} {problem}; choose another output")


@contextlib.contextmanager
def removed_if_unfinished(directory: str | Path, keep_if: str | tuple[str, ...]) -> Iterator[None]:
    """Write a run into `directory`: if the block stops (an error, an interrupt) before a file
    named in `keep_if` exists there (a checkpoint to resume from, a finished run's results), what
    the block added to `directory` is removed, the directory itself if the block made it: a failed
    start leaves no half-made run behind. Under torchrun only rank 0 removes anything."""
    directory = Path(directory)
    keep = (keep_if,) if isinstance(keep_if, str) else keep_if
    before = set(directory.iterdir()) if directory.is_dir() else None
    try:
        yield
    except BaseException:
        if (int(os.environ.get("RANK", "0")) == 0 and directory.is_dir()
                and not any((directory / name).exists() for name in keep)):
            for path in [directory] if before is None else sorted(set(directory.iterdir()) - before):
                if path.is_dir():
                    shutil.rmtree(path)
                else:
                    path.unlink()
        raise


# ---------------------------------------------------------------------------------------------
# One writer at a time
# ---------------------------------------------------------------------------------------------
class OutputInUseError(OSError):
    """Another process holds the lock of an output."""


@contextlib.contextmanager
def output_lock(lock_path: str | Path, what: str) -> Iterator[None]:
    """Hold an exclusive lock on `what` (an output file or a run directory) while writing it.

    The lock is `fcntl.flock` on `lock_path`, which names its holder (pid, host, start time,
    command) for the message a second writer gets (OutputInUseError, at once: no waiting). The
    system drops the lock when its process ends, however it ends, so the file a killed process
    leaves behind is a stale lock that the next writer simply takes over (and says so, unless
    `elmokit.progress.quiet`). The file
    is removed on release; a directory made here for it is removed too if left empty.

    Only a lock of ours is ever written or removed: the file is opened without following a
    symbolic link (O_NOFOLLOW), and an existing file that is not a lock record (a symbolic link,
    a hard link, a directory, a file with other contents) is refused with NotALockFileError,
    untouched.
    """
    import fcntl

    lock_path = Path(lock_path)
    made = [parent for parent in (lock_path.parent, *lock_path.parent.parents) if not parent.exists()]
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    while True:
        fd = _open_lock_file(lock_path)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as error:
            if error.errno not in (errno.EAGAIN, errno.EWOULDBLOCK, errno.EACCES):
                os.close(fd)
                raise
            holder = _describe_holder(_read_holder(fd))
            os.close(fd)
            raise OutputInUseError(f"{what} is being written by another process ({holder}); wait for it "
                                   f"to finish or stop it (lock file: {lock_path})") from None
        try:  # the last holder may have removed the file between our open and our lock: retry
            if os.path.samestat(os.fstat(fd), os.lstat(lock_path)):
                break
        except FileNotFoundError:
            pass
        os.close(fd)
    try:
        stale = _read_holder(fd)
        if stale and not quiet():  # -q (or a program's logging above INFO): errors only
            print(f"note: taking over the stale lock of {what} left by {_describe_holder(stale)}, which "
                  "has ended", file=sys.stderr)
        record = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%d %H:%M:%S"),
                  "command": " ".join(sys.argv)[:500]}
        os.ftruncate(fd, 0)  # our own lock file (checked by _open_lock_file), held
        os.pwrite(fd, json.dumps(record).encode(), 0)
        yield
    finally:
        with contextlib.suppress(OSError):  # only the file we hold (see the retry above)
            if os.path.samestat(os.fstat(fd), os.lstat(lock_path)):
                lock_path.unlink()
        os.close(fd)
        for directory in made:  # innermost first
            with contextlib.suppress(OSError):
                directory.rmdir()  # only if empty


class NotALockFileError(FileExistsError):
    """The path of a lock holds something that is not a lock file of elmokit."""


def _open_lock_file(lock_path: Path) -> int:
    """A descriptor of the lock file at `lock_path`: made new (O_EXCL), or an existing lock file
    of ours (a regular file with one link, empty or holding a lock record), never through a
    symbolic link. Anything else there is refused, untouched (NotALockFileError)."""
    nofollow = getattr(os, "O_NOFOLLOW", 0)
    try:
        return os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_EXCL | nofollow, 0o644)
    except FileExistsError:
        pass
    refusal = (f"{lock_path} is in the way of the lock file, and is not a lock of elmokit: it is left "
               "as it is; move or remove it")
    try:
        fd = os.open(lock_path, os.O_RDWR | nofollow)
    except FileNotFoundError:  # removed since: try again
        return _open_lock_file(lock_path)
    except OSError as error:  # ELOOP: a symbolic link; EISDIR: a directory
        raise NotALockFileError(f"{refusal} ({error.strerror})") from None
    status = os.fstat(fd)
    if not stat.S_ISREG(status.st_mode) or status.st_nlink != 1 or not _is_lock_record(fd, status.st_size):
        os.close(fd)
        raise NotALockFileError(refusal)
    return fd


def _is_lock_record(fd: int, size: int) -> bool:
    """Whether the file holds nothing (a lock whose writer was killed before writing) or a record
    written by `output_lock`."""
    if size == 0:
        return True
    if size > 4096:
        return False
    record = _read_holder(fd)
    return bool(record) and {"pid", "host", "started"} <= set(record)


def _read_holder(fd: int) -> dict:
    try:
        record = json.loads(os.pread(fd, 4096, 0) or b"{}")
    except (ValueError, OSError):
        return {}
    return record if isinstance(record, dict) else {}


def _describe_holder(record: dict) -> str:
    if not record:
        return "process unknown"
    text = f"pid {record.get('pid')} on {record.get('host')}"
    if record.get("started"):
        text += f", since {record['started']}"
    if record.get("command"):
        text += f": {record['command'][:120]}"
    return text
