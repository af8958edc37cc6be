"""
The catalog: the models operators declare, as C{[[models]]} tables with
ordered C{[[models.profiles]]} (docs/catalog.md).

Each key of a model (L{MODELS_TABLE}) and of a profile (L{PROFILES_TABLE})
is declared once, with the kind that checks it and says it in the
reference, and read by L{llmgw.config_checks.Table.read} like every other
table; what a table's keys must agree on (a gang's fabric, an adapter's
keys, unique profile names) is its table's check, after the read; what
the models say of each other (an adapter's base, names used twice, the
LoRA flags of a base) is L{parse_models}'s, after them all.  Errors name
the model, the profile, the key and the value: C{models[0] (chat).profiles[1]
(h100).gpus: ...}.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from llmgw.config_checks import (
    BOOLEAN,
    DURATION,
    ArrayOfTables,
    Choice,
    ConfigError,
    Integer,
    Key,
    ListOf,
    Number,
    StringTable,
    Table,
    Text,
    spelled,
)
from llmgw.control.placement import Profile
from llmgw.wire.engines import ENGINES, LORA_ENGINES, SLEEP_LEVELS, SLEEPING_ENGINES

MAX_COUNT = 10_000
"""
The largest replica, GPU or node count a model may ask for.
"""

DEFAULT_MAX_LORAS = 4
"""
A base's C{max_loras} when adapters name it and it gives none.
"""

_UNSETTLED = -1
"""
A base's C{max_loras} as its table leaves it, until L{parse_models} knows
whether adapters name it (L{_with_lora}).
"""

_NAME = re.compile(r"(?s)(?=.*\S).{1,200}")


def _named(shape: str) -> Text:
    """
    @return: the kind of a name or a path: 1 to 200 characters, not all
        blank; C{shape} says what it names.
    """
    return Text(f"{shape} (1 to 200 characters, not blank)", pattern=_NAME)


NAME = _named("name")
"""
A model's, a profile's, a fabric's or an alias's name.
"""

PRIORITY = Integer(-1_000_000, 1_000_000)
"""
A model's or a profile's priority.
"""

LORA = Integer(1, 1024)
"""
An adapter's rank, a base's largest rank.
"""

GB = Number(least=0, most=100_000, unit="GB")
"""
Memory, GB of 1024 MiB.
"""


@dataclass(frozen=True)
class Engine(Choice):
    """
    One of the engines the agent can launch (L{ENGINES}), refused as the
    agent refuses another, naming those it knows.
    """

    def read(self, where: str, value: object) -> str:
        if not isinstance(value, str) or value not in self.choices:
            raise ConfigError(
                f"{where}: unknown {spelled(value)} (known: {', '.join(self.choices)})"
            )
        return value


@dataclass(frozen=True)
class Environment(StringTable):
    """
    A profile's C{env}: strings by variable name, a name neither empty nor
    holding C{=} (which would end it early in the engine's environment).
    """

    @property
    def words(self) -> str:
        return 'table of strings, names without "="'

    def read(self, where: str, value: object) -> dict[str, str]:
        env = super().read(where, value)
        if not all(name and "=" not in name for name in env):
            raise ConfigError(
                f'{where}: expected a table of strings, names without "=",'
                f" got {spelled(value)}"
            )
        return env


def _check_profile(
    where: str, table: Mapping[str, Any], values: dict[str, Any]
) -> None:
    """
    What a profile's keys must agree on: memory only with GPUs, a gang's
    fabric, sleep only where the engine can.

    @raise ConfigError: naming the key.
    """
    if values["gpu_memory_gb"] and not values["gpus"]:
        raise ConfigError(
            f"{where}.gpu_memory_gb: {spelled(table['gpu_memory_gb'])} with"
            " gpus = 0 (a CPU profile)"
        )
    shape = (values["gpus"], values["nodes"], bool(values["gpu_memory_gb"]))
    if values["share_gpu"] and shape != (1, 1, True):
        raise ConfigError(f"{where}.share_gpu: only with gpus = 1, nodes = 1, memory")
    if values["nodes"] > 1 and values["fabric"] is None:
        raise ConfigError(
            f"{where}.fabric: missing: nodes = {values['nodes']} needs the fabric"
            " they share"
        )
    if values["sleep"] != "off" and values["engine"] not in SLEEPING_ENGINES:
        raise ConfigError(
            f"{where}.sleep: engine {spelled(values['engine'])} has no sleep API"
            f" ({', '.join(SLEEPING_ENGINES)} do)"
        )


PROFILES_TABLE = Table(
    "[[models.profiles]]",
    "Ways to run a model, tried by priority (highest first), then in order:"
    " placement picks the first that fits.",
    (
        Key("name", NAME, "The profile's name, unique within its model."),
        Key("engine", Engine(ENGINES), "The engine that runs it."),
        Key(
            "source",
            _named("hub id or path"),
            "Hub id or local path the engine understands.",
        ),
        Key(
            "args",
            ListOf(Text(empty=True), "list of strings"),
            "More arguments for the engine.",
            (),
        ),
        Key(
            "env",
            Environment(),
            "More environment variables for the engine.",
            {},
        ),
        Key("gpus", Integer(0, MAX_COUNT), "GPUs per node (0: the CPU).", 0),
        Key(
            "gpu_memory_gb",
            GB,
            "Free memory needed on each of those GPUs (GB of 1024 MiB); only"
            " with gpus.",
            0,
        ),
        Key(
            "nodes",
            Integer(1, MAX_COUNT),
            "Nodes per replica: more than 1 is a gang; rank, world size and"
            " leader address go to the engine.",
            1,
        ),
        Key(
            "fabric",
            NAME,
            "The interconnect a gang's nodes must share (an agent's fabrics);"
            " needed with nodes > 1.",
            None,
        ),
        Key("priority", PRIORITY, "Higher is tried first.", 0),
        Key(
            "sleep",
            Choice(tuple(SLEEP_LEVELS)),
            "An idle replica sleeps instead of stopping (vLLM sleep level 1 keeps"
            " the weights in host memory, level 2 discards them; SGLang's memory"
            " saver); engines vllm, sglang and sim only.",
            "off",
        ),
        Key(
            "sleep_gpu_memory_gb",
            GB,
            "GPU memory a sleeping engine keeps on each of its GPUs.",
            1.0,
        ),
        Key(
            "share_gpu",
            BOOLEAN,
            "Share a GPU where gpu_memory_gb fits (gpus = 1, nodes = 1 only).",
            False,
        ),
        Key(
            "sleep_host_memory_gb",
            GB,
            "Host memory a sleeping replica holds on each node, counted against"
            " the agent's sleep_memory.",
            None,
            shown='gpu_memory_gb * gpus for "weights", 0 for "discard"',
        ),
    ),
    named_by="name",
    check=_check_profile,
)


def _profile(values: dict[str, Any]) -> Profile:
    """
    @return: the profile of one C{[[models.profiles]]} table's values.
    """
    memory = float(values["gpu_memory_gb"])
    held = values["sleep_host_memory_gb"]
    if held is None:
        held = memory * values["gpus"] if values["sleep"] == "weights" else 0.0
    return Profile(
        name=values["name"],
        engine=values["engine"],
        source=values["source"],
        gpus=values["gpus"],
        gpu_memory_gb=memory,
        nodes=values["nodes"],
        fabric=values["fabric"],
        priority=values["priority"],
        args=tuple(values["args"]),
        env=tuple(sorted(values["env"].items())),
        sleep=values["sleep"],
        sleep_gpu_memory_gb=values["sleep_gpu_memory_gb"],
        sleep_host_memory_gb=float(held),
        share_gpu=values["share_gpu"],
    )


_ADAPTER_KEYS = ("adapter", "rank")
"""
The keys only an adapter (a model with C{base}) takes.
"""

_BASE_KEYS = ("profiles", "min_replicas", "max_replicas", "max_loras", "max_lora_rank")
"""
The keys an adapter does not take: it runs on its base's replicas.
"""


def _check_model(where: str, table: Mapping[str, Any], values: dict[str, Any]) -> None:
    """
    What a model's keys must agree on: an adapter's against a model's,
    the replica bounds, at least one profile and their names unique.

    @raise ConfigError: naming the key.
    """
    if values["base"] is not None:
        for key in _BASE_KEYS:
            if key in table:
                raise ConfigError(
                    f"{where}.{key}: an adapter (base = {spelled(values['base'])})"
                    " runs on its base's replicas: remove it"
                )
        if values["base"] == values["name"]:
            raise ConfigError(f"{where}.base: the model itself")
        if values["adapter"] is None:
            raise ConfigError(f"{where}.adapter: missing: the adapter's path or hub id")
        return
    for key in _ADAPTER_KEYS:
        if key in table:
            raise ConfigError(f"{where}.{key}: only for an adapter (with base)")
    low, high = values["min_replicas"], values["max_replicas"]
    if high is not None and low > high:
        raise ConfigError(
            f"{where}.min_replicas: {low} is more than max_replicas = {high}"
        )
    if not values["profiles"]:
        raise ConfigError(
            f"{where}.profiles: missing: add at least one [[models.profiles]]"
        )
    seen: set[str] = set()
    for profile in values["profiles"]:
        if profile.name in seen:
            raise ConfigError(
                f"{where}.profiles: duplicate name {spelled(profile.name)}"
            )
        seen.add(profile.name)


MODELS_TABLE = Table(
    "[[models]]",
    "The catalog: each model clients may ask for, kept running by the control"
    " plane on the nodes whose agents are connected.",
    (
        Key(
            "name",
            NAME,
            'What clients send as "model"; the engine\'s served name.',
        ),
        Key(
            "aliases",
            ListOf(NAME, "list of names"),
            "Other names clients may send.",
            (),
        ),
        Key(
            "min_replicas",
            Integer(0, MAX_COUNT),
            "Replicas always running (0: started by the first request).",
            0,
        ),
        Key(
            "max_replicas",
            Integer(1, MAX_COUNT),
            "Replicas at most, more while busy (see [control] scale_up_in_flight).",
            None,
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
            BOOLEAN,
            "Never stopped or put to sleep to make room for another model.",
            False,
        ),
        Key(
            "priority",
            PRIORITY,
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
            ArrayOfTables(PROFILES_TABLE, _profile),
            "Ways to run it, at least one (none for an adapter).",
            None,
            shown="required",
        ),
        Key(
            "base",
            NAME,
            "A LoRA adapter: the catalog model it runs on (no profiles then);"
            " its requests go to the base's replicas, which load it when needed.",
            None,
        ),
        Key(
            "adapter",
            _named("path or hub id"),
            "With base: the adapter's path or hub id, as the engine's"
            " load_lora_adapter takes it.",
            None,
        ),
        Key(
            "rank",
            LORA,
            "With base: the adapter's LoRA rank, at most the base's max_lora_rank.",
            None,
        ),
        Key(
            "max_loras",
            Integer(0, 1024),
            "On a base: adapters its replicas keep loaded (vLLM --max-loras);"
            " never passed: the least recently used idle one is unloaded"
            " first, or the load waits for one to be idle.  LoRA is on"
            " (--enable-lora) when it is above 0.",
            None,
            shown="4 when adapters in the file name this model, else 0",
        ),
        Key(
            "max_lora_rank",
            LORA,
            "On a base: the largest adapter rank (vLLM --max-lora-rank).",
            16,
        ),
    ),
    named_by="name",
    check=_check_model,
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


def _model(values: dict[str, Any]) -> Model:
    """
    @return: the model of one C{[[models]]} table's values: an adapter
        (its base's replicas run it: no bounds, no profiles of its own),
        or a model whose C{max_loras}, when not given, is settled by
        L{parse_models}.
    """
    name, aliases = values["name"], tuple(values["aliases"])
    if values["base"] is not None:
        return Model(
            name,
            aliases,
            0,
            1,
            0.0,
            (),
            base=values["base"],
            adapter=values["adapter"],
            rank=values["rank"] or 0,
        )
    low, high = values["min_replicas"], values["max_replicas"]
    loras = values["max_loras"]
    return Model(
        name,
        aliases,
        low,
        max(low, 1) if high is None else high,
        values["idle_timeout"],
        values["profiles"],
        values["pinned"],
        values["priority"],
        values["min_resident"],
        max_loras=_UNSETTLED if loras is None else loras,
        max_lora_rank=values["max_lora_rank"],
    )


MODELS = ArrayOfTables(MODELS_TABLE, _model)
"""
The C{[[models]]} array, read into L{Model}s as their tables give them
(L{parse_models} settles what the models say of each other).
"""


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
    if loras == _UNSETTLED:
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
    models = MODELS.read("models", tables)
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
