"""
A stand-in for C{pynvml} in a real daemon (no GPU here): the folder holding
L{tests.fake_nvml.pynvml}, put first on a C{twistd llmgw-agent}'s
C{PYTHONPATH} by L{tests.support.fake_nvml_env}.
"""
