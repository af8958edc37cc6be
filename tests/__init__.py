"""
llmgw's tests (trial).  Hypothesis runs every property test without its
per-example deadline and its too-slow health check: this suite runs two
trial workers on two cores, often beside other jobs, where an example's
time says nothing of the code (a slow example is not a wrong one, and a
parser's result is checked, not its speed; bench/ measures speed).
"""

from hypothesis import HealthCheck, settings

settings.register_profile(
    "llmgw", deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile("llmgw")
