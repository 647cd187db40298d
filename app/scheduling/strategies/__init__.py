"""Routing strategies, one module each; `app.scheduling.routing` holds their interface and registry.

The strategy modules import their shared types from `app.scheduling.routing`, which imports the
strategy modules at its end to build the registry. Importing routing here, before any strategy
module runs, makes that cycle resolve the same way whichever module a caller imports first.
"""

from app.scheduling import routing as _routing  # noqa: F401
