"""
What a GPU costs, the C{[cost]} table of the server's configuration
(docs/cost.md): a price per GPU-hour for each GPU model, by the name its
agent reports (NVML's C{nvmlDeviceGetName}, as C{GpuInfo.name} carries
it), and per node where a node's price differs.  Read here, beside the
control plane's meter (L{llmgw.control.meter}) that prices every second a
GPU is held.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from llmgw.config_checks import (
    ConfigError,
    Kind,
    Table,
    setting,
    settings_keys,
    spelled,
)

ANY_GPU = "*"
"""
The name in a price table that stands for every GPU model it does not
name.
"""


@dataclass(frozen=True)
class GpuPrice:
    """
    One price of C{[cost] gpu_hour}.

    @ivar gpu: the GPU model name it is for, or L{ANY_GPU}.
    @ivar node: the node id it is for, or C{""} for every node.
    @ivar price: per GPU-hour, 0 or more.
    """

    gpu: str
    node: str
    price: float


_ENTRY = 'a table {gpu = "NAME" or "*", price = N, node = "ID" (optional)}'


@dataclass(frozen=True)
class PriceList(Kind[tuple[GpuPrice, ...]]):
    """
    A list of prices per GPU-hour, each for a GPU model (or every model,
    C{"*"}), on every node or on one.
    """

    @property
    def words(self) -> str:
        return 'list of {gpu = "NAME" or "*", price = N, node = "ID"}'

    def read(self, where: str, value: object) -> tuple[GpuPrice, ...]:
        if not isinstance(value, list):
            raise ConfigError(
                f"{where}: expected a list of prices, got {spelled(value)}"
            )
        return tuple(_entry(f"{where}[{i}]", item) for i, item in enumerate(value))


def _entry(where: str, item: object) -> GpuPrice:
    """
    @return: one price of the list.
    @raise ConfigError: not such a table, naming the entry and the key.
    """
    if not isinstance(item, dict):
        raise ConfigError(f"{where}: expected {_ENTRY}, got {spelled(item)}")
    unknown = sorted(set(item) - {"gpu", "price", "node"})
    if unknown:
        raise ConfigError(f"{where}: unknown key {unknown[0]!r}: expected {_ENTRY}")
    gpu, node, price = item.get("gpu"), item.get("node", ""), item.get("price")
    if not isinstance(gpu, str) or not gpu:
        raise ConfigError(
            f'{where}.gpu: expected a GPU model name or "*", got {spelled(gpu)}'
        )
    if not isinstance(node, str):
        raise ConfigError(f"{where}.node: expected a node id, got {spelled(node)}")
    if (
        isinstance(price, bool)
        or not isinstance(price, (int, float))
        or not math.isfinite(price)
        or price < 0
    ):
        raise ConfigError(
            f"{where}.price: expected a price per GPU-hour of 0 or more,"
            f" got {spelled(price)}"
        )
    return GpuPrice(gpu, node, float(price))


@dataclass(frozen=True)
class CostConfig:
    """
    The C{[cost]} table.
    """

    gpu_hour: tuple[GpuPrice, ...] = setting(
        (),
        PriceList(),
        "The price of one GPU for an hour, by the GPU model name its agent"
        ' reports (llmgw ctl nodes shows it), "*" for every model not named;'
        " with node, on that node only, over the prices of every node. A GPU"
        " no price names costs 0.",
        shown="none",
    )


COST_TABLE = Table(
    "[cost]",
    "What GPUs cost, for the cost of each request and the fleet's idle cost"
    " (docs/cost.md).",
    settings_keys(CostConfig),
)


def parse_cost(table: object) -> CostConfig:
    """
    @return: the C{[cost]} table's settings.
    @raise ConfigError: an unknown key or a bad value, named.
    """
    return CostConfig(**COST_TABLE.read(table))


@dataclass(frozen=True)
class Prices:
    """
    The price of each GPU, by node and GPU model.

    @ivar config: the C{[cost]} table.
    """

    config: CostConfig = field(default_factory=CostConfig)

    def per_hour(self, node: str, gpu: str) -> float:
        """
        @param node: the node's id.
        @param gpu: the GPU's model name, as its agent reports it.
        @return: its price per GPU-hour: the node's own for that model,
            else the node's C{"*"}, else every node's for that model, else
            every node's C{"*"}, else 0 (of two alike, the last written).
        """
        best: tuple[int, float] = (0, 0.0)
        for entry in self.config.gpu_hour:
            if entry.node not in ("", node) or entry.gpu not in (ANY_GPU, gpu):
                continue
            rank = 1 + (entry.gpu == gpu) + 2 * (entry.node == node)
            if rank >= best[0]:
                best = (rank, entry.price)
        return best[1]
