"""Settings every test of the Python module relies on."""
import signal


def pytest_configure(config):
    # A shell starts a background job (`cmd &`, `nohup cmd &`) with SIGINT ignored, and Python
    # then leaves it ignored: Ctrl-C, `_thread.interrupt_main()` and a SIGINT sent to a child
    # process would do nothing, and the tests of Ctrl-C would wait out a plan's 600 s limit.
    # They need the handler an interactive run has (child processes inherit it as the default).
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
