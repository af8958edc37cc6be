"""
The client API's resource with the Files and Batches APIs: the router's
routes, and L{llmgw.router.api.batch_api.BatchAPI} on the store, built
alike by the server and by each router of a tier (they share the store, so
a file uploaded through one is read through any).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorThreads
from twisted.internet.threads import deferToThreadPool
from twisted.web.resource import IResource

from llmgw.batches.kept import StoreBatches, StoreFiles
from llmgw.batches.settings import BatchesConfig
from llmgw.router.api.app import Router
from llmgw.router.api.batch_api import BatchAPI, WithBatches
from llmgw.router.api.batch_routes import BatchRoutes
from llmgw.router.api.file_routes import FileRoutes
from llmgw.router.api.message_batches import MessageBatchRoutes
from llmgw.router.interfaces import Auth
from llmgw.store.base import Store

T = TypeVar("T")


def with_batches(
    reactor: IReactorThreads,
    router: Router,
    store: Store,
    auth: Auth | None,
    resolve: Callable[[str], str | None],
    settings: BatchesConfig,
) -> IResource:
    """
    @param router: the client API's router: its routes, and what models
        it serves (L{Router.knows}).
    @param auth: the keys the router checks.
    @param resolve: a name's catalog model (a key allowed a model may use
        its aliases).
    @param settings: C{[batches]}.
    @return: the router's resource, with the Files and Batches APIs' paths
        served by a L{BatchAPI} on C{store}; an input file is checked on
        the reactor's thread pool.
    """
    pool = reactor.getThreadPool()

    def offload(work: Callable[[], T]) -> Deferred[T]:
        return deferToThreadPool(reactor, pool, work)

    files = StoreFiles(store)
    batches = StoreBatches(store)
    api = BatchAPI(
        FileRoutes(files, auth, settings.max_file_size, time.time),
        BatchRoutes(
            batches,
            files,
            auth,
            resolve,
            router.knows,
            settings.max_lines,
            time.time,
            offload,
        ),
        MessageBatchRoutes(
            batches, auth, resolve, router.knows, settings.max_lines, time.time
        ),
    )
    return WithBatches(router.resource(), api.resource())


__all__ = ["with_batches"]
