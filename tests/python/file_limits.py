"""A file-size limit for tests of writes that fail part way (a full disk fails them the same way)."""
import contextlib
import resource
import signal


@contextlib.contextmanager
def file_size_limit(nbytes):
    """Within it this process may write no file past `nbytes` bytes: such a write fails with
    EFBIG (SIGXFSZ, which would end the process, is ignored meanwhile)."""
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, old_handler)
