"""
LoRA adapters loaded at run time, as vLLM's (C{--enable-lora} with
C{VLLM_ALLOW_RUNTIME_LORA_UPDATING=True} in its environment; vLLM 0.32's
C{vllm/entrypoints/openai/models/serving.py} and
C{entrypoints/serve/lora/api_router.py}):

    - C{POST /v1/load_lora_adapter} C{{"lora_name": N, "lora_path": P}}:
      200 with C{Success: LoRA adapter 'N' added successfully.} (plain
      text); 400 when a name or path is missing, the name is a served base
      model, or it is already loaded (without C{load_inplace}).
    - C{POST /v1/unload_lora_adapter} C{{"lora_name": N}}: 200; 400 without
      a name, 404 when it is not loaded.
    - C{GET /v1/models} lists each loaded adapter as a model card with
      C{root} its path and C{parent} the base model's name.

A load beyond C{--max-loras} is not refused, in vLLM as here: C{max_loras}
is how many adapters one batch may use on the GPU (vLLM 0.32's scheduler,
C{vllm/v1/core/sched/scheduler.py}, leaves a request of a further adapter
waiting rather than batch past it), and the adapters loaded are kept on
the CPU in an LRU cache of C{--max-cpu-loras} (C{vllm/lora/worker_manager.py},
C{LRUCacheWorkerLoRAManager.add_adapter}: the oldest evicted from the
cache, to be read again from its path when used), while the API server's
list, C{/v1/models}, keeps every adapter loaded and not unloaded.  So an
engine "holding" more than C{max_loras} is what its list shows, and the
simulator keeps the most it listed at once (C{GET /sim/stats}
C{lora_most_loaded}) for a test to check the router never passes it.

The simulator reads no weights: an adapter is a name, a path and a load
count (C{GET /sim/stats} C{lora_loads}, so that a test sees an adapter
loaded twice on one replica).  vLLM serves the routes only when the
environment variable is true; so does the simulator.  A load takes
C{--lora-load-seconds}.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field


class LoraError(Exception):
    """
    A load or unload refused: the HTTP status, vLLM's message, its error
    type and the field (L{llmgw.sim.web} answers it as an OpenAI error).
    """

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param


ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


@dataclass(frozen=True, slots=True)
class LoraConfig:
    """
    @ivar enabled: C{--enable-lora}.
    @ivar runtime: the load and unload routes are served (the
        environment variable L{ENV} is C{True} or C{1}).
    @ivar max_loras: C{--max-loras}, adapters in one batch (vLLM's; the
        simulator does not batch by adapter and only reports it).
    @ivar max_lora_rank: C{--max-lora-rank}.
    @ivar load_seconds: seconds a load takes.
    """

    enabled: bool = False
    runtime: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    load_seconds: float = 0.0


@dataclass(slots=True)
class Adapters:
    """
    The adapters loaded, by name, with their paths, in load order.

    @ivar loads: loads accepted per name since the start (not reset).
    @ivar load_requests: load requests per name, refused ones too.
    @ivar most_loaded: the most adapters loaded at once since the start.
    """

    base: str
    loaded: dict[str, str] = field(default_factory=dict)
    loads: dict[str, int] = field(default_factory=dict)
    load_requests: dict[str, int] = field(default_factory=dict)
    most_loaded: int = 0

    def load(self, body: Mapping[str, object], base_models: frozenset[str]) -> str:
        """
        @param body: the request's JSON object.
        @return: vLLM's plain-text success message.
        @raise LoraError: 400 as vLLM's checks (the name's field named).
        """
        name, path = body.get("lora_name"), body.get("lora_path")
        asked = str(name)
        self.load_requests[asked] = self.load_requests.get(asked, 0) + 1
        if (
            not isinstance(name, str)
            or not name
            or not isinstance(path, str)
            or not path
        ):
            raise LoraError(
                400,
                "Both 'lora_name' and 'lora_path' must be provided.",
                param="lora_name",
            )
        if name in base_models:
            raise LoraError(
                400,
                f"The lora adapter '{name}' conflicts with a served base model.",
                param="lora_name",
            )
        if name in self.loaded and body.get("load_inplace") is not True:
            raise LoraError(
                400,
                f"The lora adapter '{name}' has already been loaded. If you want"
                " to load the adapter in place, set 'load_inplace' to True.",
                param="lora_name",
            )
        self.loaded[name] = path
        self.loads[name] = self.loads.get(name, 0) + 1
        self.most_loaded = max(self.most_loaded, len(self.loaded))
        return f"Success: LoRA adapter '{name}' added successfully."

    def unload(self, body: Mapping[str, object]) -> str:
        """
        @return: vLLM's plain-text success message.
        @raise LoraError: 400 without a name, 404 for one not loaded.
        """
        name = body.get("lora_name")
        if not isinstance(name, str) or not name:
            raise LoraError(
                400,
                "'lora_name' needs to be provided to unload a LoRA adapter.",
                param="lora_name",
            )
        if name not in self.loaded:
            raise LoraError(
                404,
                f"The lora adapter '{name}' cannot be found.",
                type="NotFoundError",
                param="lora_name",
            )
        del self.loaded[name]
        return f"Success: LoRA adapter '{name}' removed successfully."

    def cards(self, created: int) -> list[dict[str, object]]:
        """
        @return: C{/v1/models} entries for the loaded adapters, as vLLM's.
        """
        return [
            {
                "id": name,
                "object": "model",
                "created": created,
                "owned_by": "llmgw-sim",
                "root": path,
                "parent": self.base,
            }
            for name, path in self.loaded.items()
        ]
