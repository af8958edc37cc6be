"""
One agent per state directory: a lock on C{DIR/agent.lock}, held for the
life of the process.  Two agents on one directory would both adopt the
engines it records and stop each other's; the second is refused at its
start, told which process holds the directory.

The lock is C{flock(2)}: the kernel drops it when its holder exits, however
it exits, so a crash leaves nothing to clean up.  It is taken before twistd
daemonizes (the child inherits it) and the file names the holder's pid and
program: rewritten once the service starts, in the process that runs.
"""

from __future__ import annotations

import fcntl
import os
from typing import IO

from llmgw.config_checks import ConfigError

LOCK_FILE = "agent.lock"


class StateLock:
    """
    The held lock of one state directory.

    @ivar folder: the state directory.
    @ivar program: how the holder is named to a second agent, such as
        C{"llmgw-agent"} or C{"llmgw-server --local"}.
    """

    def __init__(self, folder: str, program: str, handle: IO[str]) -> None:
        self.folder = folder
        self.program = program
        self._handle = handle

    def note_pid(self) -> None:
        """
        Write this process's pid and program in the lock file (after a
        fork, the pid that holds the lock now).
        """
        handle = self._handle
        handle.seek(0)
        handle.truncate()
        handle.write(f"{os.getpid()} {self.program}\n")
        handle.flush()

    def release(self) -> None:
        """
        Let the directory go (closing the file drops the lock).
        """
        self._handle.close()


def hold_state_dir(folder: str, program: str) -> StateLock:
    """
    Take the state directory C{folder} for this process.

    @param program: the holder's name, written in the lock file.
    @return: the lock, held until L{StateLock.release} or the process ends.
    @raise ConfigError: another process holds it (the message names the
        folder and the holder's pid and program), or the lock file cannot
        be made.
    """
    path = os.path.join(folder, LOCK_FILE)
    try:
        os.makedirs(folder, mode=0o700, exist_ok=True)
        handle = open(path, "a+", encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"state_dir: cannot use {folder!r}: {e.strerror}") from None
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        handle.seek(0)
        holder = handle.read().split(maxsplit=1)
        handle.close()
        who = (
            f"{holder[1].strip()} pid {holder[0]}"
            if len(holder) == 2
            else f"pid {holder[0]}"
            if holder
            else "another process"
        )
        raise ConfigError(
            f"state_dir: {folder!r} is in use by {who}: one agent per state"
            " directory (give this one its own --state-dir)"
        ) from None
    lock = StateLock(folder, program, handle)
    lock.note_pid()
    return lock
