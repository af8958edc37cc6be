"""
The catalog: the models operators declare, as C{[[models]]} tables with
ordered C{[[models.profiles]]} (docs/catalog.md).  Validation errors
name the model, the profile, the field and the value.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from llmgw.config_checks import (
    COUNT,
    DURATION,
    ConfigError,
    Key,
    Table,
    check_keys,
    parse_duration,
)
from llmgw.control.placement import Profile
from llmgw.wire.engines import ENGINES, SLEEP_LEVELS, SLEEPING_ENGINES

MAX_COUNT = 10_000
"""
The largest replica, GPU or node count a model may ask for.
"""


MODELS_TABLE = Table(
    "[[models]]",
    "The catalog: each model clients may ask for, kept running by the control"
    " plane on the nodes whose agents are connected.",
    (
        Key(
            "name",
            "string",
            'What clients send as "model"; the engine\'s served name.',
        ),
        Key("aliases", "list of strings", "Other names clients may send.", []),
        Key(
            "min_replicas",
            f"integer, 0 to {MAX_COUNT}",
            "Replicas always running (0: started by the first request).",
            0,
        ),
        Key(
            "max_replicas",
            f"integer, 1 to {MAX_COUNT}",
            "Replicas at most, more while busy (see [control] scale_up_in_flight).",
            shown="max(min_replicas, 1)",
        ),
        Key(
            "idle_timeout",
            DURATION,
            'Above min_replicas, idle this long: back to min_replicas; "0s" never.',
            600.0,
        ),
        Key(
            "pinned",
            "boolean",
            "Never stopped or put to sleep to make room for another model.",
            False,
        ),
        Key(
            "priority",
            "integer",
            "When room is made for another model, lower priorities go first.",
            0,
        ),
        Key(
            "min_resident",
            DURATION,
            "A replica started or woken is not evicted for another model"
            " before this long.",
            5.0,
        ),
        Key(
            "profiles",
            "[[models.profiles]] tables",
            "Ways to run it, at least one.",
        ),
    ),
)

PROFILES_TABLE = Table(
    "[[models.profiles]]",
    "Ways to run a model, tried by priority (highest first), then in order:"
    " placement picks the first that fits.",
    (
        Key("name", "string", "The profile's name, unique within its model."),
        Key("engine", "one of: " + ", ".join(ENGINES), "The engine that runs it."),
        Key(
            "source",
            "string",
            "Hub id or local path the engine understands.",
        ),
        Key("args", "list of strings", "More arguments for the engine.", []),
        Key(
            "env",
            "table of strings",
            "More environment variables for the engine.",
            {},
        ),
        Key("gpus", COUNT, "GPUs per node (0: the CPU).", 0),
        Key(
            "gpu_memory_gb",
            "number of GB >= 0",
            "Free memory needed on each of those GPUs (GB of 1024 MiB); only"
            " with gpus.",
            0,
        ),
        Key(
            "nodes",
            "integer >= 1",
            "Nodes per replica: more than 1 is a gang; rank, world size and"
            " leader address go to the engine.",
            1,
        ),
        Key(
            "fabric",
            "string",
            "The interconnect a gang's nodes must share (an agent's fabrics);"
            " needed with nodes > 1.",
            None,
        ),
        Key(
            "priority",
            "integer",
            "Higher is tried first.",
            0,
        ),
        Key(
            "sleep",
            '"off", "weights" or "discard"',
            "An idle replica sleeps instead of stopping (vLLM sleep level 1 keeps"
            " the weights in host memory, level 2 discards them; SGLang's memory"
            " saver); engines vllm, sglang and sim only.",
            "off",
        ),
        Key(
            "sleep_gpu_memory_gb",
            "number of GB >= 0",
            "GPU memory a sleeping engine keeps on each of its GPUs.",
            1.0,
        ),
        Key(
            "sleep_host_memory_gb",
            "number of GB >= 0",
            "Host memory a sleeping replica holds on each node, counted against"
            " the agent's sleep_memory.",
            shown='gpu_memory_gb * gpus for "weights", 0 for "discard"',
        ),
    ),
)


@dataclass(frozen=True)
class Model:
    """
    A catalog model.

    @ivar idle_timeout: seconds without requests before scaling down to
        C{min_replicas}; 0 never.
    @ivar profiles: ways to run it, in catalog order.
    @ivar pinned: never evicted to make room for another model.
    @ivar priority: lower is evicted first.
    @ivar min_resident: seconds a replica started or woken is kept before
        it may be evicted.
    """

    name: str
    aliases: tuple[str, ...]
    min_replicas: int
    max_replicas: int
    idle_timeout: float
    profiles: tuple[Profile, ...]
    pinned: bool = False
    priority: int = 0
    min_resident: float = 5.0

    @property
    def names(self) -> tuple[str, ...]:
        """
        Every name clients may send for it.
        """
        return (self.name, *self.aliases)


def _named_table(
    where: str, table: object, keys: frozenset[str]
) -> tuple[Mapping[str, Any], str, str]:
    """
    Check a model or profile table: a table, with a name, and only C{keys}.

    @return: the table, its name, and C{where} with the name added, for
        the messages of the fields checked next.
    """
    if not isinstance(table, Mapping):
        raise ConfigError(f"{where}: expected a table, got {table!r}")
    if "name" not in table:
        raise ConfigError(f"{where}.name: missing")
    name = _name(f"{where}.name", table["name"])
    where = f"{where} ({name})"
    check_keys(where, table, keys)
    return table, name, where


def _count(where: str, value: object, minimum: int) -> int:
    if (
        isinstance(value, bool)
        or not isinstance(value, int)
        or not minimum <= value <= MAX_COUNT
    ):
        shown = repr(value)[:100]
        raise ConfigError(
            f"{where}: expected an integer from {minimum} to {MAX_COUNT}, got {shown}"
        )
    return value


def _name(where: str, value: object) -> str:
    if not isinstance(value, str) or not value.strip() or len(value) > 200:
        raise ConfigError(f"{where}: expected a name, got {value!r}")
    return value


def _profile(where: str, table: object) -> Profile:
    table, name, where = _named_table(where, table, PROFILES_TABLE.names)
    for required in ("engine", "source"):
        if required not in table:
            raise ConfigError(f"{where}.{required}: missing")
    engine = table["engine"]
    if engine not in ENGINES:
        raise ConfigError(
            f"{where}.engine: unknown {engine!r} (known: {', '.join(ENGINES)})"
        )
    source = _name(f"{where}.source", table["source"])
    args = table.get("args", [])
    if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
        raise ConfigError(f"{where}.args: expected a list of strings, got {args!r}")
    env = table.get("env", {})
    if not isinstance(env, Mapping) or not all(
        isinstance(k, str) and k and "=" not in k and isinstance(v, str)
        for k, v in env.items()
    ):
        raise ConfigError(f"{where}.env: expected a table of strings, got {env!r}")
    gpus = _count(f"{where}.gpus", table.get("gpus", 0), 0)
    raw = table.get("gpu_memory_gb", 0)
    memory = _gb(f"{where}.gpu_memory_gb", raw)
    if memory and not gpus:
        raise ConfigError(
            f"{where}.gpu_memory_gb: {raw!r} with gpus = 0 (a CPU profile)"
        )
    nodes = _count(f"{where}.nodes", table.get("nodes", 1), 1)
    fabric = table.get("fabric")
    if fabric is not None:
        fabric = _name(f"{where}.fabric", fabric)
    if nodes > 1 and fabric is None:
        raise ConfigError(
            f"{where}.fabric: missing: nodes = {nodes} needs the fabric they share"
        )
    priority = _priority(f"{where}.priority", table.get("priority", 0))
    sleep = table.get("sleep", "off")
    if sleep not in SLEEP_LEVELS:
        raise ConfigError(
            f"{where}.sleep: expected one of {', '.join(SLEEP_LEVELS)}, got {sleep!r}"
        )
    if sleep != "off" and engine not in SLEEPING_ENGINES:
        raise ConfigError(
            f"{where}.sleep: engine {engine!r} has no sleep API"
            f" ({', '.join(SLEEPING_ENGINES)} do)"
        )
    keeps = _gb(f"{where}.sleep_gpu_memory_gb", table.get("sleep_gpu_memory_gb", 1.0))
    held = float(memory) * gpus if sleep == "weights" else 0.0
    held = _gb(f"{where}.sleep_host_memory_gb", table.get("sleep_host_memory_gb", held))
    return Profile(
        name=name,
        engine=engine,
        source=source,
        gpus=gpus,
        gpu_memory_gb=float(memory),
        nodes=nodes,
        fabric=fabric,
        priority=priority,
        args=tuple(args),
        env=tuple(sorted(env.items())),
        sleep=sleep,
        sleep_gpu_memory_gb=keeps,
        sleep_host_memory_gb=held,
    )


def _priority(where: str, value: object) -> int:
    if (
        isinstance(value, bool)
        or not isinstance(value, int)
        or not -1_000_000 <= value <= 1_000_000
    ):
        raise ConfigError(f"{where}: expected an integer, got {value!r}")
    return value


def _gb(where: str, value: object) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not 0 <= value <= 100_000
    ):
        raise ConfigError(f"{where}: expected GB >= 0, got {value!r}")
    return float(value)


def _model(where: str, table: object) -> Model:
    table, name, where = _named_table(where, table, MODELS_TABLE.names)
    aliases = table.get("aliases", [])
    if not isinstance(aliases, list):
        raise ConfigError(f"{where}.aliases: expected a list of names, got {aliases!r}")
    aliases = [_name(f"{where}.aliases", a) for a in aliases]
    low = _count(f"{where}.min_replicas", table.get("min_replicas", 0), 0)
    high = _count(f"{where}.max_replicas", table.get("max_replicas", max(low, 1)), 1)
    if low > high:
        raise ConfigError(
            f"{where}.min_replicas: {low} is more than max_replicas = {high}"
        )
    idle = parse_duration(f"{where}.idle_timeout", table.get("idle_timeout", "10m"))
    pinned = table.get("pinned", False)
    if not isinstance(pinned, bool):
        raise ConfigError(f"{where}.pinned: expected true or false, got {pinned!r}")
    priority = _priority(f"{where}.priority", table.get("priority", 0))
    resident = parse_duration(f"{where}.min_resident", table.get("min_resident", "5s"))
    profiles = table.get("profiles")
    if not isinstance(profiles, list) or not profiles:
        raise ConfigError(
            f"{where}.profiles: missing: add at least one [[models.profiles]]"
        )
    parsed = tuple(
        _profile(f"{where}.profiles[{i}]", p) for i, p in enumerate(profiles)
    )
    seen: set[str] = set()
    for profile in parsed:
        if profile.name in seen:
            raise ConfigError(f"{where}.profiles: duplicate name {profile.name!r}")
        seen.add(profile.name)
    return Model(
        name, tuple(aliases), low, high, idle, parsed, pinned, priority, resident
    )


def parse_models(tables: Any) -> tuple[Model, ...]:
    """
    Validate the C{models} array of a configuration file.

    @raise ConfigError: one line naming the model, profile, field and value;
        also for a name or alias used twice.
    """
    if not isinstance(tables, list):
        raise ConfigError(f"models: expected [[models]] tables, got {tables!r}")
    models = tuple(_model(f"models[{i}]", t) for i, t in enumerate(tables))
    owner: dict[str, str] = {}
    for model in models:
        for name in model.names:
            if name in owner:
                raise ConfigError(
                    f"models ({model.name}): name {name!r} is already"
                    f" model {owner[name]!r}"
                )
            owner[name] = model.name
    return models
