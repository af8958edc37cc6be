"""
What a daemon's C{makeService} does alike in every tap: a start failure
told as one line and an exit status, the top service with its signal
handling and log format, a bound address told in a log line.
"""

from __future__ import annotations

import os
import sys
from typing import Any, NoReturn

from llmgw.daemon.lifecycle import Lifecycle
from llmgw.daemon.logs import json_observer
from llmgw.reactors import ISignalReactor


def fail(program: str, message: str, status: int) -> NoReturn:
    """
    End the process at start with C{program: message} on stderr, and no
    usage text or traceback: the operator needs the key and the value.

    @param status: the exit status (2 for a configuration error, 1 for a
        listener that cannot open; docs/server.md, "Exit statuses").
    """
    sys.stderr.write(f"{program}: {message}\n")
    sys.stderr.flush()
    raise SystemExit(status) from None


def top_service(
    reactor: ISignalReactor, program: str, log_format: str, twistd_options: Any
) -> Lifecycle:
    """
    @param log_format: C{text} or C{json} (then one JSON object per line, to
        twistd's log file).
    @param twistd_options: twistd's own options (C{options.parent}), or
        L{None}: where the log goes.
    @return: an empty L{Lifecycle} whose stop a second signal does not
        interrupt.
    """
    check_twistd_files(program, twistd_options)
    observer = None
    if log_format == "json":
        try:
            observer = json_observer(twistd_options)
        except OSError as e:
            fail(program, f"config error: --logfile: cannot open it: {e}", 2)
    top = Lifecycle(log_observer=observer)
    top.stop_once_on_signals(reactor)
    return top


def check_twistd_files(program: str, twistd_options: Any) -> None:
    """
    End the process with one line (status 2) when twistd's C{--logfile}
    cannot be opened or its C{--pidfile}'s folder cannot be written:
    twistd opens them itself after C{makeService}, and fails there with a
    traceback.

    @param twistd_options: twistd's own options, or L{None}.
    """
    get = twistd_options.get if twistd_options is not None else (lambda name: None)
    logfile, pidfile = get("logfile"), get("pidfile")
    try:
        if logfile and logfile != "-":
            open(logfile, "a").close()
    except OSError as e:
        fail(program, f"config error: --logfile: cannot open it: {e}", 2)
    if pidfile:
        # Not opened here: twistd refuses a pidfile that exists and holds
        # no pid.
        folder = os.path.dirname(os.path.abspath(pidfile))
        if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
            fail(
                program,
                f"config error: --pidfile: cannot write {pidfile!r}: no folder"
                f" {folder!r} that this user may write",
                2,
            )


def host_and_port(address: Any) -> tuple[Any, Any]:
    """
    @param address: a listener's C{getHost()}.
    @return: its host and port as a log line shows them: the whole address
        and C{""} for one without (a UNIX socket's).
    """
    return getattr(address, "host", address), getattr(address, "port", "")
