"""Dynamic worker sources for the gateway: :mod:`router.discovery.kubernetes` (pods by label
selector, list + watch) over the pure pod -> worker mapping of :mod:`router.discovery.pods`; the
config section is :mod:`router.discovery.config`. Importing this package imports no client."""
