"""
The coding agents a user points at llmgw (Claude Code, Codex CLI, opencode),
run as a user runs them, for the end-to-end tests: each one's command from
C{agents/node_modules/.bin} (C{scripts/setup-agents} installs the versions
C{agents/package-lock.json} pins), its configuration in a temporary folder,
C{HOME} there too, and every update check and telemetry call turned off.
A missing client skips its test naming the npm package, or fails under
C{CI=true}, where C{.ci/run} installs them.

How each is pointed at a base URL and a key, read in each package's own
documentation and checked against the requests they send:

  - Claude Code: C{ANTHROPIC_BASE_URL} (the server's root: it posts to
    C{/v1/messages?beta=true}) and C{ANTHROPIC_API_KEY};
    C{CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC=1} and
    C{DISABLE_AUTOUPDATER=1}; C{claude -p PROMPT --model M}, with
    C{--allowedTools Bash} to let it run a command without asking (its
    C{--dangerously-skip-permissions} is refused to root);
  - Codex CLI: a C{config.toml} in C{CODEX_HOME} with a model provider of
    C{base_url} llmgw's C{/v1}, C{wire_api = "responses"} (it posts to
    C{/v1/responses}; it has no other wire API) and C{env_key}, the analytics
    off; C{codex exec --skip-git-repo-check
    --dangerously-bypass-approvals-and-sandbox PROMPT}; its shell tool is
    C{exec_command} with C{cmd};
  - opencode: C{OPENCODE_CONFIG_CONTENT} with a provider of C{npm}
    C{@ai-sdk/openai-compatible} (bundled with it: nothing is fetched),
    C{options.baseURL} llmgw's C{/v1} and C{options.apiKey}, the permission
    C{bash: allow}, and the C{OPENCODE_DISABLE_*} switches for the models
    list, updates, default plugins, LSP downloads and sharing;
    C{opencode run} with the prompt on standard input (it quotes an
    argument holding spaces, JSON quotes included); its shell tool is
    C{bash} with C{command}.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass

from tests.support import missing

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
AGENTS_BIN = os.path.join(ROOT, "agents", "node_modules", ".bin")
SETUP = "scripts/setup-agents"

PACKAGES = {
    "claude": "@anthropic-ai/claude-code",
    "codex": "@openai/codex",
    "opencode": "opencode-ai",
}
"""
Each client's command and the npm package that provides it.
"""

RUN_SECONDS = 60.0
"""
The most one client's run may take before the test fails: each takes
seconds on the simulator.
"""


def agent_command(name: str) -> str:
    """
    The path of a client's command.

    @param name: C{claude}, C{codex} or C{opencode}.
    @raise SkipTest: it is not installed, outside CI.
    @raise AssertionError: it is not installed, under C{CI=true}.
    """
    path = os.path.join(AGENTS_BIN, name)
    if not os.access(path, os.X_OK):
        why = (
            f"no {name} here: the npm package {PACKAGES[name]}, which {SETUP}"
            " installs into agents/node_modules"
        )
        missing(why, in_ci=why + " (.ci/run runs it before the tests)")
    return path


@dataclass(frozen=True)
class AgentRun:
    """
    One run of a client.

    @ivar returncode: its exit status.
    @ivar stdout: what it printed (its answer).
    @ivar stderr: its diagnostics.
    @ivar seconds: how long it ran, wall clock.
    """

    returncode: int
    stdout: str
    stderr: str
    seconds: float


def _base_env(home: str) -> dict[str, str]:
    # Only what a client needs: the user's keys and settings stay out.
    node = shutil.which("node")
    path = [os.path.dirname(node)] if node else []
    return {
        "PATH": os.pathsep.join([*path, "/usr/local/bin", "/usr/bin", "/bin"]),
        "HOME": home,
        "XDG_CONFIG_HOME": os.path.join(home, ".config"),
        "XDG_DATA_HOME": os.path.join(home, ".local", "share"),
        "XDG_STATE_HOME": os.path.join(home, ".local", "state"),
        "XDG_CACHE_HOME": os.path.join(home, ".cache"),
        "LANG": "C.UTF-8",
        "NO_COLOR": "1",
        "TERM": "dumb",
    }


class AgentClients:
    """
    Runs the three clients against one llmgw server and model.
    """

    def __init__(self, url: str, key: str, model: str) -> None:
        """
        @param url: the client API's base URL, C{http://127.0.0.1:PORT}.
        @param key: the API key the clients send.
        @param model: the model they ask for.
        """
        self.url = url
        self.key = key
        self.model = model
        self.home = tempfile.mkdtemp(prefix="llmgw-agent-home-")
        self.work = os.path.join(self.home, "work")
        os.makedirs(self.work)

    def cleanup(self) -> None:
        """
        Remove the clients' home folder.
        """
        shutil.rmtree(self.home, ignore_errors=True)

    def _run(
        self, argv: list[str], env: dict[str, str], stdin: str | None = None
    ) -> AgentRun:
        started = time.monotonic()
        done = subprocess.run(
            argv,
            input=stdin if stdin is not None else "",
            capture_output=True,
            text=True,
            timeout=RUN_SECONDS,
            env=env,
            cwd=self.work,
        )
        return AgentRun(
            done.returncode, done.stdout, done.stderr, time.monotonic() - started
        )

    def claude(self, prompt: str) -> AgentRun:
        """
        C{claude -p PROMPT}, allowed to run C{Bash}.
        """
        env = {
            **_base_env(self.home),
            "ANTHROPIC_BASE_URL": self.url,
            "ANTHROPIC_API_KEY": self.key,
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
            "DISABLE_AUTOUPDATER": "1",
            "DISABLE_TELEMETRY": "1",
            "DISABLE_ERROR_REPORTING": "1",
        }
        argv = [agent_command("claude"), "-p", prompt, "--model", self.model]
        return self._run([*argv, "--allowedTools", "Bash"], env)

    def codex(self, prompt: str) -> AgentRun:
        """
        C{codex exec PROMPT} through a provider of llmgw's Responses API,
        without approvals or sandbox (bubblewrap has no user namespaces in
        a container).
        """
        codex_home = os.path.join(self.home, ".codex")
        os.makedirs(codex_home, exist_ok=True)
        with open(os.path.join(codex_home, "config.toml"), "w") as f:
            f.write(
                f'model = "{self.model}"\n'
                'model_provider = "llmgw"\n'
                "check_for_update_on_startup = false\n"
                "\n[model_providers.llmgw]\n"
                'name = "llmgw"\n'
                f'base_url = "{self.url}/v1"\n'
                'env_key = "LLMGW_API_KEY"\n'
                'wire_api = "responses"\n'
                "request_max_retries = 0\n"
                "stream_max_retries = 0\n"
                "\n[analytics]\nenabled = false\n"
            )
        env = {
            **_base_env(self.home),
            "CODEX_HOME": codex_home,
            "LLMGW_API_KEY": self.key,
        }
        argv = [
            agent_command("codex"),
            "exec",
            "--skip-git-repo-check",
            "--dangerously-bypass-approvals-and-sandbox",
            prompt,
        ]
        return self._run(argv, env)

    def opencode(self, prompt: str) -> AgentRun:
        """
        C{opencode run} with the prompt on standard input, allowed to run
        C{bash}.
        """
        config = {
            "$schema": "https://opencode.ai/config.json",
            "autoupdate": False,
            "share": "disabled",
            "model": f"llmgw/{self.model}",
            "permission": {"bash": "allow", "edit": "allow"},
            "provider": {
                "llmgw": {
                    "npm": "@ai-sdk/openai-compatible",
                    "name": "llmgw",
                    "options": {"baseURL": self.url + "/v1", "apiKey": self.key},
                    "models": {self.model: {"name": self.model}},
                }
            },
        }
        env = {
            **_base_env(self.home),
            "OPENCODE_CONFIG_CONTENT": json.dumps(config),
            "OPENCODE_DISABLE_PROJECT_CONFIG": "1",
            "OPENCODE_DISABLE_MODELS_FETCH": "1",
            "OPENCODE_DISABLE_AUTOUPDATE": "1",
            "OPENCODE_DISABLE_DEFAULT_PLUGINS": "1",
            "OPENCODE_DISABLE_LSP_DOWNLOAD": "1",
            "OPENCODE_DISABLE_SHARE": "1",
            "OPENCODE_DISABLE_CLAUDE_CODE": "1",
        }
        return self._run([agent_command("opencode"), "run"], env, stdin=prompt)
