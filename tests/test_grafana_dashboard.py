"""The Grafana dashboard ``deploy/grafana/kvroute.json`` is well formed and every metric its
PromQL names really exists.

Every expression (panel targets and template-variable queries) is parsed into the metric names
it selects (functions, aggregations with ``by (...)``, label matchers, range selectors, Grafana
variables stripped). Each name must be a series of a family that is really exported, by either

- the gateway: a real ``kvroute serve`` (embedded KV-event ingestion) in front of one real
  ``kvroute sim`` worker that publishes KV events, after two identical streamed requests (the
  second a prefix hit), so the labelled series exist; its ``/metrics`` is scraped; or
- vLLM: ``tests/fixtures/vllm-0.32-metrics.txt``, one ``/metrics`` scrape of a real vLLM 0.32.0
  CPU server (how it was captured is in the file's header comment).

``_bucket``/``_sum``/``_count`` resolve to a histogram family, ``_total`` to a counter family.
Label matchers in selectors must name labels the family's series carry (``instance`` and
``job``, which Prometheus adds when it scrapes, excepted).
"""
from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import FIXTURES, Proc, free_ports, kvroute_argv, serve_gateway, wait_http, wait_until

REPO = Path(__file__).resolve().parents[1]
DASHBOARD_PATH = REPO / "deploy" / "grafana" / "kvroute.json"
VLLM_METRICS_PATH = FIXTURES / "vllm-0.32-metrics.txt"
BLOCK_SIZE_TOKENS = 32
SCRAPE_LABELS = {"instance", "job"}  # added by Prometheus at scrape time, not in any exposition
PROMPT = " ".join(["the gateway routes each prompt to the worker that holds its prefix"] * 30)

# every family here must be plotted by at least one panel (the dashboard's reason to exist)
REQUIRED_FAMILIES = {
    "TTFT": {"kvroute_ttft_seconds", "vllm:time_to_first_token_seconds"},
    "prefix-hit rate": {"kvroute_actual_cached_tokens", "vllm:prefix_cache_hits", "vllm:prefix_cache_queries"},
    "prediction error": {"kvroute_predicted_cached_tokens", "kvroute_cached_tokens_error_tokens",
                         "kvroute_ttft_prediction_ratio"},
    "routing decisions": {"kvroute_route_decisions"},
    "tier blocks": {"kvroute_worker_blocks"},
    "worker load": {"kvroute_in_flight", "vllm:num_requests_running", "vllm:num_requests_waiting",
                    "vllm:kv_cache_usage_perc"},
    "dispatch queue": {"kvroute_dispatch_queue_wait_seconds", "kvroute_dispatch_queue_queued"},
    "KV events": {"kvroute_worker_events_age_seconds", "kvroute_worker_event_gaps"},
}

# ---- PromQL: the metric names an expression selects --------------------------------------------

_TOKEN_RE = re.compile(r"""
    (?P<ws>\s+)
  | (?P<str>"(?:\\.|[^"\\])*"|'(?:\\.|[^'\\])*'|`[^`]*`)
  | (?P<var>\$\{[^}]*\}|\$\w+|\[\[\w+\]\])
  | (?P<num>0[xX][0-9a-fA-F]+|(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?(?:ms|[smhdwy])*)
  | (?P<ident>[A-Za-z_:][A-Za-z0-9_:]*)
  | (?P<op>==|!=|<=|>=|=~|!~|[-+*/%^<>=(){}\[\],@])
""", re.VERBOSE)
_GROUPING = {"by", "without", "on", "ignoring", "group_left", "group_right"}  # followed by a label list
_KEYWORDS = {"and", "or", "unless", "bool", "offset", "atan2", "inf", "nan"}
_AGGREGATIONS = {"sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values",
                 "bottomk", "topk", "quantile", "limitk", "limit_ratio"}
_MATCH_OPS = {("op", "="), ("op", "!="), ("op", "=~"), ("op", "!~")}
_LABEL_VALUES_RE = re.compile(r"^\s*label_values\(\s*(?P<selector>.+?)\s*,\s*[A-Za-z_]\w*\s*\)\s*$")


@dataclass(frozen=True)
class Selector:
    """One vector selector of an expression: the metric name and the label names it matches on."""

    metric: str
    labels: frozenset[str] = field(default_factory=frozenset)


def _tokens(expr: str) -> list[tuple[str, str]]:
    """``(kind, text)`` tokens of ``expr``, whitespace dropped. Raises ValueError on a character
    no PromQL token starts with."""
    out, pos = [], 0
    while pos < len(expr):
        m = _TOKEN_RE.match(expr, pos)
        if m is None:
            raise ValueError(f"cannot parse PromQL at {pos}: {expr[pos:pos + 30]!r} in {expr!r}")
        if m.lastgroup != "ws":
            out.append((m.lastgroup, m.group()))
        pos = m.end()
    return out


def _closing(toks: list[tuple[str, str]], i: int, open_: str, close: str, expr: str) -> int:
    """Index of the token closing the ``open_`` at ``toks[i]``. Raises ValueError when unbalanced."""
    depth = 0
    for j in range(i, len(toks)):
        if toks[j] == ("op", open_):
            depth += 1
        elif toks[j] == ("op", close):
            depth -= 1
            if depth == 0:
                return j
    raise ValueError(f"unbalanced {open_!r} in {expr!r}")


def promql_selectors(expr: str) -> list[Selector]:
    """The vector selectors of the PromQL ``expr`` (Grafana variables such as ``$worker`` and
    ``$__rate_interval`` allowed), in order. Function and aggregation names, ``by (...)``-style
    label lists, label matchers, range selectors, durations, numbers and strings are not metric
    names; a selector written ``{__name__="m"}`` counts as ``m``. Raises ValueError on unbalanced
    brackets or a character PromQL has no token for."""
    toks = _tokens(expr)
    out: list[Selector] = []
    i = 0
    while i < len(toks):
        kind, text = toks[i]
        if (kind, text) == ("op", "["):
            i = _closing(toks, i, "[", "]", expr) + 1
            continue
        if (kind, text) == ("op", "{"):  # a selector without a metric name before the braces
            end = _closing(toks, i, "{", "}", expr)
            labels, name = _matchers(toks[i + 1:end])
            if name is not None:
                out.append(Selector(name, labels))
            i = end + 1
            continue
        if kind != "ident":
            i += 1
            continue
        nxt = toks[i + 1] if i + 1 < len(toks) else ("", "")
        low = text.lower()
        if low in _GROUPING and nxt == ("op", "("):
            i = _closing(toks, i + 1, "(", ")", expr) + 1
        elif low in _KEYWORDS or low in _AGGREGATIONS or nxt == ("op", "("):
            i += 1  # an operator keyword, an aggregation or a function call
        elif nxt == ("op", "{"):
            end = _closing(toks, i + 1, "{", "}", expr)
            out.append(Selector(text, _matchers(toks[i + 2:end])[0]))
            i = end + 1
        else:
            out.append(Selector(text))
            i += 1
    for open_, close in (("(", ")"), ("[", "]"), ("{", "}")):
        if sum(t == ("op", open_) for t in toks) != sum(t == ("op", close) for t in toks):
            raise ValueError(f"unbalanced {open_!r} in {expr!r}")
    return out


def _matchers(toks: list[tuple[str, str]]) -> tuple[frozenset[str], str | None]:
    """Label names of the matchers between a selector's braces, and the ``__name__`` it
    matches exactly (None when it does not)."""
    labels, name = set(), None
    for j, (kind, text) in enumerate(toks):
        if kind == "ident" and j + 1 < len(toks) and toks[j + 1] in _MATCH_OPS:
            if text == "__name__":
                if toks[j + 1][1] == "=" and j + 2 < len(toks) and toks[j + 2][0] == "str":
                    name = toks[j + 2][1][1:-1]
            else:
                labels.add(text)
    return frozenset(labels), name


def variable_query_selectors(query: str) -> list[Selector]:
    """Selectors of a Grafana Prometheus variable query: ``label_values(SELECTOR, label)`` gives
    its selector; ``label_values(label)`` (no metric) gives none; anything else is PromQL."""
    m = _LABEL_VALUES_RE.match(query)
    if m is not None:
        return promql_selectors(m.group("selector"))
    if re.match(r"^\s*label_values\(\s*[A-Za-z_]\w*\s*\)\s*$", query):
        return []
    return promql_selectors(query)


# ---- exposition: which series exist -------------------------------------------------------------

@dataclass
class Family:
    """One exported metric family: its type and the label names its samples carry."""

    type: str
    source: str
    labels: set[str] = field(default_factory=set)
    has_samples: bool = False


def exported_families(exposition: str, source: str) -> dict[str, Family]:
    """``{family name: Family}`` of one Prometheus text exposition (counter names without
    ``_total``, as prometheus-client's parser gives them); ``source`` names where it came from.
    Raises ValueError on text that is not the Prometheus format."""
    out: dict[str, Family] = {}
    for fam in text_string_to_metric_families(exposition):
        entry = out.setdefault(fam.name, Family(fam.type, source))
        for sample in fam.samples:
            entry.has_samples = True
            entry.labels.update(k for k in sample.labels if k not in ("le", "quantile"))
    return out


def resolve(metric: str, families: dict[str, Family]) -> str | None:
    """The family whose series ``metric`` names, or None when no exported family has it:
    ``X_bucket`` of a histogram ``X``; ``X_sum``/``X_count`` of a histogram or summary ``X``;
    ``X_total`` of a counter ``X``; a gauge, untyped or summary family by its own name."""
    for suffix, types in (("_bucket", {"histogram", "gaugehistogram"}), ("_sum", {"histogram", "summary"}),
                          ("_count", {"histogram", "summary"}), ("_total", {"counter"}), ("_info", {"info"})):
        base = metric[: -len(suffix)]
        if metric.endswith(suffix) and base in families and families[base].type in types:
            return base
    if metric in families and families[metric].type in ("gauge", "untyped", "unknown", "summary", "stateset"):
        return metric
    return None


def unknown_selectors(dashboard: dict, families: dict[str, Family]) -> list[str]:
    """One message per selector of ``dashboard`` naming a metric no family in ``families``
    exports, or a label its family's series do not carry; empty when every one is real."""
    problems = []
    for where, expr, selectors in dashboard_selectors(dashboard):
        for sel in selectors:
            fam_name = resolve(sel.metric, families)
            if fam_name is None:
                problems.append(f"{where}: unknown metric {sel.metric!r} in {expr!r}")
                continue
            fam = families[fam_name]
            missing = sel.labels - fam.labels - SCRAPE_LABELS
            if fam.has_samples and missing:
                problems.append(f"{where}: {sel.metric!r} has no label(s) {sorted(missing)} "
                                f"(its series carry {sorted(fam.labels)}) in {expr!r}")
    return problems


# ---- the dashboard --------------------------------------------------------------------------------

def load_dashboard(path: Path = DASHBOARD_PATH) -> dict:
    """The dashboard JSON at ``path`` as a dict. Raises ValueError if it is not JSON."""
    return json.loads(path.read_text())


def leaf_panels(dashboard: dict) -> Iterator[dict]:
    """Every panel, those inside (collapsed) rows included, rows themselves included."""
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels", [])


def dashboard_selectors(dashboard: dict) -> Iterator[tuple[str, str, list[Selector]]]:
    """``(where, expression, selectors)`` for every panel target and Prometheus query variable."""
    for panel in leaf_panels(dashboard):
        for target in panel.get("targets", []):
            yield f"panel {panel['title']!r} target {target['refId']}", target["expr"], promql_selectors(target["expr"])
    for var in dashboard["templating"]["list"]:
        if var["type"] == "query":
            query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
            yield f"variable {var['name']!r}", query, variable_query_selectors(query)


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return load_dashboard()


@pytest.fixture(scope="module")
def vllm_families() -> dict[str, Family]:
    return exported_families(VLLM_METRICS_PATH.read_text(), "vLLM 0.32 fixture")


def _series(text: str) -> dict[tuple[str, frozenset], float]:
    return {(s.name, frozenset(s.labels.items())): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def _value(series: dict, name: str, **labels: str) -> float:
    return series.get((name, frozenset(labels.items())), 0.0)


@pytest.fixture(scope="module")
def gateway_exposition(tmp_path_factory, tiny_model) -> str:
    """``/metrics`` of a real gateway (embedded KV events, ttft policy with the dispatch queue)
    in front of one real ``kvroute sim`` worker ``w0``, after the same streamed prompt twice."""
    log_dir = tmp_path_factory.mktemp("grafana-gateway")
    sim_port, events_port, replay_port, gw_port = free_ports(4)
    started: list[Proc] = []
    try:
        events_cfg = {"enable_kv_cache_events": True, "publisher": "zmq", "topic": "kv",
                      "endpoint": f"tcp://*:{events_port}", "replay_endpoint": f"tcp://*:{replay_port}"}
        sim = Proc("sim", kvroute_argv("sim", "--model", str(tiny_model), "--served-model-name", "tiny",
                                       "--host", "127.0.0.1", "--port", str(sim_port),
                                       "--block-size", str(BLOCK_SIZE_TOKENS), "--num-gpu-blocks-override", "512",
                                       "--enable-prompt-tokens-details", "--speedup", "20",
                                       "--kv-events-config", json.dumps(events_cfg)), log_dir)
        started.append(sim)
        wait_http(f"http://127.0.0.1:{sim_port}/health", sim, timeout_s=180)
        cfg = {"listen": {"host": "127.0.0.1", "port": gw_port}, "admin": {"token_env": "KVROUTE_ADMIN_TOKEN"},
               "models": [{"name": "tiny", "tokenizer": str(tiny_model), "block_size": BLOCK_SIZE_TOKENS}],
               "index": {"backend": "memory"},
               "workers": [{"id": "w0", "url": f"http://127.0.0.1:{sim_port}", "model": "tiny",
                            "events": f"tcp://127.0.0.1:{events_port}", "replay": f"tcp://127.0.0.1:{replay_port}"}],
               "policy": {"name": "ttft", "queue": {"enabled": True}},
               "health": {"interval_s": 0.2}, "load_scrape": {"interval_s": 0.5}}
        base, _, _ = serve_gateway(cfg, log_dir, started)
        wait_until(lambda: _value(_series(httpx.get(base + "/metrics", timeout=10).text),
                                  "kvroute_worker_healthy", worker="w0") == 1, timeout_s=30, what="w0 healthy")
        body = {"model": "tiny", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 4,
                "stream": True, "stream_options": {"include_usage": True}}
        for n in (1, 2):
            with httpx.stream("POST", base + "/v1/chat/completions", json=body, timeout=60) as r:
                assert r.status_code == 200 and r.headers["x-kvroute-worker"] == "w0"
                assert r.read().rstrip().endswith(b"data: [DONE]")
            # the first prompt's blocks reach the index as KV events before the second is routed
            if n == 1:
                wait_until(lambda: _value(_series(httpx.get(base + "/metrics", timeout=10).text),
                                          "kvroute_worker_blocks", worker="w0", tier="gpu") > 0,
                           timeout_s=30, what="w0's KV events in the index")

        def scraped() -> str | None:
            text = httpx.get(base + "/metrics", timeout=10).text
            s = _series(text)
            done = (_value(s, "kvroute_requests_total", worker="w0", status="200") == 2
                    and _value(s, "kvroute_actual_cached_tokens_count", worker="w0") == 2)
            return text if done else None

        return wait_until(scraped, timeout_s=30, what="both requests in the gateway's metrics")
    finally:
        for p in reversed(started):
            p.stop()


@pytest.fixture(scope="module")
def gateway_families(gateway_exposition) -> dict[str, Family]:
    return exported_families(gateway_exposition, "gateway /metrics")


# ---- tests -------------------------------------------------------------------------------------------

def test_promql_parser_finds_metric_names_only():
    sels = promql_selectors(
        'histogram_quantile(0.99, sum by (le, worker) (rate(kvroute_ttft_seconds_bucket{worker=~"$worker",'
        'status!="5.."}[$__rate_interval] offset 5m)))'
        ' / on (worker) group_left (model) max without (instance) (vllm:kv_cache_usage_perc)'
        ' > bool 0.5e3 and {__name__="kvroute_in_flight", worker="w0"} unless topk(3, kvroute_requests_total)')
    assert sels == [Selector("kvroute_ttft_seconds_bucket", frozenset({"worker", "status"})),
                    Selector("vllm:kv_cache_usage_perc"),
                    Selector("kvroute_in_flight", frozenset({"worker"})),
                    Selector("kvroute_requests_total")]
    assert variable_query_selectors("label_values(vllm:num_requests_running{model_name=\"tiny\"}, instance)") == [
        Selector("vllm:num_requests_running", frozenset({"model_name"}))]
    assert variable_query_selectors("label_values(worker)") == []
    with pytest.raises(ValueError, match="unbalanced"):
        promql_selectors("sum(rate(kvroute_requests_total[5m])")


def test_resolve_maps_suffixes_to_families(vllm_families):
    fams = {"h": Family("histogram", "t"), "c": Family("counter", "t"), "g": Family("gauge", "t")}
    assert [resolve(m, fams) for m in ("h_bucket", "h_sum", "h_count", "c_total", "g")] == ["h", "h", "h", "c", "g"]
    # a histogram's or counter's bare family name has no series in Prometheus; nor has a gauge + suffix
    assert [resolve(m, fams) for m in ("h", "c", "c_bucket", "g_total", "nope")] == [None] * 5
    assert resolve("vllm:time_to_first_token_seconds_bucket", vllm_families) == "vllm:time_to_first_token_seconds"
    assert resolve("vllm:prefix_cache_hits_total", vllm_families) == "vllm:prefix_cache_hits"


def test_dashboard_shape(dashboard):
    assert 36 <= dashboard["schemaVersion"] <= 41
    assert dashboard["uid"] and dashboard["title"]
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert variables["worker"]["type"] == "query"
    panels = list(leaf_panels(dashboard))
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), f"duplicate panel ids: {sorted(i for i in ids if ids.count(i) > 1)}"
    graphs = [p for p in panels if p["type"] != "row"]
    assert len(graphs) >= 20
    for p in panels:
        gp = p["gridPos"]
        assert {"x", "y", "w", "h"} <= set(gp) and 0 <= gp["x"] and gp["x"] + gp["w"] <= 24 and gp["h"] > 0, p["title"]
    for p in graphs:
        assert p["title"] and p.get("description"), f"panel {p['id']} needs a title and a description"
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        assert p["targets"], f"panel {p['title']!r} has no targets"
        ref_ids = [t["refId"] for t in p["targets"]]
        assert len(ref_ids) == len(set(ref_ids)), p["title"]
        for t in p["targets"]:
            assert t["expr"].strip() and t["datasource"]["uid"] == "${datasource}", (p["title"], t)
    # panels of one row never overlap
    cells = set()
    for p in panels:
        gp = p["gridPos"]
        mine = {(x, y) for x in range(gp["x"], gp["x"] + gp["w"]) for y in range(gp["y"], gp["y"] + gp["h"])}
        assert not cells & mine, f"panel {p['title']!r} overlaps another"
        cells |= mine


def test_every_metric_is_exported_by_the_gateway_or_vllm(dashboard, gateway_families, vllm_families):
    assert gateway_families and all(n.startswith("kvroute_") for n in gateway_families)
    families = {**vllm_families, **gateway_families}
    problems = unknown_selectors(dashboard, families)
    assert not problems, "the dashboard uses metrics nobody exports:\n" + "\n".join(problems)
    # kvroute_* names are the gateway's, vllm:* the engine's: a panel never mixes them up
    for where, expr, selectors in dashboard_selectors(dashboard):
        for sel in selectors:
            want = "gateway /metrics" if sel.metric.startswith("kvroute_") else "vLLM 0.32 fixture"
            assert families[resolve(sel.metric, families)].source == want, (where, sel)


def test_a_made_up_metric_is_reported_by_name(dashboard, gateway_families, vllm_families):
    families = {**vllm_families, **gateway_families}
    bogus = json.loads(json.dumps(dashboard))
    graph = next(p for p in leaf_panels(bogus) if p["type"] != "row")
    graph["targets"].append({"refId": "Z", "expr": 'sum(rate(kvroute_made_up_requests_total{worker="w0"}[5m]))',
                             "datasource": graph["datasource"]})
    graph["targets"].append({"refId": "Y", "expr": 'kvroute_in_flight{tier="gpu"}', "datasource": graph["datasource"]})
    before = set(unknown_selectors(dashboard, families))
    problems = [msg for msg in unknown_selectors(bogus, families) if msg not in before]
    assert len(problems) == 2, problems
    assert "unknown metric 'kvroute_made_up_requests_total'" in problems[0] and graph["title"] in problems[0]
    assert "'kvroute_in_flight' has no label(s) ['tier']" in problems[1]


def test_gateway_series_behind_the_panels_hold_real_values(gateway_exposition):
    s = _series(gateway_exposition)
    assert _value(s, "kvroute_requests_total", worker="w0", status="200") == 2
    assert _value(s, "kvroute_ttft_seconds_count", worker="w0") == 2
    # the second request hit the first one's prefix: whole blocks, predicted and reported
    actual = _value(s, "kvroute_actual_cached_tokens_sum", worker="w0")
    assert actual >= 4 * BLOCK_SIZE_TOKENS and actual % BLOCK_SIZE_TOKENS == 0
    assert _value(s, "kvroute_predicted_cached_tokens_sum", worker="w0") >= 4 * BLOCK_SIZE_TOKENS
    assert _value(s, "kvroute_cached_tokens_error_tokens_count", worker="w0") == 2
    assert _value(s, "kvroute_worker_blocks", worker="w0", tier="gpu") >= actual / BLOCK_SIZE_TOKENS
    assert _value(s, "kvroute_worker_blocks", worker="w0", tier="cpu") == 0
    assert _value(s, "kvroute_worker_event_batches_received_total", worker="w0") >= 1
    assert _value(s, "kvroute_worker_event_gaps_total", worker="w0") == 0
    assert 0 <= _value(s, "kvroute_worker_events_age_seconds", worker="w0") < 60
    assert _value(s, "kvroute_worker_events_live", worker="w0") == 1
    assert sum(v for (name, _), v in s.items() if name == "kvroute_route_decisions_total") == 2
    assert _value(s, "kvroute_dispatch_queue_wait_seconds_count") == 2
    assert _value(s, "kvroute_ttft_prediction_ratio_count", worker="w0") >= 1


def test_each_important_family_has_a_panel(dashboard, gateway_families, vllm_families):
    families = {**vllm_families, **gateway_families}
    plotted: dict[str, set[str]] = {}
    for where, _, selectors in dashboard_selectors(dashboard):
        if where.startswith("panel "):
            for sel in selectors:
                fam = resolve(sel.metric, families)
                if fam is not None:
                    plotted.setdefault(fam, set()).add(where)
    missing = {topic: sorted(fams - set(plotted)) for topic, fams in REQUIRED_FAMILIES.items() if fams - set(plotted)}
    assert not missing, f"families without a panel: {missing}"
