"""lmcache-rc inside vLLM: the connector package.

Laid out like vLLM's own connectors: a thin role/mode dispatch
(:mod:`.connector`), the scheduler sides of the two modes
(:mod:`.upstream` for stock vLLM 0.33, :mod:`.boundary` for the fork's
boundary checkpoints) on shared pieces (:mod:`.common`), the worker side
(:mod:`.worker`, with :mod:`.layout` for upstream page regions), the
scheduler ⇄ worker metadata (:mod:`.metadata`), the sidecar client wrapper
(:mod:`.sidecar`), options (:mod:`.options`), identity (:mod:`.identity`)
and the Protocols naming every vLLM object touched (:mod:`.api`).

Users configure the class path ``lmcache_rc.connector:LMCacheRecurrentCheckpointConnector``
(that module names this package's connector and nothing else). Nothing here imports vLLM
or torch at import time.
"""
