"""
Engine secrets: each engine llmgw starts gets a key of its own, derived
from one random server secret kept in the state directory, so that a
restarted server derives the same keys for the engines it adopts without
storing them.

The router sends an engine's key as C{Authorization: Bearer}; the agent
starts the engine with it (C{--api-key}) and probes it with it.  Nobody
else has it: a request straight to an engine's port gets 401.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets

SECRET_FILE = "engine-secret"
"""
The server secret's file name in the state directory (mode 0600).
"""


class EngineKeys:
    """
    Derives each shard's engine key: C{"llmgw-"} and the hex HMAC-SHA256
    of the shard id under the server secret (32 random bytes).

    @param state_dir: the server's state directory; the secret is read
        from C{STATE_DIR/engine-secret}, or made there (0600) on first use.
    @raise OSError: the file cannot be read or made.
    @raise ValueError: the file holds no secret (not 64 hex digits).
    """

    def __init__(self, state_dir: str) -> None:
        path = os.path.join(os.path.expanduser(state_dir), SECRET_FILE)
        self.path = path
        try:
            with open(path) as f:
                text = f.read().strip()
        except FileNotFoundError:
            os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
            text = secrets.token_hex(32)
            descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(descriptor, "w") as f:
                f.write(text + "\n")
        try:
            self._secret = bytes.fromhex(text)
        except ValueError:
            self._secret = b""
        if len(self._secret) != 32:
            raise ValueError(
                f"{path}: expected the engine secret, 64 hex digits; remove the"
                " file to make a new one (engines running now then need a restart)"
            )

    def for_shard(self, shard_id: str) -> str:
        """
        @return: the engine key of C{shard_id}: the same for the same shard
            id and server secret, after a restart too.
        """
        digest = hmac.new(self._secret, shard_id.encode("utf-8"), hashlib.sha256)
        return "llmgw-" + digest.hexdigest()

    def __repr__(self) -> str:
        return f"EngineKeys({self.path!r})"
