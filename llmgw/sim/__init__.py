"""
C{llmgw sim}: a stand-alone fake engine that speaks the OpenAI API and
vLLM's metrics, for tests, benchmarks and a fleet without GPUs.
"""
