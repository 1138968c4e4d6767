"""DESIGN steps 2-7, the route step: admission, prompt token ids and block keys, the index lookup and
the policy's decision (:mod:`router.route.planner`), the dispatch queue and the decision log."""
