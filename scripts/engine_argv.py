"""
Parse engine command lines with the engine's own argument parser: run as
C{PYTHON scripts/engine_argv.py ENGINE IN.json OUT.json} (ENGINE: C{vllm},
C{sglang} or C{llamacpp}) by the Python of the environment the engine is
installed in (C{.vllm/venv/bin/python}, with C{.vllm/sglang} on
C{PYTHONPATH} for SGLang, or llmgw's own for llama-cpp-python), as
C{tests/test_engine_parsers.py} does, or by an operator checking a
profile's C{args} against the engine a node has.  No llmgw import, and
outside C{tests/}: it runs where llmgw is not installed, and imports what
llmgw's own venv does not have.

C{IN.json} is a list of argument lists (what follows the program: for vLLM
C{["serve", MODEL, ...]}, for SGLang and llama-cpp-python what follows C{-m
sglang.launch_server} or C{-m llama_cpp.server}); C{OUT.json} gets one
object per list: C{error} (what the parser printed when it refused, else
C{""}), C{unknown} (each
C{--flag} that is not exactly one of the parser's option strings: an
abbreviation argparse would accept is still a misspelling in a command line
llmgw builds), and C{values} (the parsed namespace, as JSON can hold it).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
from typing import Any


def _vllm() -> tuple[argparse.ArgumentParser, Any]:
    # As vllm/entrypoints/cli/main.py builds `vllm`'s parser, for `serve` only.
    # Not in llmgw's venv, where mypy runs: only in the vLLM venv.
    from vllm.entrypoints.cli.serve import cmd_init  # type: ignore[import-not-found]
    from vllm.utils.argparse_utils import (  # type: ignore[import-not-found]
        FlexibleArgumentParser,
    )

    parser = FlexibleArgumentParser(prog="vllm")
    subparsers = parser.add_subparsers(required=False, dest="subparser")
    (serve,) = cmd_init()
    serve_parser = serve.subparser_init(subparsers)
    return parser, (serve, serve_parser)


def _sglang() -> tuple[argparse.ArgumentParser, Any]:
    # As sglang/srt/server_args.py's prepare_server_args builds its parser
    # (python -m sglang.launch_server); ServerArgs' own checks, in its
    # __post_init__, read the GPUs, and are not run.
    from sglang.srt.server_args import ServerArgs  # type: ignore[import-not-found]

    parser = argparse.ArgumentParser(prog="sglang serve")
    ServerArgs.add_cli_args(parser)
    return parser, None


def _llamacpp() -> tuple[argparse.ArgumentParser, Any]:
    # As llama_cpp/server/__main__.py builds its parser and reads it.
    from llama_cpp.server.cli import add_args_from_model
    from llama_cpp.server.settings import Settings

    parser = argparse.ArgumentParser(prog="llama_cpp.server")
    add_args_from_model(parser, Settings)
    parser.add_argument("--config_file", type=str)
    return parser, None


def _options(parser: argparse.ArgumentParser) -> set[str]:
    found: set[str] = set()
    for action in parser._actions:
        found.update(action.option_strings)
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found |= _options(sub)
    return found


def _jsonable(value: Any) -> Any:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)
    return value


def parse(engine: str, argv: list[str]) -> dict[str, Any]:
    parser, extra = {"vllm": _vllm, "sglang": _sglang, "llamacpp": _llamacpp}[engine]()
    options = _options(parser)
    unknown = [
        a.split("=", 1)[0]
        for a in argv
        if a.startswith("--") and a.split("=", 1)[0] not in options
    ]
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(err):
            args = parser.parse_args(argv)
            if engine == "vllm":
                serve, _ = extra
                serve.validate(args)
            elif engine == "llamacpp":
                from llama_cpp.server.cli import parse_model_from_args
                from llama_cpp.server.settings import ModelSettings, ServerSettings

                parse_model_from_args(ServerSettings, args)
                parse_model_from_args(ModelSettings, args)
    except SystemExit:
        return {"error": err.getvalue().strip() or "exit", "unknown": unknown}
    except Exception as e:  # a value the engine's own checks refuse
        return {"error": f"{type(e).__name__}: {e}", "unknown": unknown}
    values = {k: _jsonable(v) for k, v in vars(args).items()}
    return {"error": "", "unknown": unknown, "values": values}


def main() -> None:
    engine, source, target = sys.argv[1:4]
    with open(source) as f:
        argvs = json.load(f)
    results = [parse(engine, argv) for argv in argvs]
    with open(target, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main()
