"""``uses``: the decorator that puts a worker's offloaded parts on the device for one call.

Apart from ``vlmrl.train.fsdp_options`` (which builds the offloaders) so that the worker classes import it
without importing FSDP: the driver imports those classes to start the workers.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from contextlib import ExitStack


def uses(*names: str) -> Callable:
    """Decorates a worker method: the worker's ``offloaders[name]`` parts are on the device during the call.

    Names the worker does not have (no critic in this run) are skipped.
    """

    def decorate(method: Callable) -> Callable:
        @functools.wraps(method)
        def call(self, *args, **kwargs):
            with ExitStack() as stack:
                for name in names:
                    if name in self.offloaders:
                        stack.enter_context(self.offloaders[name].on_device())
                return method(self, *args, **kwargs)

        return call

    return decorate
