"""The gateway config's ``discovery`` section (pydantic, like :mod:`router.config.schema`).

Kept apart from :mod:`router.config.schema` so that module only names :class:`DiscoveryConfig`; nothing
here imports the ``kubernetes`` client (it is imported only when discovery runs). Read at start:
a ``SIGHUP`` reload leaves discovery (and the workers it found) as they are::

    discovery:
      kubernetes:
        namespace: null              # null: the gateway pod's own namespace (in-cluster), else
                                     # the kubeconfig context's, else "default"
        label_selector: "app.kubernetes.io/name=vllm-worker"
        model: qwen2.5-1.5b-instruct # the served model of every selected pod (a ``models`` name)
        port: http                   # the pod's OpenAI HTTP port: a number, or a containerPort name
        scheme: http                 # http | https
        events_port: null            # vLLM's ZMQ KV-event PUB port on the pod IP (number or name);
        replay_port: null            #   null: no embedded subscription (a `kvroute agent` sidecar
                                     #   writes the Redis index instead) / no replay endpoint
        role_label: kvroute.io/role  # the pod label naming its role: prefill | decode | both
                                     # (absent: both; another value: the pod is skipped, logged)
        not_ready_remove_s: 30       # a Ready pod that turns not Ready is drained at once and
                                     # removed when still not Ready after this long (0: at once);
                                     # one whose IP was cleared or changed (an eviction) or that
                                     # was replaced (another uid) is removed at once regardless
        api_server: null             # e.g. http://127.0.0.1:8001 (`kubectl proxy`): no auth;
        kubeconfig: null             #   else in-cluster config when in a pod, else this kubeconfig
        context: null                #   file ($KUBECONFIG / ~/.kube/config when null) and context
        watch_timeout_s: 300         # each watch request's server-side timeoutSeconds
        backoff_initial_s: 0.5       # first wait after an API error; doubles up to backoff_max_s
        backoff_max_s: 30
"""
from __future__ import annotations

import re
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

# an IANA_SVC_NAME, as a containerPort's ``name`` must be: 1-15 chars, lowercase alphanumerics and
# '-', at least one letter, no leading, trailing or doubled '-'
_PORT_NAME = re.compile(r"^(?=.*[a-z])[a-z0-9]([a-z0-9]|-(?!-)){0,14}$")
# a label key: an optional DNS-subdomain prefix and '/', then a name of 1-63 characters,
# alphanumerics with '-', '_' or '.' inside
_LABEL_NAME = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9._-]{0,61}[A-Za-z0-9])?$")
_LABEL_PREFIX = re.compile(r"^[a-z0-9]([a-z0-9-]*[a-z0-9])?(\.[a-z0-9]([a-z0-9-]*[a-z0-9])?)*$")
DEFAULT_ROLE_LABEL = "kvroute.io/role"

PortRef = int | str


def _check_port_ref(v: PortRef | None) -> PortRef | None:
    if v is None:
        return v
    if isinstance(v, bool):
        raise ValueError("a port must be a number or a containerPort name")
    if isinstance(v, int):
        if not 1 <= v <= 65535:
            raise ValueError(f"port {v} not in 1..65535")
        return v
    if not _PORT_NAME.match(v) or v.endswith("-"):
        raise ValueError(f"{v!r} is not a containerPort name (IANA_SVC_NAME: 1-15 lowercase letters, "
                         f"digits and single '-', with a letter)")
    return v


class KubernetesDiscoveryConfig(BaseModel):
    """Workers from the pods matching ``label_selector`` in ``namespace`` (see the module
    docstring for every field). Port fields take a number or the ``name`` of a containerPort of
    the pod's containers. Raises pydantic ValidationError on a bad value."""

    model_config = ConfigDict(extra="forbid")

    namespace: str | None = Field(None, min_length=1)
    label_selector: str = Field(min_length=1)
    model: str = Field(min_length=1)
    port: PortRef = 8000
    scheme: str = "http"
    events_port: PortRef | None = None
    replay_port: PortRef | None = None
    role_label: str = DEFAULT_ROLE_LABEL
    not_ready_remove_s: float = Field(30.0, ge=0)
    api_server: str | None = None
    kubeconfig: str | None = None
    context: str | None = None
    watch_timeout_s: int = Field(300, ge=1, le=3600)
    backoff_initial_s: float = Field(0.5, gt=0)
    backoff_max_s: float = Field(30.0, gt=0)

    @field_validator("port", "events_port", "replay_port")
    @classmethod
    def _check_ports(cls, v: PortRef | None) -> PortRef | None:
        return _check_port_ref(v)

    @field_validator("role_label")
    @classmethod
    def _check_role_label(cls, v: str) -> str:
        prefix, slash, name = v.rpartition("/")
        if not _LABEL_NAME.match(name) or (slash and (len(prefix) > 253 or not _LABEL_PREFIX.match(prefix))):
            raise ValueError(f"role_label must be a label key ([dns-prefix/]name, name 1-63 alphanumerics "
                             f"and '-', '_', '.'), got {v!r}")
        return v

    @field_validator("scheme")
    @classmethod
    def _check_scheme(cls, v: str) -> str:
        if v not in ("http", "https"):
            raise ValueError(f"scheme must be http or https, got {v!r}")
        return v

    @field_validator("api_server")
    @classmethod
    def _check_api_server(cls, v: str | None) -> str | None:
        if v is None:
            return v
        parts = urlsplit(v)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"api_server must be an http(s) URL, got {v!r}")
        return v.rstrip("/")

    @model_validator(mode="after")
    def _check_backoff(self) -> "KubernetesDiscoveryConfig":
        if self.backoff_max_s < self.backoff_initial_s:
            raise ValueError("backoff_max_s must be at least backoff_initial_s")
        if self.replay_port is not None and self.events_port is None:
            raise ValueError("replay_port needs events_port (the replay socket only repairs that stream)")
        return self


class DiscoveryConfig(BaseModel):
    """Dynamic worker sources; ``kubernetes``: pods by label selector (None: off)."""

    model_config = ConfigDict(extra="forbid")

    kubernetes: KubernetesDiscoveryConfig | None = None
