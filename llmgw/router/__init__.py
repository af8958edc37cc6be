"""
The data plane: the OpenAI API in front of engine replicas, and the interfaces
(L{llmgw.router.interfaces}) the control plane, keys and store implement.

Its modules live in rooms by the path a request takes (docs/architecture.md,
"The router's rooms"): C{edge}, C{api}, C{routing}, C{upstream},
C{accounting} and C{telemetry}; here, at its top, what they and other
packages share: C{interfaces}, C{settings}, C{settings_toml} and C{errors}.
"""
