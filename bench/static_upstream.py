"""
A static upstream for benchmarks that measure the routers alone: Debian's
C{nginx-light} run as a child process (no master, one worker, in the
foreground) on a free loopback port, answering every chat completion with
one fixed C{chat.completion} object, so that an engine's CPU does not
count against the routers'.

What it serves, for what llmgw asks of a static (C{--endpoint}) replica:

  - C{POST /v1/chat/completions}: 200, the fixed answer, with usage
    (C{PROMPT_TOKENS} prompt and C{COMPLETION_TOKENS} completion tokens),
    whatever the request (nginx discards the body).
  - C{GET /metrics}: the three vLLM V1 load gauges at 0, as the simulator
    serves them, since the router polls each replica's C{/metrics} for
    engine load (L{llmgw.router.routing.load}; a 404 would only be logged and asked
    again less often).
  - C{GET /v1/models}, C{/health}: answered, though llmgw's static
    endpoints are not probed (failures are passive, L{llmgw.router.routing.ejection}).

Source for the directives: nginx's documentation, "Core functionality"
(C{daemon}, C{master_process}, C{worker_processes}, C{pid}) and
C{ngx_http_rewrite_module} (C{return}).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import time

from children import BenchError, Child, Children

PACKAGE = "nginx-light"
PROMPT_TOKENS = 12
COMPLETION_TOKENS = 16


def nginx() -> str:
    """
    @return: the path of the C{nginx} binary.
    @raise BenchError: nginx is not installed, naming the package.
    """
    found = shutil.which("nginx") or (
        "/usr/sbin/nginx" if os.access("/usr/sbin/nginx", os.X_OK) else None
    )
    if found is None:
        raise BenchError(
            f"nginx is not installed: apt-get install {PACKAGE}"
            " (or run with --upstream sim)"
        )
    return found


def answer(model: str) -> str:
    """
    The fixed chat completion every request gets, with usage.
    """
    return json.dumps(
        {
            "id": "chatcmpl-static",
            "object": "chat.completion",
            "created": 1764547200,
            "model": model,
            "choices": [
                {
                    "index": 0,
                    "message": {
                        "role": "assistant",
                        "content": "x " * COMPLETION_TOKENS,
                    },
                    "logprobs": None,
                    "finish_reason": "length",
                }
            ],
            "usage": {
                "prompt_tokens": PROMPT_TOKENS,
                "completion_tokens": COMPLETION_TOKENS,
                "total_tokens": PROMPT_TOKENS + COMPLETION_TOKENS,
            },
        },
        separators=(",", ":"),
    )


def _quoted(text: str) -> str:
    """
    C{text} as an nginx single-quoted string.
    """
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def config(directory: str, port: int, model: str) -> str:
    """
    The nginx configuration for one replica on 127.0.0.1:C{port}, its pid,
    logs and temporary files under C{directory}.
    """
    models = json.dumps(
        {
            "object": "list",
            "data": [{"id": model, "object": "model", "owned_by": "bench"}],
        }
    )
    metrics = (
        "vllm:num_requests_running 0\n"
        "vllm:num_requests_waiting 0\n"
        "vllm:kv_cache_usage_perc 0\n"
    )
    temp = "\n".join(
        f"    {kind}_temp_path {directory}/{kind};"
        for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
    )
    return f"""daemon off;
master_process off;
worker_processes 1;
pid {directory}/nginx.pid;
error_log {directory}/error.log warn;
events {{ worker_connections 1024; }}
http {{
    access_log off;
{temp}
    keepalive_requests 1000000;
    server {{
        listen 127.0.0.1:{port};
        default_type application/json;
        location = /v1/chat/completions {{ return 200 {_quoted(answer(model))}; }}
        location = /v1/models {{ return 200 {_quoted(models)}; }}
        location = /health {{ return 200 ''; }}
        location = /metrics {{
            default_type text/plain;
            return 200 {_quoted(metrics)};
        }}
    }}
}}
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def start_static(children: Children, name: str, model: str) -> tuple[Child, str]:
    """
    Start one nginx replica and wait until it answers.

    @return: the child and its base URL, C{http://127.0.0.1:PORT}.
    @raise BenchError: nginx is missing or did not come up.
    """
    binary = nginx()
    directory = os.path.join(children.directory, name)
    os.makedirs(directory, exist_ok=True)
    port = _free_port()
    path = os.path.join(directory, "nginx.conf")
    with open(path, "w") as f:
        f.write(config(directory, port, model))
    child = children.start(name, "", [binary, "-p", directory, "-c", path])
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 10
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return child, url
        except OSError:
            if child.popen.poll() is not None or time.monotonic() > deadline:
                with open(os.path.join(directory, "error.log"), errors="replace") as f:
                    raise BenchError(
                        f"{name} did not come up:\n{child.output()}{f.read()}"
                    ) from None
            time.sleep(0.05)
