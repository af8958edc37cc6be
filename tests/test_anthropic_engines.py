"""
Which replicas get Messages API requests as they are: the engine fact the
control plane publishes (L{llmgw.wire.engines.MESSAGES_ENGINES}), the
C{[[endpoints]]} key, and the router tier's watch carrying both.
"""

from __future__ import annotations

from dataclasses import replace

from twisted.trial.unittest import SynchronousTestCase

from llmgw.config_checks import ConfigError
from llmgw.control.placement import Profile
from llmgw.router.interfaces import Endpoint
from llmgw.router.settings_toml import parse_endpoint
from llmgw.tier.watch import endpoint_from_json, endpoint_json
from tests.plane_support import PlaneCase, make_model


class PublishedTests(PlaneCase):
    def test_vllm_replicas_serve_messages(self) -> None:
        """
        A ready replica of a vLLM profile is published as serving the
        Messages API; one of the simulator is not (it is translated for).
        """
        vllm = replace(
            make_model("v"),
            profiles=(
                Profile(
                    name="gpu", engine="vllm", source="s", gpus=1, gpu_memory_gb=10
                ),
            ),
        )
        self.make(vllm, make_model("s"))
        self.plane.reconcile()
        self.ready_all()
        self.plane.reconcile()
        self.assertEqual(
            sorted((e.models[0], e.messages) for e in self.published[-1]),
            [("s", False), ("v", True)],
        )


class StaticTests(SynchronousTestCase):
    def test_endpoints_key(self) -> None:
        """
        C{messages = true} marks a static replica as serving the API; it is
        off by default; another value is refused, named.
        """
        table = {"id": "e", "url": "http://h:1", "models": ["m"]}
        self.assertFalse(parse_endpoint("endpoints[0]", table).messages)
        self.assertTrue(
            parse_endpoint("endpoints[0]", {**table, "messages": True}).messages
        )
        with self.assertRaises(ConfigError) as caught:
            parse_endpoint("endpoints[0]", {**table, "messages": "yes"})
        self.assertIn("endpoints[0].messages", str(caught.exception))

    def test_watch_carries_it(self) -> None:
        """
        The watch a router tier follows carries the fact both ways.
        """
        endpoint = Endpoint("e", "http://h:1", ("m",), messages=True)
        self.assertEqual(endpoint_from_json(endpoint_json(endpoint)), endpoint)
        old = {"id": "e", "url": "http://h:1", "models": ["m"]}
        self.assertFalse(endpoint_from_json(old).messages)
