"""Dynamic worker sources for the gateway: :mod:`router.workers.discovery.kubernetes` (pods by label
selector, list + watch) over the pure pod -> worker mapping of :mod:`router.workers.discovery.pods`; the
config section is :mod:`router.config.discovery`. Importing this package imports no client."""
