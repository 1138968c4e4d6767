"""lab.metrics_page: the benchmarks' worker fleets answer ``/metrics/?name[]=...`` as vLLM's mount of
prometheus_client does, checked against prometheus_client's own filter on a vLLM-shaped page."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Gauge, Histogram, generate_latest

from lab.metrics_page import NamedPages, metric_name, restrict
from router.workers.calls import FILTER_QUERY, parse_engine_load

NAMES = ["vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"]


def vllm_like_registry() -> CollectorRegistry:
    reg = CollectorRegistry()
    labels = ["engine", "model_name"]
    for name, value in zip(NAMES, (3, 5, 0.25)):
        Gauge(name, f"{name} help", labels, registry=reg).labels("0", "tiny").set(value)
    Gauge("vllm:num_preemptions", "other gauge", labels, registry=reg).labels("0", "tiny").set(7)
    h = Histogram("vllm:time_to_first_token_seconds", "ttft", labels, registry=reg, buckets=(0.1, 1.0))
    h.labels("0", "tiny").observe(0.5)
    return reg


def families(text: str) -> dict[str, list[str]]:
    """Each metric's lines in their order (prometheus_client's filter puts the families in the
    order of a set, so only each family's lines are compared)."""
    out: dict[str, list[str]] = {}
    for line in text.splitlines():
        out.setdefault(metric_name(line), []).append(line)
    return out


def test_the_restricted_page_is_prometheus_clients_own_for_the_gauges_the_gateway_asks():
    reg = vllm_like_registry()
    page = generate_latest(reg).decode()
    want = generate_latest(reg.restricted_registry(NAMES)).decode()
    got = restrict(page, NAMES)
    assert families(got) == families(want)
    assert set(families(got)) == set(NAMES) and len(got.splitlines()) == 9
    assert "vllm:num_preemptions" not in got and "time_to_first_token" not in got
    # the gateway's scrape reads its load figures from the restricted page as from the whole one
    assert parse_engine_load(got) == parse_engine_load(page)
    assert all(f"name%5B%5D={n}" in FILTER_QUERY for n in NAMES)


def test_metric_name_reads_help_type_and_sample_lines():
    assert metric_name('# HELP vllm:num_requests_running Number of requests') == "vllm:num_requests_running"
    assert metric_name("# TYPE vllm:num_requests_running gauge") == "vllm:num_requests_running"
    assert metric_name('vllm:num_requests_running{engine="0",model_name="tiny"} 3.0') == "vllm:num_requests_running"
    assert metric_name("process_open_fds 12.0") == "process_open_fds"
    assert metric_name("# EOF") == ""


def test_named_pages_answer_any_order_of_names_with_one_page():
    page = generate_latest(vllm_like_registry()).decode()
    pages = NamedPages(page)
    first = pages.of(NAMES)
    assert pages.of(list(reversed(NAMES))) is first
    assert pages.of(["vllm:num_preemptions"]).splitlines() == [
        "# HELP vllm:num_preemptions other gauge", "# TYPE vllm:num_preemptions gauge",
        'vllm:num_preemptions{engine="0",model_name="tiny"} 7.0']
    assert pages.of([]) == ""
