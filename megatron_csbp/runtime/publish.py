"""A directory written whole or not at all: built under a private name beside its target, published by rename.

Whatever we write for others to load (a Hugging Face export, an imported checkpoint, a checkpoint's
iteration) must never be seen half-written, stale or mixed with an earlier write: whoever finds the
directory finds one complete write. So it is built in a private temporary in the target's parent (the same
filesystem, so a rename moves it whole) and renamed onto the target only when complete.

Replacing a target that holds something: on Linux the two directories are exchanged in one step
(`renameat2(RENAME_EXCHANGE)`), so at every instant the target's name holds the old directory or the new
one; the old one, now under the private name, is removed afterwards. Where the kernel or filesystem cannot
exchange, the old directory is renamed aside first; a crash between the two renames leaves it whole under
`.NAME.old-...` beside the target. Either way the old contents go only after the new ones are complete.

A killed writer leaves its private temporary behind (nothing can remove it then). The names carry the
host and pid, and the next write beside the same target removes those of this host whose process is gone.
"""

import contextlib
import ctypes
import errno
import os
import shutil
import socket
import tempfile

from megatron_csbp.core.rules import ConfigError

_PARTIAL, _OLD = "partial", "old"
_AT_FDCWD, _RENAME_EXCHANGE = -100, 2


def _prefix(target: str, kind: str) -> str:
    return f".{os.path.basename(target)}.{kind}-{socket.gethostname()}-"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_abandoned(target: str) -> list[str]:
    """Removes the private temporaries (and set-aside old copies) of `target` that writers of this host
    left when they were killed; returns their paths."""
    parent = os.path.dirname(target)
    removed = []
    try:
        names = os.listdir(parent)
    except OSError:
        return removed
    for kind in (_PARTIAL, _OLD):
        prefix = _prefix(target, kind)
        for name in names:
            pid = name[len(prefix):].split("-")[0] if name.startswith(prefix) else ""
            if pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)):
                shutil.rmtree(os.path.join(parent, name), ignore_errors=True)
                removed.append(os.path.join(parent, name))
    return removed


def fsync_path(path: str) -> None:
    """Makes what `path` holds durable: a file's contents, or a directory's entries (a rename or a new file)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def make_private(target: str, flag: str) -> str:
    """A new empty private directory beside `target` (its parent created if missing). Refuses, naming
    `flag`, a parent that cannot be written (read-only, a file on the way, no permission)."""
    target = os.path.abspath(target)
    parent = os.path.dirname(target)
    try:
        os.makedirs(parent, exist_ok=True)
        remove_abandoned(target)
        return tempfile.mkdtemp(prefix=f"{_prefix(target, _PARTIAL)}{os.getpid()}-", dir=parent)
    except (FileExistsError, NotADirectoryError):
        raise ConfigError(f"{flag} {target}: a file stands where a directory is needed on that path; give "
                          f"a path under a directory") from None
    except OSError as error:
        raise ConfigError(f"{flag} {target}: cannot write in {parent} ({error.strerror}); give a writable "
                          f"location") from None


def discard(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def private_directory(target: str, flag: str):
    """A private directory beside `target` for the duration of the block; removed if the block fails (a
    published one has been renamed away, so nothing is left either way)."""
    private = make_private(target, flag)
    try:
        yield private
    finally:
        discard(private)


def _exchange(first: str, second: str) -> bool:
    """Swaps two directories in one step; False where the kernel, C library or filesystem cannot."""
    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if renameat2 is None:
        return False
    if renameat2(_AT_FDCWD, os.fsencode(first), _AT_FDCWD, os.fsencode(second), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
        return False
    raise OSError(code, os.strerror(code), second)


def _set_aside(target: str) -> str:
    aside = tempfile.mkdtemp(prefix=f"{_prefix(target, _OLD)}{os.getpid()}-", dir=os.path.dirname(target))
    os.rename(target, os.path.join(aside, "old"))
    return aside


def publish_directory(private: str, target: str, *, replace: bool, flag: str) -> None:
    """Renames the complete `private` directory onto `target`.

    A missing or empty target is taken by one rename. A non-empty one is replaced whole with `replace`
    (old contents removed only after the new ones are in place), else refused: something was written
    there after the caller looked (e.g. a concurrent writer), and it is left as it is."""
    target = os.path.abspath(target)
    if replace and os.path.isdir(target) and os.listdir(target):
        if _exchange(private, target):
            fsync_path(os.path.dirname(target))
            discard(private)  # now the old contents
            return
        aside = _set_aside(target)
        os.rename(private, target)
        fsync_path(os.path.dirname(target))
        discard(aside)
        return
    try:
        os.rename(private, target)
    except OSError as error:
        if error.errno not in (errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR, errno.EISDIR):
            raise
        raise ConfigError(f"{flag} {target}: something else was written there meanwhile (another run?); it is "
                          f"left as it is and nothing was published: give another {flag}") from None
    fsync_path(os.path.dirname(target))


def out_of_space(error: BaseException) -> bool:
    """Whether `error` (or what caused it) is a full disk (torch's writers word it their own way)."""
    seen = 0
    while error is not None and seen < 10:
        if isinstance(error, OSError) and error.errno == errno.ENOSPC or "no space left" in str(error).lower():
            return True
        error, seen = error.__cause__ or error.__context__, seen + 1
    return False


def require_free_space(where: str, needed: int, flag: str) -> None:
    """Refuses, before anything is written, a location with less free space than `needed` bytes."""
    probe = where
    while not os.path.exists(probe) and os.path.dirname(probe) != probe:
        probe = os.path.dirname(probe)
    free = shutil.disk_usage(probe).free
    if free < needed:
        raise ConfigError(f"{flag} {where}: {needed / 2**20:.1f} MiB are to be written but only "
                          f"{free / 2**20:.1f} MiB are free there; free space or give another {flag}")
