"""
The catalog: the models operators declare, as C{[[models]]} tables with
ordered C{[[models.profiles]]} (docs/catalog.md).  Validation errors
name the model, the profile, the field and the value.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
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
from llmgw.wire.engines import ENGINES, LORA_ENGINES, SLEEP_LEVELS, SLEEPING_ENGINES

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
            "Ways to run it, at least one (none for an adapter).",
        ),
        Key(
            "base",
            "string",
            "A LoRA adapter: the catalog model it runs on (no profiles then);"
            " its requests go to the base's replicas, which load it when needed.",
            None,
        ),
        Key(
            "adapter",
            "string",
            "With base: the adapter's path or hub id, as the engine's"
            " load_lora_adapter takes it.",
            None,
        ),
        Key(
            "rank",
            "integer, 1 to 1024",
            "With base: the adapter's LoRA rank, at most the base's max_lora_rank.",
            None,
        ),
        Key(
            "max_loras",
            "integer, 0 to 1024",
            "On a base: adapters its replicas keep loaded (vLLM --max-loras);"
            " the least recently used beyond it is unloaded.  LoRA is on"
            " (--enable-lora) when it is above 0.",
            shown="4 when adapters in the file name this model, else 0",
        ),
        Key(
            "max_lora_rank",
            "integer, 1 to 1024",
            "On a base: the largest adapter rank (vLLM --max-lora-rank).",
            16,
        ),
    ),
)

DEFAULT_MAX_LORAS = 4
"""
A base's C{max_loras} when adapters name it and it gives none.
"""

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
    @ivar base: for a LoRA adapter, the catalog model it runs on (it has
        no profiles); else L{None}.
    @ivar adapter: the adapter's path or hub id, with C{base}.
    @ivar rank: the adapter's rank, 0 when not given.
    @ivar max_loras: on a base, the adapters each replica keeps loaded;
        0: LoRA off.
    @ivar max_lora_rank: on a base, the largest rank.
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
    base: str | None = None
    adapter: str | None = None
    rank: int = 0
    max_loras: int = 0
    max_lora_rank: int = 16

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
    if "base" in table:
        return _adapter(where, table, name, tuple(aliases))
    for key in ("adapter", "rank"):
        if key in table:
            raise ConfigError(f"{where}.{key}: only for an adapter (with base)")
    loras = _small(f"{where}.max_loras", table.get("max_loras", -1), 0, -1)
    lora_rank = _small(f"{where}.max_lora_rank", table.get("max_lora_rank", 16), 1)
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
        name,
        tuple(aliases),
        low,
        high,
        idle,
        parsed,
        pinned,
        priority,
        resident,
        max_loras=loras,
        max_lora_rank=lora_rank,
    )


def _small(where: str, value: object, low: int, unset: int | None = None) -> int:
    if unset is not None and value == unset and not isinstance(value, bool):
        return unset
    if (
        isinstance(value, bool)
        or not isinstance(value, int)
        or not low <= value <= 1024
    ):
        raise ConfigError(
            f"{where}: expected an integer from {low} to 1024, got {value!r}"
        )
    return value


def _adapter(
    where: str, table: Mapping[str, Any], name: str, aliases: tuple[str, ...]
) -> Model:
    """
    A LoRA adapter's table: C{base}, C{adapter}, optional C{rank}; no
    profiles and no replica bounds (it runs on its base's replicas).
    """
    for key in (
        "profiles",
        "min_replicas",
        "max_replicas",
        "max_loras",
        "max_lora_rank",
    ):
        if key in table:
            raise ConfigError(
                f"{where}.{key}: an adapter (base = {table['base']!r}) runs on its"
                " base's replicas: remove it"
            )
    base = _name(f"{where}.base", table["base"])
    if base == name:
        raise ConfigError(f"{where}.base: the model itself")
    if "adapter" not in table:
        raise ConfigError(f"{where}.adapter: missing: the adapter's path or hub id")
    source = _name(f"{where}.adapter", table["adapter"])
    rank = _small(f"{where}.rank", table.get("rank", 0), 1, 0)
    return Model(name, aliases, 0, 1, 0.0, (), base=base, adapter=source, rank=rank)


def lora_flags(model: Model) -> tuple[tuple[str, ...], tuple[tuple[str, str], ...]]:
    """
    @return: the arguments and environment a LoRA base's engine starts
        with: C{--enable-lora --max-loras N --max-lora-rank R} and
        C{VLLM_ALLOW_RUNTIME_LORA_UPDATING=True} (vLLM's; the simulator
        takes the same); nothing when C{max_loras} is 0.
    """
    if model.max_loras <= 0:
        return (), ()
    args = ("--enable-lora", "--max-loras", str(model.max_loras)) + (
        "--max-lora-rank",
        str(model.max_lora_rank),
    )
    return args, (("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True"),)


def check_adapter(adapter: Model, base: Model | None) -> None:
    """
    @raise ConfigError: C{base} (the model C{adapter.base} names) is
        missing, an adapter itself, not LoRA-enabled, not run by an engine
        that loads adapters, or its C{max_lora_rank} is below the rank.
    """
    where = f"models ({adapter.name}).base"
    if base is None:
        raise ConfigError(f"{where}: no model {adapter.base!r}")
    if base.base is not None:
        raise ConfigError(f"{where}: {base.name!r} is an adapter itself")
    if base.max_loras <= 0:
        raise ConfigError(
            f"{where}: {base.name!r} has max_loras = 0: set it above 0 to load adapters"
        )
    other = [p.name for p in base.profiles if p.engine not in LORA_ENGINES]
    if other:
        raise ConfigError(
            f"{where}: {base.name!r} profiles {', '.join(other)} run engines that"
            f" load no adapters (only {', '.join(LORA_ENGINES)})"
        )
    if adapter.rank > base.max_lora_rank:
        raise ConfigError(
            f"models ({adapter.name}).rank: {adapter.rank} is above"
            f" {base.name!r}'s max_lora_rank = {base.max_lora_rank}"
        )


def _with_lora(model: Model, named: bool) -> Model:
    """
    C{model} with its C{max_loras} settled (L{DEFAULT_MAX_LORAS} when
    adapters name it and it gave none) and, on a LoRA base, the LoRA
    flags before each profile's args (which may override them).
    """
    loras = model.max_loras
    if loras < 0:
        loras = DEFAULT_MAX_LORAS if named else 0
    model = replace(model, max_loras=loras)
    args, env = lora_flags(model)
    if not args:
        return model
    profiles = tuple(
        replace(
            p,
            args=(*args, *p.args),
            env=tuple(sorted({**dict(env), **dict(p.env)}.items())),
        )
        for p in model.profiles
    )
    return replace(model, profiles=profiles)


def parse_models(tables: Any, check_bases: bool = True) -> tuple[Model, ...]:
    """
    Validate the C{models} array of a configuration file.

    @param check_bases: check each adapter's base among these models (not for a
        model added at run time: L{llmgw.control.runtime} checks it).

    @raise ConfigError: one line naming the model, profile, field and value;
        also for a name or alias used twice, and an adapter whose base is
        missing or cannot load it (L{check_adapter}).
    """
    if not isinstance(tables, list):
        raise ConfigError(f"models: expected [[models]] tables, got {tables!r}")
    models = tuple(_model(f"models[{i}]", t) for i, t in enumerate(tables))
    bases = {m.base for m in models if m.base is not None}
    models = tuple(
        m if m.base is not None else _with_lora(m, m.name in bases) for m in models
    )
    by_name = {m.name: m for m in models}
    for model in models:
        if model.base is not None and check_bases:
            check_adapter(model, by_name.get(model.base))
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
