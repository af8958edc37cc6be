"""
The data plane: the OpenAI API in front of engine replicas, and the interfaces
(L{llmgw.router.interfaces}) the control plane, keys and store implement.
"""
