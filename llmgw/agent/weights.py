"""
Model files on this node: what sits in the configured weights directories
(each entry directly inside one: a file such as a GGUF, or a folder such
as a Hugging Face cache entry), and their removal, never outside those
directories.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence

from llmgw.agent.engines import CommandRefused
from llmgw.wire import agent_pb2 as pb
from llmgw.wire.engines import hub_cache_name


class RemovalRefused(CommandRefused):
    """
    A C{RemoveWeights} path is not one this agent deletes: outside its
    weights directories, a weights directory itself, or in use.
    """


MAX_FILES_WALKED = 200_000
"""
Files looked at per scan, in all; a bigger tree is reported as far as
walked.
"""


def _size_and_use(path: str, budget: list[int]) -> tuple[int, float]:
    """
    @return: bytes under C{path} and the latest access or change time
        (POSIX seconds) of anything in it; symlinks are not followed.
    """
    try:
        info = os.lstat(path)
    except OSError:
        return 0, 0.0
    if not os.path.isdir(path) or os.path.islink(path):
        return info.st_size, max(info.st_atime, info.st_mtime)
    # A folder: its files' sizes and uses (scanning it touches the
    # folders' own access times).
    size, last = 0, 0.0
    for root, _dirs, files in os.walk(path):
        for name in files:
            if budget[0] <= 0:
                return size, last
            budget[0] -= 1
            try:
                info = os.lstat(os.path.join(root, name))
            except OSError:
                continue
            size += info.st_size
            last = max(last, info.st_atime, info.st_mtime)
    return size, last


def scan(directories: Sequence[str]) -> list[pb.WeightsFile]:
    """
    @return: each entry directly inside each directory, with its size in
        bytes (a folder's files added up) and when it was last used.
    """
    budget = [MAX_FILES_WALKED]
    found = []
    for directory in directories:
        try:
            names = sorted(os.listdir(directory))
        except OSError:
            continue
        for name in names:
            path = os.path.join(directory, name)
            size, last = _size_and_use(path, budget)
            found.append(
                pb.WeightsFile(path=path, size_bytes=size, last_used_unix=int(last))
            )
    return found


# Bytes a report needs besides its files: the AgentMessage field's tag and
# length (up to 1 + 5), total (up to 1 + 5) and truncated (2), rounded up.
_REPORT_OVERHEAD = 32


def _varint_size(value: int) -> int:
    size = 1
    while value >= 0x80:
        value >>= 7
        size += 1
    return size


def fit_report(files: Sequence[pb.WeightsFile], max_bytes: int) -> pb.WeightsReport:
    """
    The report of C{files} that fits in one frame: the first files, in
    order, whose C{pb.AgentMessage} serializes to at most C{max_bytes}.

    @param max_bytes: the frame maximum in force, bytes.
    @return: a report with C{total} = C{len(files)}, and C{truncated} set
        when some were left out.
    """
    budget = max_bytes - _REPORT_OVERHEAD
    kept = 0
    for entry in files:
        size = entry.ByteSize()
        # Each repeated entry: its tag (1 byte), its length, itself.
        budget -= 1 + _varint_size(size) + size
        if budget < 0:
            break
        kept += 1
    return pb.WeightsReport(
        files=files[:kept], total=len(files), truncated=kept < len(files)
    )


def _inside(path: str, directory: str) -> bool:
    return path != directory and path.startswith(directory.rstrip(os.sep) + os.sep)


def remove(
    directories: Sequence[str], paths: Sequence[str], in_use: Sequence[str]
) -> list[str]:
    """
    Delete C{paths}, each a file or folder inside one of C{directories}.
    Every path is checked, the folders on its way resolved, before anything
    is deleted; a symlink is removed itself, never what it points to.

    @param in_use: model sources of engines running here: refused too.
    @return: the paths deleted.
    @raise RemovalRefused: a path outside the weights directories (after
        resolving symlinks), a weights directory itself, or one in use;
        nothing is deleted then.
    """
    roots = [os.path.realpath(d) for d in directories]
    if not roots:
        raise RemovalRefused("this agent has no weights_dirs: it removes nothing")
    used = []
    cache_names = set()
    for source in in_use:
        if source.startswith(("/", "~", ".")):
            used.append(os.path.realpath(os.path.expanduser(source)))
        elif source:
            # A hub id: its Hugging Face cache folder.
            cache_names.add(hub_cache_name(source))
    checked: list[tuple[str, bool]] = []
    for path in paths:
        if not path or "\0" in path or "\n" in path or not os.path.isabs(path):
            raise RemovalRefused(f"path {path!r}: expected an absolute path")
        link = os.path.islink(path)
        # Every folder on the way is resolved; a symlink at the end is
        # removed itself (what it points to is left alone, wherever it is).
        parent = os.path.realpath(os.path.dirname(path))
        real = (
            os.path.join(parent, os.path.basename(path))
            if link
            else os.path.realpath(path)
        )
        if not any(_inside(real, root) for root in roots):
            raise RemovalRefused(
                f"path {path!r} (resolved {real!r}) is outside the weights"
                f" directories {', '.join(directories)}"
            )
        for source in used:
            if source == real or _inside(source, real) or _inside(real, source):
                raise RemovalRefused(f"path {path!r} is used by a running engine")
        if os.path.basename(real) in cache_names:
            raise RemovalRefused(f"path {path!r} is used by a running engine")
        checked.append((real, link))
    removed = []
    for target, link in checked:
        if link:
            # The link itself: what it points to may be in use by name.
            os.remove(target)
        elif os.path.isdir(target):
            shutil.rmtree(target)
        elif os.path.lexists(target):
            os.remove(target)
        else:
            continue
        removed.append(target)
    return removed
