"""UcmCacheConnector's config: ``kv_connector_extra_config``, its keys checked (docs/engines/vllm.md
lists them).  Read by the connector and by both its sides (scheduler.py, worker.py)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional

from .. import kit
from ..kit import DEFAULT_MAX_RANKS, segment_name
from .blocks import VllmConnectorError
from .flight import DEFAULT_PEER_WAIT_S, INTENTS_SUFFIX

DEFAULT_SIZE_MB = 1024


_KNOWN = {"segment", "size_mb", "max_ranks", "namespace", "checksum", "load_failure_policy",
          "stats_file", "layerwise", "peer_wait_s", "copy_cpus"}


@dataclass
class ConnectorConfig:
    """kv_connector_extra_config, checked (see the module docstring).  Unknown keys raise, so a
    misspelt key is not silently ignored."""

    segment: Optional[str] = None
    size_mb: float = DEFAULT_SIZE_MB
    max_ranks: int = DEFAULT_MAX_RANKS
    namespace: str = ""
    checksum: bool = True
    layerwise: bool = True
    load_failure_policy: str = "recompute"
    stats_file: Optional[str] = None
    peer_wait_s: float = DEFAULT_PEER_WAIT_S
    copy_cpus: str = "spare"

    @classmethod
    def from_extra(cls, extra: Optional[Dict[str, Any]]) -> "ConnectorConfig":
        extra = dict(extra or {})
        where, error = "kv_connector_extra_config", VllmConnectorError
        kit.check_known(extra, _KNOWN, where=where, who="UcmCacheConnector", error=error)
        cfg = cls()
        if extra.get("segment") not in (None, ""):
            s = str(extra["segment"])
            if s.endswith(INTENTS_SUFFIX):
                # the companion segments of engines' segments bear these names (DESIGN 4.15)
                raise VllmConnectorError(
                    f"kv_connector_extra_config 'segment' {s!r} ends in {INTENTS_SUFFIX!r}, "
                    f"which names the intents segment of another segment: choose another name")
            cfg.segment = segment_name(s)
        cfg.size_mb = kit.check_number(extra, "size_mb", cfg.size_mb, unit="MiB", above=0,
                                       where=where, error=error)
        cfg.max_ranks = kit.check_int(extra, "max_ranks", cfg.max_ranks, minimum=2, maximum=63,
                                      where=where, error=error)
        if "namespace" in extra:
            cfg.namespace = str(extra["namespace"])
        cfg.checksum = kit.check_bool(extra, "checksum", cfg.checksum, where=where, error=error)
        cfg.layerwise = kit.check_bool(extra, "layerwise", cfg.layerwise, where=where,
                                       error=error)
        cfg.load_failure_policy = kit.check_choice(extra, "load_failure_policy",
                                                   cfg.load_failure_policy,
                                                   ("recompute", "fail"), where=where,
                                                   error=error)
        if extra.get("stats_file") not in (None, ""):
            cfg.stats_file = str(extra["stats_file"])
        cfg.copy_cpus = kit.check_choice(extra, "copy_cpus", cfg.copy_cpus, ("spare", "inherit"),
                                         where=where, error=error)
        cfg.peer_wait_s = kit.check_number(extra, "peer_wait_s", cfg.peer_wait_s,
                                           unit="seconds", minimum=0, maximum=3600,
                                           where=where, error=error)
        return cfg
