"""The one line a user sees for an error they can cause (ValueError, OSError, ArithmeticError):
its own message, or for an error from the operating system, what happened to which path and what
to do, in place of Python's "[Errno 17] File exists: 'a_file'"."""

from __future__ import annotations

import errno

USER_ERRORS = (ValueError, OSError, ArithmeticError)

# errno -> what happened to the path, and what to do about it
_OS_ERRORS = {
    errno.EEXIST: ("exists and is not a directory", "choose another path, or move it away"),
    errno.ENOENT: ("does not exist (or a directory above it does not)", "check the path"),
    errno.ENOTDIR: ("has a file where its path needs a directory", "choose another path"),
    errno.EISDIR: ("is a directory where a file is needed", "pass a file"),
    errno.EACCES: ("cannot be used: permission denied",
                   "choose a path you may read and write, or change its permissions"),
    errno.EPERM: ("cannot be used: operation not permitted", "choose another path, or change its permissions"),
    errno.EROFS: ("is on a read-only file system", "choose a path on a writable disk"),
    errno.ENOSPC: ("cannot be written: the disk is full", "free some space, or choose another disk"),
    errno.EDQUOT: ("cannot be written: the disk quota is used up", "free some space, or choose another disk"),
    errno.ENAMETOOLONG: ("is too long a name", "choose a shorter path"),
    errno.ENOTEMPTY: ("is a directory that is not empty", "choose another path, or empty it"),
}


def one_line(exc: BaseException) -> str:
    """What to print after "error: " for `exc`, on one line."""
    if isinstance(exc, OSError) and exc.errno is not None and exc.strerror and str(exc).startswith("[Errno"):
        return _os_error(exc)
    if isinstance(exc, ArithmeticError) and type(exc) is not FloatingPointError:
        # a raw arithmetic error (FloatingPointError is raised with its own sentence)
        return f"a computation failed ({type(exc).__name__}: {exc}): run again with NANOEULER_DEBUG=1 to see where"
    return " ".join(str(exc).split("\n")) or type(exc).__name__


def _os_error(exc: OSError) -> str:
    """An OSError Python raised with its bare "[Errno N] reason: 'path'" as a sentence."""
    path = exc.filename2 if exc.errno == errno.EEXIST and exc.filename2 is not None else exc.filename
    what, todo = _OS_ERRORS.get(exc.errno, (None, None))
    if path is None:
        return (f"the operating system refused an operation: {exc.strerror} "
                f"(run again with NANOEULER_DEBUG=1 to see where)")
    if what is None:
        return f"{path}: {exc.strerror}: check the path and try again"
    return f"{path} {what}: {todo}"


def unreadable(what: str, path, exc: Exception) -> str:
    """One line for the file `path` (`what`: "corpus", "data file", ...) that could not be read as
    text, from the OSError or UnicodeDecodeError reading it raised."""
    if isinstance(exc, UnicodeDecodeError):
        return f"{what} {path} is not UTF-8 text (byte {exc.start}): convert it to UTF-8 first"
    if isinstance(exc, FileNotFoundError):
        return f"{what} {path} not found"
    reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
    return f"cannot read {what} {path}: {reason}"
