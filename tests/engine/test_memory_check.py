"""KV pools are checked against the memory the machine has free, before anything is allocated."""

from __future__ import annotations

import pytest

from chatfleet.engine import memory_check
from chatfleet.engine.memory_check import FreeMemory, check_fits, check_kv_fits, host_memory
from chatfleet.errors import ConfigError

GiB = 1 << 30


def test_host_memory_reads_memavailable(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       25165824 kB\nMemFree:         1048576 kB\nMemAvailable:   20971520 kB\n")
    assert host_memory(meminfo) == FreeMemory(20 * GiB, 24 * GiB, "host")
    meminfo.write_text("garbage\n")
    assert host_memory(meminfo) is None
    assert host_memory(tmp_path / "missing") is None


def test_a_pool_over_the_free_memory_is_one_clear_line():
    machine = FreeMemory(20 * GiB, 24 * GiB, "host")
    check_fits(19 * GiB, "the KV cache", "--kv-cache-memory", machine)
    check_fits(40 * GiB, "the KV cache", "--kv-cache-memory", None)  # unknown: not checked
    with pytest.raises(ConfigError) as err:
        check_fits(40 * GiB, "the KV cache", "--kv-cache-memory", machine)
    assert str(err.value) == ("the KV cache of 40.0 GiB does not fit: this machine has 20.0 GiB free of "
                              "24.0 GiB; lower --kv-cache-memory")
    with pytest.raises(ConfigError, match="cuda:0 has 1.0 GiB free of 80.0 GiB"):
        check_fits(2 * GiB, "the KV cache", "--kv-cache-memory", FreeMemory(GiB, 80 * GiB, "cuda:0"))


def test_on_cpu_the_host_tier_shares_the_machine_with_the_device_pool(monkeypatch):
    monkeypatch.setattr(memory_check, "host_memory", lambda: FreeMemory(20 * GiB, 24 * GiB, "host"))
    check_kv_fits(12 * GiB, 8 * GiB, "cpu")
    with pytest.raises(ConfigError, match="host KV tier of 9.0 GiB .* 8.0 GiB free"):
        check_kv_fits(12 * GiB, 9 * GiB, "cpu")
    with pytest.raises(ConfigError, match="--kv-cache-memory or --kv-cache-tokens"):
        check_kv_fits(21 * GiB, 0, "cpu")


def test_the_engine_checks_a_pool_given_in_tokens_before_allocating_it():
    from chatfleet.engine.config import CacheConfig, EngineConfig
    from chatfleet.engine.engine import Engine

    with pytest.raises(ConfigError, match="does not fit"):
        Engine(EngineConfig(model="tiny", dtype="float32", cache=CacheConfig(num_tokens=10**11)))
