"""Fleet size from a knee: replicas = ceil(peak chats x (1 + headroom) / knee), and the cost."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from chatfleet.errors import ConfigError


@dataclass(frozen=True)
class FleetPlan:
    knee: float  # live chats one replica holds inside the SLO
    peak_chats: int
    headroom: float  # 0.2: provision 20% above the peak
    replicas: int
    gpus_per_replica: int
    gpus: int
    price_per_gpu_hour: float | None
    cost_per_hour: float | None
    cost_per_conversation_hour: float | None  # fleet cost per hour / peak live chats

    def to_dict(self) -> dict:
        return asdict(self)


def plan_fleet(knee: float | None, peak_chats: int, headroom: float = 0.0, price_per_gpu_hour: float | None = None,
               gpus_per_replica: int = 1) -> FleetPlan:
    if knee is None or knee <= 0:
        raise ConfigError("no knee: the lowest load already broke the SLO, so no fleet size can be given")
    if peak_chats < 1:
        raise ConfigError(f"peak chats must be >= 1, got {peak_chats}")
    if headroom < 0:
        raise ConfigError(f"headroom must be >= 0, got {headroom}")
    if gpus_per_replica < 1:
        raise ConfigError("gpus_per_replica must be >= 1")
    if price_per_gpu_hour is not None and price_per_gpu_hour < 0:
        raise ConfigError("price per GPU-hour must be >= 0")
    replicas = math.ceil(peak_chats * (1.0 + headroom) / knee - 1e-9)
    gpus = replicas * gpus_per_replica
    cost = gpus * price_per_gpu_hour if price_per_gpu_hour is not None else None
    return FleetPlan(knee, peak_chats, headroom, replicas, gpus_per_replica, gpus, price_per_gpu_hour, cost,
                     cost / peak_chats if cost is not None else None)
