"""
Configuration parsing and validation.
"""

from __future__ import annotations

import re
from typing import Any

from twisted.trial.unittest import SynchronousTestCase

from llmgw.config import (
    ServerConfig,
    finish_config,
    parse_config,
    parse_endpoint_flag,
)
from llmgw.config_checks import ConfigError, check_keys, parse_duration, parse_size
from llmgw.server.local import parse_simulated_gpus, simulated_catalog


class ConfigTests(SynchronousTestCase):
    def test_durations(self) -> None:
        """
        Durations take ms, s, m and h, or plain seconds; a bad one is named
        with its key and its value as TOML writes it (C{true}, not Python's
        C{True}).
        """
        self.assertEqual(parse_duration("k", "250ms"), 0.25)
        self.assertEqual(parse_duration("k", "5s"), 5.0)
        self.assertEqual(parse_duration("k", "2m"), 120.0)
        self.assertEqual(parse_duration("k", "1h"), 3600.0)
        self.assertEqual(parse_duration("k", 3), 3.0)
        for bad, shown in [
            ("5", "'5'"),
            ("5x", "'5x'"),
            ("-1s", "'-1s'"),
            ("", "''"),
            (True, "true"),
            ([1], "[1]"),
        ]:
            with self.assertRaises(ConfigError) as raised:
                parse_duration("router.idle_timeout", bad)
            self.assertIn("router.idle_timeout", str(raised.exception))
            self.assertIn(f"duration {shown}:", str(raised.exception))

    def test_sizes(self) -> None:
        """
        Sizes take bytes or a unit.
        """
        self.assertEqual(parse_size("k", "32MiB"), 32 * 1024 * 1024)
        self.assertEqual(parse_size("k", 100), 100)
        self.assertEqual(parse_size("k", "4KB"), 4000)
        for bad in ("32 potatoes", 0, -1, "0B"):
            self.assertRaises(ConfigError, parse_size, "k", bad)

    def test_full(self) -> None:
        """
        A complete file parses into the settings it names.
        """
        config = parse_config(
            {
                "listen": "tcp:8000",
                "router": {"connect_timeout": "1s", "max_retries": 4},
                "endpoints": [
                    {"id": "a", "url": "http://h:1/", "models": ["m", "n"], "weight": 2}
                ],
            }
        )
        self.assertEqual(config.listen, "tcp:8000")
        self.assertEqual(config.admin_listen, ServerConfig().admin_listen)
        self.assertEqual(config.router.connect_timeout, 1.0)
        self.assertEqual(config.router.max_retries, 4)
        self.assertEqual(config.router.first_byte_timeout, 300.0)
        (endpoint,) = config.endpoints
        self.assertEqual(
            (endpoint.url, endpoint.models, endpoint.weight),
            ("http://h:1", ("m", "n"), 2.0),
        )

    def test_errors_name_key_and_value(self) -> None:
        """
        Each kind of mistake names where it is and what was given.
        """
        cases: list[tuple[dict[str, Any], str]] = [
            ({"lissen": "x"}, "lissen: unknown key"),
            ({"router": {"retries": 1}}, "router.retries: unknown key"),
            (
                {"tracing": {"otlp_endpoint": "collector:4318"}},
                "tracing.otlp_endpoint: bad URL 'collector:4318'",
            ),
            (
                {"tracing": {"sample_ratio": 1.5}},
                "tracing.sample_ratio: expected a number from 0 to 1, got 1.5",
            ),
            ({"tracing": {"endpoint": "x"}}, "tracing.endpoint: unknown key"),
            (
                {"endpoints": [{"id": "a", "models": ["m"]}]},
                "endpoints[0].url: missing",
            ),
            (
                {"endpoints": [{"id": "a", "url": "localhost:80", "models": ["m"]}]},
                "endpoints[0].url: bad URL 'localhost:80'",
            ),
            (
                {"endpoints": [{"id": "a", "url": "http://h", "models": []}]},
                "endpoints[0].models",
            ),
            (
                {
                    "endpoints": [
                        {"id": "a", "url": "http://h", "models": ["m"], "weight": 0}
                    ]
                },
                "endpoints[0].weight",
            ),
            ({"router": {"max_retries": -1}}, "router.max_retries"),
            (
                {"router": {"load_poll_interval": "10ms"}},
                "router.load_poll_interval: under the least",
            ),
            (
                {"log_format": "xml"},
                "log_format: expected one of text, json, got 'xml'",
            ),
            ({"metrics_listen": ""}, "metrics_listen: expected a non-empty string"),
            ({"limits": {"url": "http://r:6379"}}, "limits.url: bad URL"),
            ({"limits": {"url": "redis://:x"}}, "limits.url: bad URL"),
            ({"limits": {"routers": 0}}, "limits.routers: expected a whole number"),
            ({"limits": {"routers": True}}, "limits.routers: expected a whole number"),
            ({"limits": {"size": 1}}, "limits"),
            (
                {"control": {"swap_in_use": "10s", "swap_max_wait": "0s"}},
                "control.swap_in_use: 10s needs swap_max_wait over 0s",
            ),
        ]
        for data, message in cases:
            with self.assertRaises(ConfigError) as raised:
                parse_config(data)
            self.assertIn(message, str(raised.exception))
            self.assertNotIn("\n", str(raised.exception))

    def test_edge_keys(self) -> None:
        """
        The connection edge's keys parse with their units, and bounds that
        would refuse every client are a one-line error naming the key.
        """
        router = parse_config(
            {
                "router": {
                    "header_timeout": "5s",
                    "min_body_rate": "2KiB",
                    "body_rate_window": "3s",
                    "keepalive_timeout": "0s",
                    "max_request_line": "8KiB",
                    "max_header_size": "64KiB",
                    "max_connections": 100,
                    "max_connections_per_client": 0,
                }
            }
        ).router
        self.assertEqual(
            (
                router.header_timeout,
                router.min_body_rate,
                router.body_rate_window,
                router.keepalive_timeout,
                router.max_request_line,
                router.max_header_size,
                router.max_connections,
                router.max_connections_per_client,
            ),
            (5.0, 2048, 3.0, 0.0, 8192, 65536, 100, 0),
        )
        for table, message in [
            ({"max_request_line": 100}, "router.max_request_line: under the least"),
            ({"max_header_size": "1000B"}, "router.max_header_size: under the least"),
            ({"body_rate_window": "0s"}, "router.body_rate_window: under the least"),
            ({"max_connections": -1}, "router.max_connections"),
        ]:
            with self.assertRaises(ConfigError) as raised:
                parse_config({"router": table})
            self.assertIn(message, str(raised.exception))
        # No body rate: no window needed.
        parse_config({"router": {"min_body_rate": 0, "body_rate_window": "0s"}})

    def test_metrics_and_logs(self) -> None:
        """
        C{metrics_listen}, C{log_format} and C{[router] load_poll_interval}
        are read; a poll interval of 0 turns polling off.
        """
        config = parse_config(
            {
                "metrics_listen": "tcp:9091",
                "log_format": "json",
                "router": {"load_poll_interval": "0s"},
            }
        )
        self.assertEqual(config.metrics_listen, "tcp:9091")
        self.assertEqual(config.log_format, "json")
        self.assertEqual(config.router.load_poll_interval, 0.0)
        default = parse_config({})
        self.assertEqual(
            (
                default.metrics_listen,
                default.log_format,
                default.router.load_poll_interval,
            ),
            ("", "text", 1.0),
        )

    def test_endpoint_flag(self) -> None:
        """
        --endpoint id=URL=model[,model], with = allowed inside the URL.
        """
        endpoint = parse_endpoint_flag("a=http://h:1/x?y=1=m1,m2".replace("?y=1", ""))
        self.assertEqual(
            (endpoint.id, endpoint.url, endpoint.models),
            ("a", "http://h:1/x", ("m1", "m2")),
        )
        for bad in ("a", "a=http://h", "=http://h=m", "a=notaurl=m"):
            self.assertRaises(ConfigError, parse_endpoint_flag, bad)

    def test_finish(self) -> None:
        """
        Duplicate ids and an empty endpoint list are refused.
        """
        with self.assertRaises(ConfigError) as raised:
            finish_config(ServerConfig())
        self.assertIn("nothing to serve", str(raised.exception))
        twice = parse_config(
            {"endpoints": [{"id": "a", "url": "http://h", "models": ["m"]}] * 2}
        )
        self.assertRaises(ConfigError, finish_config, twice)


class UnknownKeyTests(SynchronousTestCase):
    def test_one_message_for_every_table(self) -> None:
        """
        The server's file, its nested tables, the catalog's models and
        profiles and the agent's file all name an unknown key the same
        way: where it is, then the keys known there.
        """
        from llmgw.agent.settings import parse_agent_config as parse_agent
        from llmgw.control.catalog import parse_models

        profile = {"name": "p", "engine": "sim", "source": "s"}
        cases: list[tuple[Any, object, str]] = [
            (parse_config, {"colour": 1}, "colour"),
            (parse_config, {"store": {"colour": 1}}, "store.colour"),
            (parse_config, {"control": {"colour": 1}}, "control.colour"),
            (
                parse_models,
                [{"name": "m", "colour": 1, "profiles": [profile]}],
                "models[0] (m).colour",
            ),
            (
                parse_models,
                [{"name": "m", "profiles": [{**profile, "colour": 1}]}],
                "models[0] (m).profiles[0] (p).colour",
            ),
            (parse_agent, {"colour": 1}, "colour"),
            (
                parse_agent,
                {"simulated_gpus": [{"name": "g", "memory_gb": 1, "colour": 1}]},
                "simulated_gpus[0].colour",
            ),
        ]
        for parse, data, where in cases:
            with self.assertRaises(ConfigError) as raised:
                parse(data)
            message = str(raised.exception)
            self.assertRegex(
                message, rf"^{re.escape(where)}: unknown key \(known: [a-z_, ]+\)$"
            )

    def test_known_keys_sorted(self) -> None:
        """
        The known keys are listed sorted, whatever order they came in.
        """
        with self.assertRaises(ConfigError) as raised:
            check_keys("t", {"z": 1}, ["b", "a"])
        self.assertEqual(str(raised.exception), "t.z: unknown key (known: a, b)")
        check_keys("", {"a": 1, "b": 2}, ("a", "b"))


class CorsConfigTests(SynchronousTestCase):
    def test_allow_origins(self) -> None:
        """
        C{[cors] allow_origins} is C{"*"} or a list of origins (lower case);
        without the table, no origin; anything else is one line naming the
        key and the value.
        """
        self.assertEqual(parse_config({}).router.cors_allow_origins, ())
        for value, expected in [
            ("*", ("*",)),
            ([], ()),
            (
                ["https://App.example.com", "http://127.0.0.1:3000"],
                ("https://app.example.com", "http://127.0.0.1:3000"),
            ),
        ]:
            config = parse_config(
                {"router": {"idle_timeout": "5s"}, "cors": {"allow_origins": value}}
            )
            self.assertEqual(config.router.cors_allow_origins, expected)
            self.assertEqual(config.router.idle_timeout, 5.0)
        for bad in (
            "https://app.example.com",
            ["https://app.example.com/"],
            ["app.example.com"],
            ["*"],
            ["https://a.example/path"],
            [3],
            True,
        ):
            with self.assertRaises(ConfigError) as raised:
                parse_config({"cors": {"allow_origins": bad}})
            message = str(raised.exception)
            self.assertTrue(message.startswith("cors.allow_origins: "), message)
            self.assertNotIn("\n", message)
        with self.assertRaises(ConfigError) as raised:
            parse_config({"cors": {"origins": "*"}})
        self.assertIn("cors.origins: unknown key", str(raised.exception))


class LimitsConfigTests(SynchronousTestCase):
    def test_limits(self) -> None:
        """
        [limits] url (Redis) and routers; by default neither.
        """
        default = parse_config({})
        self.assertEqual((default.limits_url, default.limits_routers), ("", 1))
        config = parse_config({"limits": {"url": "redis://r:6379/2", "routers": 3}})
        self.assertEqual(
            (config.limits_url, config.limits_routers), ("redis://r:6379/2", 3)
        )


class RoutingConfigTests(SynchronousTestCase):
    def test_routing_keys(self) -> None:
        """
        The routing keys of C{[router]} parse into the settings.
        """
        router = parse_config(
            {
                "router": {
                    "balance": "round_robin",
                    "prefix_affinity": False,
                    "prefix_bytes": "2KiB",
                    "prefix_min_tokens": 100,
                    "affinity_epsilon": 0.5,
                    "session_header": "X-Conversation",
                    "eject_after": 3,
                    "eject_base_cooldown": "2s",
                    "overload_queue_depth": 8,
                    "overload_wait": "0s",
                    "overload_queue_size": 10,
                }
            }
        ).router
        self.assertEqual(
            (router.balance, router.prefix_affinity, router.prefix_bytes),
            ("round_robin", False, 2048),
        )
        self.assertEqual(
            (router.prefix_min_tokens, router.affinity_epsilon), (100, 0.5)
        )
        self.assertEqual(router.session_header, "X-Conversation")
        self.assertEqual((router.eject_after, router.eject_base_cooldown), (3, 2.0))
        self.assertEqual(
            (
                router.overload_queue_depth,
                router.overload_wait,
                router.overload_queue_size,
            ),
            (8, 0.0, 10),
        )

    def test_routing_errors(self) -> None:
        """
        Bad routing values name the key and the value.
        """
        cases = [
            ({"balance": "random"}, "router.balance: expected one of"),
            ({"prefix_affinity": "yes"}, "router.prefix_affinity: expected true"),
            ({"affinity_epsilon": -1}, "router.affinity_epsilon: expected a number"),
            (
                {"session_header": "X Session"},
                "router.session_header: expected a header",
            ),
            (
                {"overload_queue_size": 0},
                "router.overload_queue_size: expected a whole number of at least 1",
            ),
            ({"eject_after": -2}, "router.eject_after: expected a non-negative"),
        ]
        for table, message in cases:
            with self.assertRaises(ConfigError) as raised:
                parse_config({"router": table})
            self.assertIn(message, str(raised.exception))


class SimulatedGpusTests(SynchronousTestCase):
    """
    C{llmgw-server --local --simulated-gpus COUNTxGB[,COUNTxGB]}.
    """

    def test_read(self) -> None:
        """
        Groups joined by commas, the unit optional, one GPU per count.
        """
        self.assertEqual(
            parse_simulated_gpus("1x80GB, 2x24"),
            (("sim-80GB", 80.0), ("sim-24GB", 24.0), ("sim-24GB", 24.0)),
        )

    def test_refused(self) -> None:
        """
        Another shape, no GPU, more than 64, or a size out of the agent's
        range: one line naming the flag.
        """
        for spec, text in (
            ("two", "expected COUNTxGB"),
            ("2x24GiB", "expected COUNTxGB"),
            ("0x24GB", "makes 0 GPUs"),
            ("65x1GB", "makes 65 GPUs"),
            ("1x0GB", "memory over 0"),
            ("1x2000000GB", "at most 1000000 GB"),
        ):
            with self.assertRaises(ConfigError) as raised:
                parse_simulated_gpus(spec)
            self.assertIn("--simulated-gpus", str(raised.exception))
            self.assertIn(text, str(raised.exception))

    def test_only_with_local(self) -> None:
        """
        Without --local there is no agent in the server to report them.
        """
        config = ServerConfig(insecure_agents=True, simulated_gpus=(("g", 8.0),))
        with self.assertRaises(ConfigError) as raised:
            finish_config(config)
        self.assertIn("--simulated-gpus: only with --local", str(raised.exception))

    def test_catalog(self) -> None:
        """
        One model more than there are GPUs, each taking three quarters of
        the smallest GPU, so no two share one; every other one sleeps.
        """
        models = simulated_catalog(parse_simulated_gpus("1x80GB,1x24GB"))
        self.assertEqual([m.name for m in models], ["sim-1", "sim-2", "sim-3"])
        self.assertEqual(
            [(m.profiles[0].gpu_memory_gb, m.profiles[0].sleep) for m in models],
            [(18.0, "off"), (18.0, "weights"), (18.0, "off")],
        )
