"""
L{llmgw.router.telemetry.metrics.MetricsRegistry} and L{RouterMetrics.refresh}: the
scrape of llmgw's registry without C{_created} samples (and only its own),
and labelled children made at 0 for what became known.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from twisted.trial.unittest import SynchronousTestCase

from llmgw.router.telemetry.metrics import MetricsRegistry, RouterMetrics


def scrape(
    registry: CollectorRegistry,
) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = generate_latest(registry).decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


class MetricsRegistryTests(SynchronousTestCase):
    def test_no_created(self) -> None:
        """
        Counters, histograms with children and unlabelled counters have no
        C{_created} sample in llmgw's registry; a plain registry of the
        same process keeps its own (the setting is per registry).
        """
        registry = MetricsRegistry()
        metrics = RouterMetrics(registry)
        metrics.finished("m", 200, 0.5, 0.1, 3, 4)
        plain = CollectorRegistry()
        Counter("other_things", "Things.", registry=plain).inc()
        ours = generate_latest(registry).decode()
        self.assertNotIn("_created", ours)
        self.assertIn('llmgw_requests_total{model="m",status="200"} 1.0', ours)
        self.assertIn('llmgw_time_to_first_token_seconds_count{model="m"} 1.0', ours)
        self.assertIn("other_things_created", generate_latest(plain).decode())

    def test_hooks_before_each_scrape(self) -> None:
        """
        Each hook runs once at the start of each scrape.
        """
        registry = MetricsRegistry()
        calls: list[int] = []
        registry.before_scrape(lambda: calls.append(1))
        generate_latest(registry)
        generate_latest(registry)
        self.assertEqual(calls, [1, 1])


class RefreshTests(SynchronousTestCase):
    def test_known_models_and_replicas_at_zero(self) -> None:
        """
        A model and a replica that became known have their counters at 0
        at the next scrape; a replica gone loses its ejection series; a
        model's counts go on where its 0 was.
        """
        registry = MetricsRegistry()
        metrics = RouterMetrics(registry)
        models = ["a"]
        replicas = ["r1", "r2"]
        metrics.follow(lambda: models, lambda: replicas)
        found = scrape(registry)
        for status in ("200", "429", "502", "503", "504"):
            key = (("model", "a"), ("status", status))
            self.assertEqual(found[("llmgw_requests_total", key)], 0)
        self.assertEqual(found[("llmgw_retries_total", (("model", "a"),))], 0)
        self.assertEqual(
            found[("llmgw_tokens_total", (("kind", "prompt"), ("model", "a")))], 0
        )
        self.assertEqual(
            found[("llmgw_request_duration_seconds_count", (("model", "a"),))], 0
        )
        for outcome in ("owner", "spilled"):
            key = (("model", "a"), ("outcome", outcome))
            self.assertEqual(found[("llmgw_router_affinity_total", key)], 0)
        for outcome in ("waited", "refused"):
            key = (("model", "a"), ("outcome", outcome))
            self.assertEqual(found[("llmgw_overload_total", key)], 0)
        for kind in ("connect", "timeout", "status", "broken"):
            kind_key = (("kind", kind),)
            self.assertEqual(found[("llmgw_upstream_errors_total", kind_key)], 0)
        ejections = {
            labels for name, labels in found if name == "llmgw_replica_ejections_total"
        }
        self.assertEqual(ejections, {(("replica", "r1"),), (("replica", "r2"),)})

        metrics.finished("a", 200, 0.1, None, 1, 1)
        models.append("b")
        replicas.remove("r1")
        found = scrape(registry)
        key = (("model", "a"), ("status", "200"))
        self.assertEqual(found[("llmgw_requests_total", key)], 1)
        key = (("model", "b"), ("status", "200"))
        self.assertEqual(found[("llmgw_requests_total", key)], 0)
        ejections = {
            labels for name, labels in found if name == "llmgw_replica_ejections_total"
        }
        self.assertEqual(ejections, {(("replica", "r2"),)})

    def test_plain_registry_not_followed(self) -> None:
        """
        On a plain registry (unit tests' own) nothing is made before the
        first event, as before: only the fixed upstream error kinds.
        """
        registry = CollectorRegistry()
        metrics = RouterMetrics(registry)
        metrics.follow(lambda: ["a"], lambda: ["r1"])
        names = {name for name, _ in scrape(registry)}
        self.assertNotIn("llmgw_requests_total", names)
        self.assertIn("llmgw_upstream_errors_total", names)


class BatchTokensTests(SynchronousTestCase):
    def test_batch_lines_tokens_counted_apart(self) -> None:
        """
        C{llmgw_batch_tokens_total} exists at 0 for each known model and
        both kinds from the first scrape; a batch line's tokens count there
        and in C{llmgw_tokens_total}, a client's own request's only in
        C{llmgw_tokens_total}; a name no model has counts in neither.
        """
        registry = MetricsRegistry()
        metrics = RouterMetrics(registry)
        metrics.follow(lambda: ["a"], lambda: ())
        found = scrape(registry)
        for kind in ("prompt", "completion"):
            key = (("kind", kind), ("model", "a"))
            self.assertEqual(found[("llmgw_batch_tokens_total", key)], 0)
        metrics.finished("a", 200, 0.1, None, 3, 5, batch=True)
        metrics.finished("a", 200, 0.1, None, 7, 11)
        metrics.finished(None, 200, 0.1, None, 13, 17, batch=True)
        found = scrape(registry)
        batch = {
            dict(labels)["kind"]: value
            for (name, labels), value in found.items()
            if name == "llmgw_batch_tokens_total"
        }
        self.assertEqual(batch, {"prompt": 3, "completion": 5})
        prompt = (("kind", "prompt"), ("model", "a"))
        self.assertEqual(found[("llmgw_tokens_total", prompt)], 10)

    def test_reported_by_a_tier(self) -> None:
        """
        The batch tokens are among the families a router of a tier
        reports to its server.
        """
        metrics = RouterMetrics(MetricsRegistry())
        self.assertIn(metrics.batch_tokens, metrics.collectors())
